"""The generated shapes as a detection task: 64-pixel images with 1 to 4 shapes and their boxes
(data/shapes.py writes them), read through their list files into memory."""

import os

from data.det_list_dataset import DetListDataset
from data.mem_list_dataset import InMemory
from data.shapes import generate_shape_boxes


class ShapesDetDataset(InMemory, DetListDataset):
    """Six classes of shapes, several per image, generated into `<data_root>/shapes_det` on first use.
    A mirrored shape keeps its class, so horizontal flips are part of its augmentation."""

    augment = ('crop', 'hflip')

    def default_list(self, args, split):
        return os.path.join(generate_shape_boxes(os.path.join(args.data_root, 'shapes_det')), f'{split}.txt')
