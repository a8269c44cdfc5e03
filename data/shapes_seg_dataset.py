"""The generated shapes as a segmentation task (data/shapes.py writes the masks too), in memory."""

import os

from data.mem_list_dataset import InMemory
from data.seg_list_dataset import SegListDataset
from data.shapes import generate_shapes


class ShapesSegDataset(InMemory, SegListDataset):
    """Background plus six shape classes, generated into `<data_root>/shapes` on first use."""

    augment = ('crop', 'hflip')

    def default_list(self, args, split):
        return os.path.join(generate_shapes(os.path.join(args.data_root, 'shapes')), f'seg_{split}.txt')
