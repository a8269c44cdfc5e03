"""An object-detection dataset read from a list file: one image per line with its boxes,

    images/00001.png 12,8,30,26,2 40.5,33,58,50,0

each box `x1,y1,x2,y2,class` in pixels of the image as shown (turned upright by its EXIF orientation,
as image viewers and labelling tools show it; x2, y2 exclusive), classes indexing
`classes.txt` beside the list; a path alone is an image without objects. Paths, comments, quotes
and encodings as for every list file (data/list_file.py).
"""

import contextlib
import math

import numpy as np
import torch

from data.image_io import IMAGE_EXTENSIONS
from data.list_dataset import ListDataset
from utils.errors import KilnError


def _looks_like_path(field):
    """Whether a list line's `field` looks like a piece of a file path: it has a slash or an image extension."""
    return '/' in field or '\\' in field or field.lower().endswith(IMAGE_EXTENSIONS)


class DetListDataset(ListDataset):
    """Images with any number of boxes; crops and flips move the boxes with the pixels.
    A sample is {'image': uint8 (3, S, S), 'boxes': float32 (k, 4) xyxy pixels at size S,
    'box_labels': int64 (k,), 'region': float32 (4,)}, the region being the part (x0, y0, x1, y1) of
    the image that became the S x S picture (so eval.py and predict.py write boxes in the image's own
    pixels); batches pad the boxes (labels -1), see data/loader.py."""

    targets = ('boxes', 'box_labels')
    augment = ('crop',)
    columns = None  # as many boxes as the image has
    renumber_classes = None  # class numbers are in the box lines: the names must match as they are

    def parse_target(self, fields, number):
        """(boxes (k, 4) float32, labels (k,) int64) from `x1,y1,x2,y2,class` fields."""
        boxes, labels = [], []
        for field in fields:
            try:
                x1, y1, x2, y2, label = field.split(',')
                box, label = [float(v) for v in (x1, y1, x2, y2)], int(label)
            except ValueError:
                box, label = None, -1
            finite = box is not None and all(math.isfinite(value) for value in box)  # inf would clip to an edge
            if not finite or label < 0 or not (box[2] > box[0] and box[3] > box[1]):
                raise KilnError(
                    f'{self.list_path}:{number}: expected boxes as "x1,y1,x2,y2,class" of finite numbers with '
                    f'x2 > x1, y2 > y1 and a class >= 0, got {field!r}{self.box_hint(field, fields)}'
                )
            boxes.append(box)
            labels.append(label)
        return np.array(boxes, dtype=np.float32).reshape(-1, 4), np.array(labels, dtype=np.int64)

    @staticmethod
    def box_hint(field, fields):
        """What likely went wrong with the box `field` (one of the line's `fields`), as a parenthesis, or ''."""
        if ',' in field:  # a box with the wrong values: the message says what a box must be, and maybe why
            with contextlib.suppress(ValueError):
                x1, y1, x2, y2 = (float(value) for value in field.split(',')[:4])
                if x2 == x1 or y2 == y1:
                    return ' (a box of no area: drop it)'
                if x2 < x1 or y2 < y1:
                    return ' (the third and fourth values are the far corner x2,y2, not a width and height)'
            return ' (five values, with commas and no spaces: 10,10,30,20,1)' if field.count(',') < 4 else ''
        if any(_looks_like_path(f) for f in fields if ',' not in f):
            # the image path was cut at a space: its pieces were read as boxes
            return ' (a path with spaces must be quoted: "my images/a.png" 1,2,30,40,0)'
        return ' (separate the five values of a box with commas: 1,2,30,40,0)'

    def count_classes(self):
        if self.class_names:
            return len(self.class_names)
        return self.classes_of_labels(
            [(int(label), number) for _, (_, labels), number in self.samples for label in np.unique(labels)]
        )

    def check_targets(self):
        """Stop at the first class outside the class range, at boxes that are all within 0..1 (YOLO's
        normalized coordinates: in pixels they would be under one pixel and train on nothing), and at an
        image on two lines with other boxes (a line per box: an image per box, the others' objects taken
        for background)."""
        self.refuse_two_targets('lines of boxes', "put all of an image's boxes on one line")
        boxes = [boxes for _, (boxes, _), _ in self.samples if len(boxes)]
        if boxes and max(float(b.max()) for b in boxes) <= 1:
            raise KilnError(
                f'{self.list_path}: every box lies within 0..1, as normalized (YOLO) coordinates do; give '
                f'them in pixels of the image: x1,y1,x2,y2,class'
            )
        for _, (_, labels), number in self.samples:
            if len(labels) and labels.max() >= self.num_classes:
                raise KilnError(
                    f'{self.list_path}:{number}: class {labels.max()} is outside '
                    f'0..{self.num_classes - 1} (num_classes={self.num_classes}); fix the list, '
                    f'classes.txt or --num_classes'
                )

    def __getitem__(self, index):
        _, (boxes, labels), number = self.samples[index]
        image, (x0, y0, x1, y1), (width, height) = self.read(index, with_box=True)
        outside = (boxes[:, 0] >= width) | (boxes[:, 1] >= height) | (boxes[:, 2] <= 0) | (boxes[:, 3] <= 0)
        if outside.any():  # a box partly outside is clipped to the image; one wholly outside is a mistake
            box = ','.join(f'{value:g}' for value in boxes[outside.argmax()])
            raise KilnError(
                f'{self.list_path}:{number}: box {box} lies outside its image ({width}x{height} pixels, as turned '
                f'upright by its EXIF orientation); give boxes in pixels of the image itself'
            )
        # into the picture's pixels: the shown part `box` of the image became size x size
        scale = torch.tensor([self.size / (x1 - x0), self.size / (y1 - y0)] * 2, dtype=torch.float32)
        boxes = ((torch.from_numpy(boxes) - torch.tensor([x0, y0, x0, y0])) * scale).clamp(0, self.size)
        labels = torch.from_numpy(labels)
        # a box cropped away is dropped; a small one stays, however small (validation must count it), but a
        # training crop drops what it leaves under a pixel, as the crops on the device do (data/augment.py)
        sides = torch.stack([boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]], dim=1)
        kept = (sides > 0).all(1) if self.crop is None else (sides >= 1).all(1)
        region = torch.tensor([x0, y0, x1, y1], dtype=torch.float32)
        return {'image': image, 'boxes': boxes[kept], 'box_labels': labels[kept], 'region': region}
