"""A segmentation dataset read from a list file of `image_path mask_path` lines.

A mask is a single-channel PNG of the image's size whose pixel values are class indices.
`seg_classes.txt` (or `classes.txt`) beside the list file names the classes, background
included; without one, give --num_classes.
"""
import numpy as np
import torch
from PIL import Image
from torchvision import tv_tensors

from data.list_dataset import ListDataset
from utils.errors import KilnError


class SegListDataset(ListDataset):
    """Images with per-pixel class masks; the same random crop and flip apply to both."""

    target = 'mask'
    class_files = ('seg_classes.txt', 'classes.txt')

    def count_classes(self):
        if not self.class_names:
            raise KilnError(f'{self.list_path}: no seg_classes.txt or classes.txt beside it; give --num_classes')
        return len(self.class_names)

    def check_targets(self):
        """Masks are checked as they are read (see read_mask): reading all of them here would be slow."""

    def read_mask(self, index):
        """The int64 mask (H, W) of sample `index`, checked against the number of classes."""
        _, path, number = self.samples[index]
        try:
            with Image.open(path) as mask:
                mask = mask.convert('L') if mask.mode not in ('L', 'P', 'I') else mask
                if mask.size != (self.size, self.size):
                    mask = mask.resize((self.size, self.size), Image.NEAREST)
                values = torch.from_numpy(np.asarray(mask).astype(np.int64))
        except (OSError, ValueError) as error:
            raise KilnError(f'cannot read mask {path} ({self.list_path}:{number}): {error}') from None
        if values.max() >= self.num_classes:
            raise KilnError(f'{self.list_path}:{number}: mask {path} holds class {int(values.max())}, outside '
                            f'0..{self.num_classes - 1}; fix the mask, the classes file or --num_classes')
        return values

    def __getitem__(self, index):
        image = tv_tensors.Image(self.read(index))
        mask = tv_tensors.Mask(self.read_mask(index))
        image, mask = self.transform(image, mask)
        return image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor)

