"""Debug aids of training: --profile (torch.profiler over a few steps)."""

import contextlib
import os

from utils.errors import shell_word


class _NoProfiler:
    def step(self):
        pass


@contextlib.contextmanager
def training_profiler(enabled, folder, device, wait=2, warmup=2, active=6):
    """With `enabled`, profile optimizer steps `wait`+`warmup`+1 .. +`active` (call `.step()` after each)
    on `device` (the GPU's kernels too when it is one): writes a trace to `folder`/profile (TensorBoard's
    profiler tab or https://ui.perfetto.dev open it) and prints the operators that took the most time
    themselves."""
    if not enabled:
        yield _NoProfiler()
        return
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    if not torch.cuda.is_available():
        # kineto, the profiler's library, built for CUDA logs "ERROR: ... gpuGetDeviceCount failed" on a
        # machine without one, in the middle of a run that works: level 5 shows only what it shows besides
        # errors (its USDT lines). Read as the profiler first starts; a level the user set is kept.
        os.environ.setdefault('KINETO_LOG_LEVEL', '5')
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    trace_folder = os.path.join(folder, 'profile')
    with profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=tensorboard_trace_handler(trace_folder),
        record_shapes=True,
    ) as profiler:
        yield profiler
    if not os.path.isdir(trace_folder):  # the run ended before the recorded steps
        print(
            f'profile: nothing recorded: the run made fewer than {wait + warmup + 1} optimizer steps (the profiler '
            f'skips {wait} and warms up on {warmup}, then records {active}); profile a longer run'
        )
        return
    averages = profiler.key_averages()
    print(averages.table(sort_by=f'self_{"cuda" if device.type == "cuda" else "cpu"}_time_total', row_limit=12))
    print(
        f'profile: trace in {trace_folder} (tensorboard --logdir {shell_word(trace_folder)}, or open the .json in '
        f'https://ui.perfetto.dev)'
    )
