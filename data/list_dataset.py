"""A dataset read from a list file of `image_path label` lines.

Image paths may be absolute or relative to the list file; blank lines and `#` comments are
ignored. A `classes.txt` beside the list file (one class name per line) names the classes and
fixes their number; without it the number of classes is the largest label + 1.
"""
import os

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from data.augment import eval_transform, train_transform
from utils.errors import KilnError


def read_list_file(list_path, target='label'):
    """Parse a list file into (image_path, target, line_number) tuples, checking every line.

    The target is an integer label (`image_path label` lines) or, with target='mask', the path
    of a mask image (`image_path mask_path` lines, for segmentation).
    """
    if not os.path.isfile(list_path):
        raise KilnError(f'list file {list_path} does not exist; check --train_list / --val_list')
    base = os.path.dirname(os.path.abspath(list_path))
    samples = []
    with open(list_path) as f:
        for number, line in enumerate(f, start=1):
            line = line.split('#', 1)[0].strip()
            if not line:
                continue
            parts = line.rsplit(maxsplit=1)
            if target == 'mask':
                if len(parts) != 2:
                    raise KilnError(f'{list_path}:{number}: expected "image_path mask_path", got {line!r}')
                value = os.path.join(base, parts[1])
                if not os.path.isfile(value):
                    raise KilnError(f'{list_path}:{number}: mask {value} does not exist')
            elif len(parts) != 2 or not parts[1].isdecimal():
                raise KilnError(f'{list_path}:{number}: expected "image_path label" with a label >= 0, got {line!r}')
            else:
                value = int(parts[1])
            path = os.path.join(base, parts[0])  # an absolute parts[0] stays as it is
            if not os.path.isfile(path):
                raise KilnError(f'{list_path}:{number}: image {path} does not exist')
            samples.append((path, value, number))
    if not samples:
        raise KilnError(f'list file {list_path} lists no images')
    return samples


def read_class_names(list_path, file_names=('classes.txt',)):
    """Class names from the first of `file_names` found beside the list file, or None."""
    for name in file_names:
        path = os.path.join(os.path.dirname(os.path.abspath(list_path)), name)
        if os.path.isfile(path):
            with open(path) as f:
                return [line.strip() for line in f if line.strip()]
    return None


def load_image(path, size, where=''):
    """Decode an image file into a uint8 RGB tensor (3, size, size); unreadable files get a KilnError."""
    try:
        with Image.open(path) as image:
            image = image.convert('RGB')
            if image.size != (size, size):
                image = image.resize((size, size), Image.BILINEAR)
            array = np.asarray(image)
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise KilnError(f'cannot read image {path}{where}: {error}; fix or remove it from the list') from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


class ListDataset(Dataset):
    """Images and labels from a list file, decoded from disk on every access.

    Constructed as `ListDataset(args, split)` with split 'train' or 'val'; the list comes from
    `--train_list` / `--val_list`, or from `default_list` for datasets that ship their own.
    """

    in_memory = False
    target = 'label'  # what follows the image path on a line (see read_list_file)
    class_files = ('classes.txt',)  # where class names are looked for, beside the list file

    def __init__(self, args, split):
        self.list_path = getattr(args, f'{split}_list') or self.default_list(args, split)
        self.size = args.img_size
        self.samples = read_list_file(self.list_path, self.target)
        self.class_names = read_class_names(self.list_path, self.class_files)
        self.num_classes = args.num_classes or self.count_classes()
        self.check_targets()
        self.transform = train_transform(args) if split == 'train' else eval_transform(args)

    def count_classes(self):
        """The number of classes when --num_classes is not given: classes.txt's, else the largest label + 1."""
        return len(self.class_names) if self.class_names else 1 + max(label for _, label, _ in self.samples)

    def check_targets(self):
        """Stop with the list file line of the first label outside the class range."""
        for _, label, number in self.samples:
            if label >= self.num_classes:
                raise KilnError(f'{self.list_path}:{number}: label {label} is outside 0..{self.num_classes - 1} '
                                f'(num_classes={self.num_classes}); fix the list, classes.txt or --num_classes')

    def default_list(self, args, split):
        """The list file used when no --<split>_list is given."""
        raise KilnError(f'--data_type {args.data_type} needs a list file: give --{split}_list PATH')

    def image_paths(self):
        """Paths of all samples, in dataset order."""
        return [path for path, _, _ in self.samples]

    def read(self, index):
        """The uint8 image tensor of sample `index`."""
        path, _, number = self.samples[index]
        return load_image(path, self.size, f' ({self.list_path}:{number})')

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.transform(self.read(index)), self.samples[index][1]
