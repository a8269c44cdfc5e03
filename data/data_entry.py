"""Dataset names (--data_type) and the DataLoaders built from them.

To add a dataset: write one file in data/ with a Dataset class taking (args, split), where
split is 'train' or 'val', and add one line to DATASETS.
"""
import os

import torch
from torch.utils.data import DataLoader

from data.list_dataset import ListDataset
from data.mem_list_dataset import MemListDataset
from data.sampler import ResumableBatchSampler, SeededDataset
from data.seg_list_dataset import SegListDataset
from data.shapes_dataset import ShapesDataset
from data.shapes_seg_dataset import ShapesSegDataset
from utils.distributed import rank, world_size
from utils.errors import KilnError
from utils.torch_utils import seed_worker

DATASETS = {
    'shapes': ShapesDataset,
    'list': ListDataset,
    'mem_list': MemListDataset,
    'shapes_seg': ShapesSegDataset,  # segmentation (--task segment)
    'seg_list': SegListDataset,
}


def select_dataset(args, split):
    """Build the dataset named by --data_type for `split` ('train' or 'val')."""
    if args.data_type not in DATASETS:
        raise KilnError(f'unknown --data_type {args.data_type!r}; choose one of: {", ".join(sorted(DATASETS))}')
    return DATASETS[args.data_type](args, split)


def _loader(args, dataset, shuffle):
    workers = args.num_workers
    if workers is None:  # share the CPUs between the processes torchrun started on this machine
        cpus_per_process = (os.cpu_count() or 1) // int(os.environ.get('LOCAL_WORLD_SIZE', 1))
        workers = 0 if getattr(dataset, 'in_memory', False) else max(1, min(4, cpus_per_process))
    batches = ResumableBatchSampler(len(dataset), args.batch_size, shuffle, args.seed, rank(), world_size())
    return DataLoader(SeededDataset(dataset), batch_sampler=batches, num_workers=workers,
                      pin_memory=torch.cuda.is_available() and not args.cpu,
                      persistent_workers=workers > 0, worker_init_fn=seed_worker)


def select_train_loader(args):
    """DataLoader over the training split, shuffled by (--seed, epoch); see data/sampler.py."""
    return _loader(args, select_dataset(args, 'train'), shuffle=True)


def select_eval_loader(args):
    """In-order DataLoader over the validation split (or --val_list)."""
    return _loader(args, select_dataset(args, 'val'), shuffle=False)
