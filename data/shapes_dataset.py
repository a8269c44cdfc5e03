"""The default dataset: generated shapes (data/shapes.py), read through their list files into memory."""

import os

from data.mem_list_dataset import MemListDataset
from data.shapes import generate_shapes


class ShapesDataset(MemListDataset):
    """Six classes of coloured shapes, generated into `<data_root>/shapes` on first use.
    Every shape is still the same shape mirrored, so horizontal flips are part of its augmentation."""

    augment = ('crop', 'hflip')

    def default_list(self, args, split):
        return os.path.join(generate_shapes(os.path.join(args.data_root, 'shapes')), f'{split}.txt')
