"""In-memory datasets: decoded once into uint8 tensors that the training device batches by indexing."""
import os

from data.list_dataset import ListDataset
from data.loader import pad_collate
from utils.errors import KilnError


def available_memory():
    """Bytes of memory this machine can still give (MemAvailable), or None where unknown."""
    try:
        with open('/proc/meminfo') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class InMemory:
    """Mixin for a dataset class: decode every sample once (on first use) into whole-dataset tensors,
    `tensors()`, which data/loader.py keeps on the training device; samples are then rows of them."""

    def tensors(self):
        """{'image': (N, 3, S, S) uint8, <target>: (N, ...)}: every sample, variable-length targets padded."""
        if getattr(self, '_tensors', None) is None:
            needed = len(self) * 3 * self.size * self.size
            free = available_memory()
            if free is not None and needed > free // 2:
                raise KilnError(f'{len(self)} images of {self.size}x{self.size} need {needed / 2**30:.1f} GiB in memory '
                                f'but {free / 2**30:.1f} GiB are free; lower --img_size or read them from disk '
                                f'(--data_type list)')
            self._tensors = pad_collate([super(InMemory, self).__getitem__(i) for i in range(len(self))])
        return self._tensors

    def check_files(self):
        """Nothing to do before decoding: every file is decoded (and so checked) at the start."""
        for path, _, number in self.samples:
            if not os.path.isfile(path):
                raise KilnError(f'{self.list_path}:{number}: image {path} does not exist')

    def __getitem__(self, index):
        return {key: value[index] for key, value in self.tensors().items()}


class MemListDataset(InMemory, ListDataset):
    """A ListDataset decoded once into memory: the fastest path for data that fits (on a GPU, it stays there)."""
