"""Debug aids of training: --profile (torch.profiler over a few steps)."""

import contextlib
import os
import shlex

import torch


class _NoProfiler:
    def step(self):
        pass


@contextlib.contextmanager
def training_profiler(enabled, folder, wait=2, warmup=2, active=6):
    """With `enabled`, profile optimizer steps `wait`+`warmup`+1 .. +`active` (call `.step()` after each):
    writes a trace to `folder`/profile (TensorBoard's profiler tab or https://ui.perfetto.dev open it)
    and prints the operators that took the most time themselves."""
    if not enabled:
        yield _NoProfiler()
        return
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    trace_folder = os.path.join(folder, 'profile')
    with profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=tensorboard_trace_handler(trace_folder),
        record_shapes=True,
    ) as profiler:
        yield profiler
    averages = profiler.key_averages()
    on_gpu = any(getattr(event, 'self_device_time_total', 0) > 0 for event in averages)  # not with --cpu
    print(averages.table(sort_by='self_cuda_time_total' if on_gpu else 'self_cpu_time_total', row_limit=12))
    print(
        f'profile: trace in {trace_folder} (tensorboard --logdir {shlex.quote(trace_folder)}, or open the .json in '
        f'https://ui.perfetto.dev)'
    )
