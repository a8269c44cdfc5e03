"""Host memory that a training step frees is kept for the next step instead of going back to the system.

A step on the CPU allocates the same large tensors every time (a batch of float images is megabytes).
glibc's malloc decides at run time whether to hand freed memory back to the system (its "trim" and
"mmap" thresholds move as the program allocates), so depending on what else is alive between steps,
each step may get its batches' memory anew from the kernel, one page fault per 4 KiB: measured here,
a loop that keeps a few small tensors between steps (running metrics) faulted 10,000 times per epoch
where the same loop without them faulted 1,000 times, and ran 20 % slower. Fixing both thresholds
once makes every run behave like the fast case. Only glibc (Linux) has these knobs; elsewhere, and
where the user set these thresholds themselves (MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES, ...),
nothing changes.
"""

import contextlib
import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc takes: blocks below it come from the heap and are reused
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's end kept for reuse, up to this much


def keep_freed_memory():
    """Have glibc's malloc keep and reuse the memory freed between steps (no-op elsewhere); returns
    whether it did."""
    tunables = os.environ.get('GLIBC_TUNABLES', '')  # glibc.malloc.trim_threshold=...: the newer spelling
    if (
        not sys.platform.startswith('linux')
        or any(name in os.environ for name in ('MALLOC_TRIM_THRESHOLD_', 'MALLOC_MMAP_THRESHOLD_'))
        or any(name in tunables for name in ('malloc.trim_threshold', 'malloc.mmap_threshold'))
    ):
        return False
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl has no mallopt)
        mallopt = ctypes.CDLL(None).mallopt
        return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return False
