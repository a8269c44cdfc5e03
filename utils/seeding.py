"""Seeding and the random states a checkpoint keeps, so a resumed run draws the same numbers."""

import contextlib
import os
import random

import numpy as np
import torch


def set_seed(seed):
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic(enabled):
    """Use only deterministic algorithms (--deterministic), so the same run gives the same bits on a GPU
    too; or stop doing so (a second run in the same process). Switched only when it changes: turning it
    on imports torch's compiler (seconds)."""
    if torch.are_deterministic_algorithms_enabled() == enabled:
        return
    if enabled:
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')  # required by deterministic cuBLAS
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled)


@contextlib.contextmanager
def process_settings_kept():
    """Put back, when the block ends, the process-wide settings a run changes (--deterministic's
    algorithms, cuDNN benchmark and CUBLAS_WORKSPACE_CONFIG, --detect_anomaly), so that a run started
    from Python (a notebook, a script of several runs) leaves the session as it found it."""
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    anomaly = torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()
    benchmark, cublas = torch.backends.cudnn.benchmark, os.environ.get('CUBLAS_WORKSPACE_CONFIG')
    try:
        yield
    finally:
        now = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        if now != deterministic:  # (switching imports torch's compiler: only when it changed)
            torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.autograd.set_detect_anomaly(*anomaly)
        torch.backends.cudnn.benchmark = benchmark
        if cublas is None:
            os.environ.pop('CUBLAS_WORKSPACE_CONFIG', None)
        else:
            os.environ['CUBLAS_WORKSPACE_CONFIG'] = cublas


def rng_states():
    """The states of python's, numpy's and torch's (CPU and CUDA) random generators, checkpointable
    with weights_only loading (no numpy arrays). Python's 625 numbers go in one tensor: as a tuple of
    ints, copying and pickling them cost a small model's checkpoint more than its weights."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        'python': (version, torch.tensor(internal, dtype=torch.int64), gauss),
        'numpy': (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached),
        'torch': torch.get_rng_state(),
        # only where this run uses CUDA: asking would start CUDA (seconds, GPU memory) in a --cpu run
        'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        'cuda_device': torch.cuda.current_device() if torch.cuda.is_initialized() else None,  # this process's GPU
    }


def set_rng_states(states):
    """Restore generator states saved by `rng_states`: every GPU's where as many are visible, else this
    process's GPU's (the current one) from the one it computed on (another CUDA_VISIBLE_DEVICES, say)."""
    version, internal, gauss = states['python']
    random.setstate((version, tuple(internal.tolist()) if torch.is_tensor(internal) else internal, gauss))
    kind, keys, position, has_gauss, cached = states['numpy']
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(states['torch'])
    if not (states['cuda'] and torch.cuda.is_available()):
        return
    if len(states['cuda']) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states['cuda'])
    elif states.get('cuda_device') is not None:  # (absent from checkpoints of earlier Kilns)
        torch.cuda.set_rng_state(states['cuda'][states['cuda_device']])


def seed_worker(worker_id):
    """DataLoader worker_init_fn: seed python and numpy from the worker's own torch seed."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
