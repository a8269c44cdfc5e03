"""Semantic segmentation: a class per pixel; pixel accuracy and mean IoU over the whole split."""

import os

import numpy as np
import torch
from PIL import Image

from loss import select_loss
from metrics import SegmentationMetrics
from tasks.task import Task
from utils.errors import KilnError
from utils.viz import confusion_matrix_image, segmentation_grid


class SegmentTask(Task):
    """Per-pixel classification: the model gives scores (N, C, H, W); targets are `mask` (N, H, W)
    holding a class index per pixel (0 is the background)."""

    default_model = 'seg_net'
    default_data = ('shapes_seg', 'seg_list')
    monitor = 'val/miou'
    targets = ('mask',)

    def __init__(self, options, class_names=None):
        super().__init__(options, class_names)
        self.ignore = getattr(options, 'ignore_index', None)  # a mask value left out of the loss and metrics
        if self.ignore is not None:
            if self.ignore < self.num_classes:
                raise KilnError(
                    f'--ignore_index {self.ignore} is class {self.ignore} of 0..{self.num_classes - 1}; give a '
                    f'value no class has (255, the void of Pascal VOC and Cityscapes)'
                )
            self.criterion = select_loss(options.loss or self.default_loss, ignore_index=self.ignore)

    @classmethod
    def metric_names(cls, options):
        return ['loss', 'pixel_acc', 'miou']

    def loss(self, outputs, batch):
        loss = super().loss(outputs, batch)
        if self.ignore is None:
            return loss
        # a batch of void pixels alone: its mean over no pixel is 0/0; it teaches nothing (0, no gradient)
        return torch.where(self.loss_weight(batch) > 0, loss, loss.new_zeros(()))

    def loss_weight(self, batch):
        """The pixels the loss is the mean over: those not --ignore_index (a batch's images hold more or
        fewer, so weighing batches by images would give a mean that depends on the batch size)."""
        return self.count(batch) if self.ignore is None else (batch['mask'] != self.ignore).sum()

    def check_outputs(self, outputs):
        if isinstance(outputs, torch.Tensor) and outputs.dim() < 4:  # a classifier's (a task of yours may read others)
            raise self.wrong_outputs(
                f'outputs of shape {tuple(outputs.shape)}', 'scores per class and pixel (N, classes, H, W)'
            )
        return outputs

    def metrics(self):
        return SegmentationMetrics(self.num_classes, ignore=self.ignore)

    def pictures(self, batch, outputs):
        count = min(self.pictured, self.count(batch))
        predicted, true = self.to_host(outputs[:count].argmax(1), batch['mask'][:count])
        images = self.display_images(batch, count)
        return {
            'segmentation': segmentation_grid(images, predicted, true, self.num_classes, class_names=self.class_names)
        }

    def result_pictures(self, metrics):
        return {'confusion_matrix': confusion_matrix_image(metrics.confusion, self.class_names)}

    eval_header = ('image', 'pixel_accuracy')

    def eval_rows(self, batch, outputs):
        """Each image's pixel accuracy, over its pixels that are not --ignore_index (nan if none is)."""
        mask = batch['mask'].flatten(1)
        counted = mask != self.ignore if self.ignore is not None else torch.ones_like(mask, dtype=torch.bool)
        right = (outputs.argmax(dim=1).flatten(1) == mask) & counted
        (accuracy,) = self.to_host(right.sum(dim=1).double() / counted.sum(dim=1))
        return [[[f'{a:.4f}']] for a in accuracy.tolist()]

    predict_header = ('image', 'mask')

    def predict_rows(self, batch, outputs, paths, folder):
        """Write each predicted mask (a class index per pixel) as masks/<n>_<image name>.png (numbered,
        so images of the same name in different folders keep their own); the row names the file. Given
        where each input came from ('region' of the upright image and its 'image_size', as predict.py
        gives them), a mask has its image's size, to lay over it; pixels the model did not see (outside
        the centred square of --resize crop) are UNSEEN."""
        (masks,) = self.to_host(outputs.argmax(dim=1))
        os.makedirs(os.path.join(folder, 'masks'), exist_ok=True)
        written = len(os.listdir(os.path.join(folder, 'masks')))  # by the batches before: once a batch, not an image
        rows = []
        for index, (path, mask) in enumerate(zip(paths, masks.numpy().astype(mask_type(self.num_classes)))):
            if 'region' in batch:
                mask = mask_on_image(mask, batch['region'][index].tolist(), batch['image_size'][index].tolist())
            stem = os.path.splitext(os.path.basename(path))[0]
            target = os.path.join(folder, 'masks', f'{written + index:05d}_{stem}.png')
            Image.fromarray(mask).save(target)
            rows.append([[target]])
        return rows


UNSEEN = 255  # a predicted mask's value where the model saw nothing of the image (65535 in 16-bit masks)


def mask_type(num_classes):
    """The type of a predicted mask: 8-bit while every class is below UNSEEN, else 16-bit (a 16-bit PNG),
    whose largest value, 65535, marks what the model did not see."""
    return np.uint8 if num_classes <= UNSEEN else np.uint16


def mask_on_image(mask, region, image_size):
    """A square predicted mask (S, S) resized (nearest) onto the `region` (x0, y0, x1, y1) of an image of
    `image_size` (width, height) that became the model's input; elsewhere the largest value of the
    mask's type (UNSEEN for 8-bit masks)."""
    width, height = image_size
    # at least one pixel each way, as data/image_io.decode_image cut the input (a region under a pixel wide)
    x0, y0 = min(round(region[0]), width - 1), min(round(region[1]), height - 1)
    x1, y1 = max(round(region[2]), x0 + 1), max(round(region[3]), y0 + 1)
    full = np.full((height, width), np.iinfo(mask.dtype).max, mask.dtype)
    full[y0:y1, x0:x1] = np.asarray(Image.fromarray(mask).resize((x1 - x0, y1 - y0), Image.NEAREST))
    return full
