"""The list-file dataset, decoded once into memory: fastest for data that fits in RAM."""
import torch

from data.list_dataset import ListDataset


class MemListDataset(ListDataset):
    """A ListDataset whose images are all decoded at construction into one uint8 tensor."""

    in_memory = True

    def __init__(self, args, split):
        super().__init__(args, split)
        self.images = torch.stack([super(MemListDataset, self).read(i) for i in range(len(self.samples))])

    def read(self, index):
        return self.images[index]
