"""Checkpoint files: crash-safe writing and safe loading.

A checkpoint is a dict of tensors and plain Python values, written by serializing once and
then replacing each target file atomically; it is always read with `weights_only=True`, so a
file cannot run code when loaded.
"""
import contextlib
import io
import json
import os
import pickle
import re

import torch

from utils.errors import KilnError


def atomic_write_bytes(data, path):
    """Write `data` to `path` so that a crash leaves either the old file or the new one, whole.

    The temporary file sits in the same folder (a rename across file systems is not atomic),
    is flushed to disk before the rename, and is removed if anything fails.
    """
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f'.{os.path.basename(path)}.tmp{os.getpid()}')
    try:
        with open(temporary, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself survive a power cut
    finally:
        os.close(directory)


def atomic_write_json(data, path):
    """Write `data` as indented JSON to `path` atomically (see atomic_write_bytes)."""
    atomic_write_bytes(json.dumps(data, indent=1, default=str).encode(), path)


def save_checkpoint(state, path):
    """Serialize `state` with torch.save and write it to `path` atomically."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(buffer.getvalue(), path)


def load_checkpoint(path, map_location='cpu'):
    """Load a checkpoint or state dict safely: `.safetensors` files with the safetensors package,
    anything else with `torch.load(weights_only=True)`; problems become a KilnError."""
    if not os.path.isfile(path):
        raise KilnError(f'checkpoint {path} does not exist; check --load_model_path')
    if path.endswith('.safetensors'):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(path, device=str(map_location))
        except (SafetensorError, OSError, ValueError) as error:
            raise KilnError(f'{path} is not a readable safetensors file ({error})') from None
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        blocked = re.search(r'GLOBAL ([\w.]+)', str(error))
        if isinstance(error, pickle.UnpicklingError) and blocked:
            raise KilnError(f'refusing to load {path}: it holds the Python object {blocked.group(1)}, which could run '
                            f'code and which safe loading does not allow; re-save it as a plain state dict') from None
        reason = lines[0] if lines else type(error).__name__
        if isinstance(error, pickle.UnpicklingError):
            with open(path, 'rb') as f:
                if f.read(1) == b'\x80':  # a pickle's PROTO opcode: a plain pickle, not torch.save's zip
                    raise KilnError(f'refusing to load {path}: it is a plain pickle, which could run code and which '
                                    f'safe loading does not allow; re-save it with torch.save as a state dict') \
                        from None
            reason = 'not a torch.save file'
        raise KilnError(f'{path} is not a readable PyTorch checkpoint ({reason}); '
                        f'check that the file is complete and was written by torch.save') from None


def _link_or_copy(source, target):
    """Make `target` a hard link to `source` (a copy where links are not supported), atomically."""
    temporary = os.path.join(os.path.dirname(target), f'.{os.path.basename(target)}.tmp{os.getpid()}')
    try:
        try:
            os.link(source, temporary)
        except OSError:  # e.g. a file system without hard links
            with open(source, 'rb') as f:
                atomic_write_bytes(f.read(), temporary)
        os.replace(temporary, target)
    except BaseException:
        if os.path.lexists(temporary):
            os.remove(temporary)
        raise


class CheckpointKeeper:
    """Writes the checkpoints of one experiment folder and decides which ones to keep.

    Each save writes a new file `epoch<E>_step<S>.pth` completely (atomic, fsynced), and only
    then points `last.pth` (and `best.pth` when the monitored metric improved) at it as hard
    links, records the kept files in `checkpoints.json`, and deletes files that fell out of
    the newest `keep_last` and best `keep_best`. A failed write leaves every earlier file intact.
    A keeper made for a folder with a checkpoints.json continues from it (resume).
    """

    RECORD = 'checkpoints.json'

    def __init__(self, folder, keep_last=1, keep_best=1, mode='max'):
        self.folder, self.keep_last, self.keep_best, self.mode = folder, keep_last, keep_best, mode
        self.last = []  # file names, oldest first
        self.best = []  # [metric value, file name], best first
        record = os.path.join(folder, self.RECORD)
        if os.path.exists(record):
            with open(record) as f:
                self.load_state_dict(json.load(f))

    def is_better(self, value, than):
        """Whether monitored value `value` beats `than` under the keeper's mode."""
        return value > than if self.mode == 'max' else value < than

    def save(self, state, name, metric=None):
        """Write `state` as `name`, update last/best, prune; return whether it became the best.

        `metric` is the monitored value for this state, or None (a save between validations),
        which makes it a candidate for `last` only.
        """
        path = os.path.join(self.folder, name)
        try:
            save_checkpoint(state, path)
            _link_or_copy(path, os.path.join(self.folder, 'last.pth'))
            self.last = [n for n in self.last if n != name] + [name]
            is_best = metric is not None and (not self.best or self.is_better(metric, self.best[0][0]))
            if is_best:
                _link_or_copy(path, os.path.join(self.folder, 'best.pth'))
            if metric is not None:
                self.best = sorted([b for b in self.best if b[1] != name] + [[metric, name]],
                                   key=lambda b: b[0], reverse=self.mode == 'max')
            dropped = self._forget_extra()
            atomic_write_json(self.state_dict(), os.path.join(self.folder, self.RECORD))
        except OSError as error:
            raise KilnError(f'could not write checkpoint {path} ({error.strerror or error}); the previous '
                            f'checkpoints are intact: free space or fix permissions, then continue with --resume') \
                from None
        for name in dropped:  # only now that the record no longer lists them
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.folder, name))
        return is_best

    def _forget_extra(self):
        """Drop names beyond the newest keep_last and best keep_best from the lists; return the dropped ones."""
        kept = set(self.last[-self.keep_last:]) | {name for _, name in self.best[:self.keep_best]}
        dropped = (set(self.last) | {name for _, name in self.best}) - kept
        self.last = [n for n in self.last if n in kept]
        self.best = [b for b in self.best if b[1] in kept]
        return dropped

    def state_dict(self):
        """Which files are kept, as plain data (saved as checkpoints.json)."""
        return {'last': list(self.last), 'best': [list(b) for b in self.best]}

    def load_state_dict(self, state):
        """Continue from a saved `state_dict`."""
        self.last = list(state['last'])
        self.best = [list(b) for b in state['best']]
