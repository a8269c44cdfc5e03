"""Which device a process computes on, and mixed precision there."""

import contextlib

import torch

from utils.distributed import is_distributed, local_rank
from utils.errors import KilnError


def select_device(cpu=False, gpus=None):
    """The device a run uses: --cpu, else the first of --gpus, else GPU 0 when CUDA exists
    (under torchrun: the GPU of this process's LOCAL_RANK)."""
    if cpu or not torch.cuda.is_available():
        if gpus and not cpu:
            raise KilnError('--gpus was given but CUDA is not available here; drop --gpus or pass --cpu')
        return torch.device('cpu')
    if gpus and not is_distributed() and (max(gpus) >= torch.cuda.device_count() or min(gpus) < 0):
        raise KilnError(f'--gpus {gpus}: only GPUs 0..{torch.cuda.device_count() - 1} exist')
    device = torch.device('cuda', local_rank() if is_distributed() else gpus[0] if gpus else 0)
    # the current GPU too (an earlier run in this process may have set another): the events a checkpoint
    # waits on are recorded on the current GPU's stream
    torch.cuda.set_device(device)
    return device


def autocast_for(device, amp):
    """A function giving the autocast context of --amp ('off', 'bf16', 'fp16') on `device` (a null
    context for 'off')."""
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype)
