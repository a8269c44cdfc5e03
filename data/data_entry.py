"""Dataset names (--data_type) and where their classes live.

To add a dataset: write data/my_dataset.py with a Dataset class taking (args, split), where split
is 'train' or 'val', and add one line here: 'my_dataset': 'data.my_dataset:MyDataset',
(This file imports nothing heavy: `--help` and name checks read it before torch loads.)
"""

from utils.registry import load_entry

DATASETS = {
    'shapes': 'data.shapes_dataset:ShapesDataset',
    'list': 'data.list_dataset:ListDataset',
    'mem_list': 'data.mem_list_dataset:MemListDataset',
    'photos': 'data.photos_dataset:PhotosDataset',  # class folders of photos: aspect kept, resized crops
    'shapes_seg': 'data.shapes_seg_dataset:ShapesSegDataset',  # segmentation (--task segment)
    'seg_list': 'data.seg_list_dataset:SegListDataset',
    'shapes_det': 'data.shapes_det_dataset:ShapesDetDataset',  # detection (--task detect)
    'det_list': 'data.det_list_dataset:DetListDataset',
}


def dataset_class(name):
    """The Dataset class registered as `name`."""
    return load_entry(DATASETS, name, '--data_type', 'data/data_entry.py')


def select_dataset(args, split):
    """Build the dataset named by --data_type for `split` ('train' or 'val')."""
    return dataset_class(args.data_type)(args, split)
