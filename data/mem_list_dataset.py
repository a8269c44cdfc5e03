"""In-memory datasets: decoded once into uint8 tensors that the training device batches by indexing.

The decoded tensors are cached in `<data_root>/.cache/` (a file per list, image size and resize mode,
replaced as they change, checked against the list's bytes and every file's size, modification and
change times), so a later run loads them in milliseconds instead of decoding every image again.
"""

import hashlib
import os
import resource

import torch

from data.list_dataset import ListDataset
from data.loader import pad_collate
from utils.checkpoint import atomic_write_bytes, remove_abandoned_temporaries
from utils.errors import KilnError, is_out_of_memory


def available_memory():
    """Bytes of memory this process can still get, or None where unknown: the least of the machine's
    (MemAvailable), its memory cgroup's limit less its use (a container's `--memory`: over it, the
    kernel kills the process without a word) and the address-space limit (`ulimit -v`) less its size."""
    found = [_meminfo('/proc/meminfo', 'MemAvailable:'), _cgroup_headroom()]
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    size = _meminfo('/proc/self/status', 'VmSize:')
    if limit != resource.RLIM_INFINITY and size is not None:
        found.append(max(0, limit - size))
    known = [bytes_ for bytes_ in found if bytes_ is not None]
    return min(known) if known else None


def _meminfo(path, key):
    """The number of kB after `key` in a /proc file, in bytes, or None."""
    try:
        with open(path) as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(key)), None)
    except OSError:
        return None


def _cgroup_headroom(own='/proc/self/cgroup', mounted='/sys/fs/cgroup'):
    """Bytes the process's memory cgroup may still use (cgroup v2 or v1), or None: no limit, or none found.
    Inside a container its own cgroup is at the root of `mounted`; outside, at its path there."""
    try:
        with open(own) as f:
            entries = [line.rstrip('\n').split(':', 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in entries:
        root, files = mounted, ('memory.max', 'memory.current')
        if controllers:  # v1: one hierarchy per controller
            if 'memory' not in controllers.split(','):
                continue
            root, files = os.path.join(mounted, 'memory'), ('memory.limit_in_bytes', 'memory.usage_in_bytes')
        for folder in (os.path.join(root, path.lstrip('/')), root):
            try:
                limit, used = (_text(os.path.join(folder, name)) for name in files)
            except OSError:
                continue
            if limit.isdecimal() and used.isdecimal() and int(limit) < 1 << 60:  # v1 says "no limit" with 2**63
                return max(0, int(limit) - int(used))
            break
    return None


def _text(path):
    with open(path) as f:
        return f.read().strip()


class InMemory:
    """Mixin for a dataset class: decode every sample once (on first use) into whole-dataset tensors,
    `tensors()`, which data/loader.py keeps on the training device; samples are then rows of them."""

    def tensors(self):
        """{'image': (N, 3, S, S) uint8, <target>: (N, ...)}: every sample, variable-length targets padded."""
        if getattr(self, '_tensors', None) is None:
            needed = len(self) * 3 * self.size * self.size
            free = available_memory()
            advice = 'lower --img_size or read them from disk (--data_type list)'
            if free is not None and needed > free // 2:
                raise KilnError(
                    f'{len(self)} images of {self.size}x{self.size} need {needed / 2**30:.1f} GiB in memory '
                    f'but {free / 2**30:.1f} GiB are free to this process; {advice}'
                )
            try:
                self._tensors = self.cached() or self.decode_all()
            except (MemoryError, RuntimeError) as error:  # past the check: the memory went to something else
                if not is_out_of_memory(error):
                    raise
                raise KilnError(
                    f'out of memory while {len(self)} images of {self.size}x{self.size} ({needed / 2**30:.1f} GiB) '
                    f'were put in memory; {advice}'
                ) from None
        return self._tensors

    def decode_all(self):
        """Decode every sample and cache the result (when the cache folder can be written)."""
        tensors = self.stacked(super().__getitem__)
        if self.cache_folder:
            try:
                os.makedirs(self.cache_folder, exist_ok=True)
                remove_abandoned_temporaries(self.cache_folder)
                # saved into the file itself: bytes in memory first were one more copy of the whole data
                atomic_write_bytes(
                    lambda f: torch.save({'key': self.cache_key(), 'tensors': tensors}, f), self.cache_path()
                )
            except (OSError, RuntimeError):  # a read-only or full disk (torch.save's writer raises RuntimeError)
                pass  # the data are decoded next time too
        return tensors

    def stacked(self, sample):
        """`pad_collate` of `sample(i)` for every index, written into whole-dataset tensors as they come: a
        list of every sample stacked at the end held the data twice. A target whose shape varies (boxes)
        is gathered and padded at the end."""
        first = sample(0)
        whole = {key: torch.empty((len(self), *torch.as_tensor(value).shape), dtype=torch.as_tensor(value).dtype)
                 for key, value in first.items()}  # fmt: skip
        varying = {}  # key -> its values so far, once one did not fit
        for index in range(len(self)):
            for key, value in (first if index == 0 else sample(index)).items():
                value = torch.as_tensor(value)
                if key not in varying and value.shape != whole[key].shape[1:]:
                    varying[key] = list(whole.pop(key)[:index])
                if key in varying:
                    varying[key].append(value)
                else:
                    whole[key][index] = value
        for key, values in varying.items():
            whole[key] = pad_collate([{key: value} for value in values])[key]
        return {key: whole[key] for key in first}  # in the samples' order of keys

    def cached(self):
        """The tensors of an earlier decoding of exactly these files, or None."""
        try:
            saved = torch.load(self.cache_path(), map_location='cpu', weights_only=True)
        except Exception:  # noqa: BLE001 - no cache, or an unreadable one: decode again
            return None
        return saved['tensors'] if saved.get('key') == self.cache_key() else None

    def cache_path(self):
        return self.cache_file(type(self).__name__, f'_{self.size}_{self.resize}.pt')

    def cache_key(self):
        """A digest of how images are decoded, of the files (ListDataset.files_digest) and of the samples as
        read, labels included: a classes file edited since renumbers them (match_classes), though the list
        and the final class order are the same."""
        decoding = f'{type(self).__name__} {self.size} {self.resize} {self.crop_pct} {self.class_names} '
        decoding += self.files_digest() + hashlib.sha256(repr(self.samples).encode()).hexdigest()
        return hashlib.sha256(decoding.encode()).hexdigest()

    decode_crops = None  # decoded once: training crops are made on the device (data/augment.py)

    def check_files(self):
        """Only that every file exists: every file is decoded (and so checked) at the start."""
        self.files_digest()

    def __getitem__(self, index):
        return {key: value[index] for key, value in self.tensors().items()}


class MemListDataset(InMemory, ListDataset):
    """A ListDataset decoded once into memory: the fastest path for data that fits (on a GPU, it stays there)."""
