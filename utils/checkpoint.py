"""Checkpoint files: crash-safe writing and safe loading.

A checkpoint is a dict of tensors and plain Python values, written by serializing once and
then replacing each target file atomically; it is always read with `weights_only=True`, so a
file cannot run code when loaded.
"""
import io
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


def save_checkpoint(state, paths):
    """Serialize `state` once and write it atomically to every path in `paths`."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    for path in paths:
        atomic_write_bytes(buffer.getvalue(), path)


def load_checkpoint(path, map_location='cpu'):
    """Load a checkpoint or state dict safely (`weights_only=True`); problems become a KilnError."""
    if not os.path.isfile(path):
        raise KilnError(f'checkpoint {path} does not exist; check --load_model_path')
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
            reason = 'not a torch.save file'
        raise KilnError(f'{path} is not a readable PyTorch checkpoint ({reason}); '
                        f'check that the file is complete and was written by torch.save') from None
