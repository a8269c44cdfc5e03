"""Semantic segmentation: a class per pixel; pixel accuracy and mean IoU over the whole split."""

import os

import numpy as np
from PIL import Image

from metrics import SegmentationMetrics
from tasks.task import Task
from utils.viz import confusion_matrix_image, segmentation_grid


class SegmentTask(Task):
    """Per-pixel classification: the model gives scores (N, C, H, W); targets are `mask` (N, H, W)
    holding a class index per pixel (0 is the background)."""

    default_model = 'seg_net'
    default_data = ('shapes_seg', 'seg_list')
    monitor = 'val/miou'
    targets = ('mask',)

    @classmethod
    def metric_names(cls, options):
        return ['loss', 'pixel_acc', 'miou']

    def metrics(self):
        return SegmentationMetrics(self.num_classes)

    def pictures(self, batch, outputs):
        count = min(8, self.count(batch))
        predicted, true = self.to_host(outputs[:count].argmax(1), batch['mask'][:count])
        return {'segmentation': segmentation_grid(self.display_images(batch, count), predicted, true, self.num_classes)}

    def result_pictures(self, metrics):
        return {'confusion_matrix': confusion_matrix_image(metrics.confusion, self.class_names)}

    eval_header = ('image', 'pixel_accuracy')

    def eval_rows(self, batch, outputs):
        (accuracy,) = self.to_host((outputs.argmax(dim=1) == batch['mask']).flatten(1).double().mean(dim=1))
        return [[[f'{a:.4f}']] for a in accuracy.tolist()]

    predict_header = ('image', 'mask')

    def predict_rows(self, batch, outputs, paths, folder):
        """Write each predicted mask (a class index per pixel) as masks/<n>_<image name>.png (numbered,
        so images of the same name in different folders keep their own); the row names the file."""
        (masks,) = self.to_host(outputs.argmax(dim=1))
        os.makedirs(os.path.join(folder, 'masks'), exist_ok=True)
        rows = []
        for path, mask in zip(paths, masks.numpy()):
            number = len(os.listdir(os.path.join(folder, 'masks')))
            stem = os.path.splitext(os.path.basename(path))[0]
            target = os.path.join(folder, 'masks', f'{number:05d}_{stem}.png')
            Image.fromarray(mask.astype(np.uint8)).save(target)
            rows.append([[target]])
        return rows
