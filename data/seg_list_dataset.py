"""A segmentation dataset read from a list file of `image_path mask_path` lines.

A mask is a single-channel PNG of the image's size whose pixel values are class indices.
`seg_classes.txt` (or `classes.txt`) beside the list file names the classes, background
included; without one, give --num_classes.
"""

import os

import numpy as np
import torch
from PIL import Image, ImageChops

from data.image_io import IMAGE_ERRORS, unreadable_reason
from data.list_dataset import ListDataset
from data.list_file import not_a_file, resolve_path
from utils.errors import KilnError


class SegListDataset(ListDataset):
    """Images with per-pixel class masks; crops and flips move the mask with the image.
    A sample is {'image': uint8 (3, S, S), 'mask': uint8 (S, S)}."""

    targets = ('mask',)
    augment = ('crop',)
    renumber_classes = None  # class numbers are in the masks: the names must match as they are
    class_files = ('seg_classes.txt', 'classes.txt')

    def __init__(self, args, split):
        self.ignore_index = getattr(args, 'ignore_index', None)  # a mask value that is no class (the void)
        super().__init__(args, split)

    def parse_target(self, fields, number):
        path = resolve_path(self.list_path, fields[0])
        if not os.path.isfile(path):
            raise KilnError(f'{self.list_path}:{number}: mask {path} {not_a_file(self.list_path, path)}')
        return path

    def count_classes(self):
        if not self.class_names:
            raise KilnError(f'{self.list_path}: no seg_classes.txt or classes.txt beside it; give --num_classes')
        return len(self.class_names)

    def check_targets(self):
        """An image listed with two masks is refused; masks are checked as they are read (see read_mask):
        reading all of them here would be slow."""
        self.refuse_two_targets('masks', 'remove one of the lines')
        if self.ignore_index is not None and self.ignore_index > 255:
            raise KilnError(f'--ignore_index {self.ignore_index}: masks hold one byte per pixel, 0 to 255')
        if self.num_classes > 256:
            raise KilnError(
                f'{self.list_path}: masks hold at most 256 classes (one byte per pixel), not {self.num_classes}'
            )

    def read_mask(self, index, box, image_size):
        """The uint8 mask (S, S) of sample `index`, the part `box` of it that its image (upright, of
        `image_size` (width, height)) shows (nearest neighbour), checked against the image's size and
        the number of classes."""
        image_path, path, number = self.samples[index]
        try:
            with Image.open(path) as mask:
                if mask.size != tuple(image_size):  # a crop of the wrong pixels would train on wrong labels
                    raise KilnError(
                        f'{self.list_path}:{number}: mask {path} is {mask.size[0]}x{mask.size[1]} pixels but its '
                        f'image {image_path} is {image_size[0]}x{image_size[1]} (as shown upright); a mask has '
                        f"its image's size"
                    )
                mask = class_numbers(mask, f'{self.list_path}:{number}: mask {path}')
                self.check_classes(mask, f'{self.list_path}:{number}: mask {path}')  # all of it, before a crop
                if mask.size != (self.size, self.size) or box != (0, 0, *mask.size):
                    mask = mask.resize((self.size, self.size), Image.NEAREST, box=box)
                values = np.asarray(mask).astype(np.int64)
        except IMAGE_ERRORS as error:
            raise KilnError(
                f'cannot read mask {path} ({self.list_path}:{number}): {unreadable_reason(error, path)}; fix or '
                f'remove it'
            ) from None
        return torch.from_numpy(values.astype(np.uint8))

    def check_classes(self, mask, where):
        """A KilnError where the one-channel `mask` holds a value that is no class: negative, of --num_classes
        or more, or not a whole number (a float mask)."""
        values = np.asarray(mask)  # (getextrema gives 255 for a 1-bit mask's 1)
        if values.dtype.kind == 'f' and not np.array_equal(values, np.floor(values)):
            fraction = values[values != np.floor(values)].flat[0]
            raise KilnError(f'{where} holds the value {fraction:g}, not a class number; a mask holds whole numbers')
        if self.ignore_index is not None:
            values = values[values != self.ignore_index]
        low, high = (values.min(), values.max()) if values.size else (0, 0)
        if low < 0 or high >= self.num_classes:
            void = (  # the usual reasons for a 255
                ' (255 is the void of Pascal VOC and Cityscapes: give --ignore_index 255 to leave it out; a '
                'mask of 0 and 255 for two classes: save it as 0 and 1)'
                if high == 255 and self.ignore_index is None
                else ''
            )
            raise KilnError(
                f'{where} holds class {low if low < 0 else high:g}, outside 0..{self.num_classes - 1}; fix the mask, '
                f'the classes file or --num_classes{void}'
            )

    def __getitem__(self, index):
        image, box, size = self.read(index, with_box=True)
        return {'image': image, 'mask': self.read_mask(index, box, size)}


def class_numbers(mask, where):
    """The one channel of class numbers of a mask image: single-channel modes (L, P, I, 1) as they are, an
    alpha channel left out (LA, PA), and a colour mode only where its channels agree (grey saved as RGB):
    a colour mask (a class per colour) would otherwise be read as brightness, wrong labels without a word."""
    if mask.format in ('JPEG', 'MPO'):  # MPO: a JPEG from a camera
        raise KilnError(
            f'{where} is a JPEG, whose lossy compression changes class numbers along every edge; save masks as '
            f'PNG (a class number per pixel, exactly)'
        )
    colours = [band for band in mask.getbands() if band != 'A']
    if len(colours) > 1 and any(
        ImageChops.difference(mask.getchannel(colours[0]), mask.getchannel(band)).getbbox() for band in colours[1:]
    ):
        raise KilnError(
            f'{where} is a colour image ({mask.mode}) whose channels differ, but a mask holds a class number per '
            f'pixel; save it with one channel (mode L, or P with a palette) whose values are the class numbers'
        )
    return mask.getchannel(colours[0]) if len(mask.getbands()) > 1 else mask
