"""Dataset names (--data_type) and where their classes live.

To add a dataset: write data/my_dataset.py with a Dataset class taking (args, split), where split
is 'train' or 'val', and add one line here: 'my_dataset': 'data.my_dataset:MyDataset',
(This file imports nothing heavy: `--help` and name checks read it before torch loads.)

What Kiln reads of a dataset: `len()`, items as dicts ({'image': uint8 (C, H, W) or a float tensor
already normalized, 'label': int, ...}), `num_classes` and `class_names` (a list, or None). Optional:
`targets` (the keys it gives beyond 'image'; default ('label',)), `resize` (how it made images square,
'squash' or 'crop': predict.py reads files the same way; default 'squash'), `augment` (its default
--augment names), `image_paths()` (eval.py's predictions.csv; else sample numbers), `list_path` (what
--fast_dev_run predicts on), `tensors()` (the whole split as tensors: batched in memory, see
data/mem_list_dataset.py). data/list_dataset.py's ListDataset has them all.
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


def resize_of(dataset):
    """How `dataset` (a Dataset class or instance) makes images square: its `resize`, else 'squash' (a
    dataset that does not say gave whole images); predict.py reads files the same way."""
    return getattr(dataset, 'resize', None) or 'squash'


def select_dataset(args, split):
    """Build the dataset named by --data_type for `split` ('train' or 'val')."""
    return dataset_class(args.data_type)(args, split)
