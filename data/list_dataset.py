"""A dataset read from a list file of `image_path label` lines (see data/list_file.py for the format:
paths relative to the list file, comments, quotes, tabs, CSV, any common encoding).

A `classes.txt` beside the list file (one class name per line) names the classes and fixes their
number; without it the number of classes is the largest label + 1.
"""

import os

import torch
from torch.utils.data import Dataset

from data.image_io import check_images, decode_image
from data.list_file import read_list_file, resolve_path
from utils.errors import KilnError


def read_class_names(list_path, file_names=('classes.txt',)):
    """Class names from the first of `file_names` found beside the list file, or None."""
    for name in file_names:
        path = os.path.join(os.path.dirname(os.path.abspath(list_path)), name)
        if os.path.isfile(path):
            return [fields[0] for _, fields in read_list_file(path, columns=1)]
    return None


class ListDataset(Dataset):
    """Images and labels from a list file, decoded from disk on every access (by DataLoader workers).

    Built as `ListDataset(args, split)` with split 'train' or 'val'; the list comes from
    `--train_list` / `--val_list`, or from `default_list` for datasets that ship their own. A sample
    is a dict {'image': uint8 (3, S, S), 'label': int64}; the training augmentation that fits the
    data is declared in `augment` (flips only where mirrored images keep their label).
    """

    targets = ('label',)  # what a sample holds besides 'image' (tasks check it)
    columns = 2  # fields per line: the image path and its label
    augment = ('crop',)  # default training augmentation (data/augment.py); --augment overrides it
    class_files = ('classes.txt',)  # where class names are looked for, beside the list file

    def __init__(self, args, split):
        self.list_path = getattr(args, f'{split}_list', None) or self.default_list(args, split)
        self.size = args.img_size
        self.samples = [
            (resolve_path(self.list_path, fields[0]), self.parse_target(fields[1:], number), number)
            for number, fields in read_list_file(self.list_path, columns=self.columns)
        ]
        self.check_files()
        self.class_names = read_class_names(self.list_path, self.class_files)
        self.num_classes = args.num_classes or self.count_classes()
        self.check_targets()

    def parse_target(self, fields, number):
        """The target of one line from its fields after the image path: an integer label >= 0."""
        (field,) = fields
        if not field.isdecimal():
            raise KilnError(
                f'{self.list_path}:{number}: expected "image_path label" with a label >= 0, got label {field!r}'
            )
        return int(field)

    def check_files(self):
        """Stop before training at the first listed file that is missing or not a readable image
        (a header check, well under a second per thousand images)."""
        for path, _, number in self.samples:
            if not os.path.isfile(path):
                raise KilnError(f'{self.list_path}:{number}: image {path} does not exist')
        for index, path, reason in check_images([path for path, _, _ in self.samples])[:1]:
            raise KilnError(
                f'cannot read image {path} ({self.list_path}:{self.samples[index][2]}): {reason}; '
                f'fix or remove it from the list'
            )

    def count_classes(self):
        """The number of classes when --num_classes is not given: classes.txt's, else the largest label + 1."""
        return len(self.class_names) if self.class_names else 1 + max(label for _, label, _ in self.samples)

    def check_targets(self):
        """Stop with the list file line of the first label outside the class range."""
        for _, label, number in self.samples:
            if label >= self.num_classes:
                raise KilnError(
                    f'{self.list_path}:{number}: label {label} is outside 0..{self.num_classes - 1} '
                    f'(num_classes={self.num_classes}); fix the list, classes.txt or --num_classes'
                )

    def default_list(self, args, split):
        """The list file used when no --<split>_list is given."""
        raise KilnError(
            f'--data_type {args.data_type} reads list files: give --{split}_list PATH '
            f'(or give the dataset a default_list)'
        )

    def image_paths(self):
        """Paths of all samples, in dataset order."""
        return [path for path, _, _ in self.samples]

    def read(self, index):
        """The uint8 image tensor (3, S, S) of sample `index`."""
        path, _, number = self.samples[index]
        return decode_image(path, self.size, f' ({self.list_path}:{number})')

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return {'image': self.read(index), 'label': torch.tensor(self.samples[index][1])}
