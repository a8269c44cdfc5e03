"""Running under `torchrun`: process group set-up, rank queries and the few collectives Kiln needs.

Without torchrun (no WORLD_SIZE in the environment, or WORLD_SIZE=1) every function here is a
cheap no-op, so single-process code calls them unconditionally.
"""

import ctypes
import datetime
import os
import signal

import torch
import torch.distributed as dist

from utils.errors import KilnError


def local_rank():
    """This process's rank on its machine (torchrun's LOCAL_RANK; 0 without torchrun)."""
    return int(os.environ.get('LOCAL_RANK', 0))


def init_distributed(cpu=False, gpus=None):
    """Join the process group torchrun set up (gloo on CPU, nccl on GPUs), once per process.
    Returns whether this is a multi-process run. Checked first, on every process alike: no --gpus,
    and no more processes on this machine than GPUs (unless --cpu)."""
    if int(os.environ.get('WORLD_SIZE', 1)) == 1:
        return False
    if gpus:
        raise KilnError(
            '--gpus selects GPUs in one process; under torchrun each process takes the GPU of its '
            'LOCAL_RANK: drop --gpus (use CUDA_VISIBLE_DEVICES to choose GPUs)'
        )
    use_cuda = torch.cuda.is_available() and not cpu
    processes = int(os.environ.get('LOCAL_WORLD_SIZE', 1))
    if use_cuda and processes > torch.cuda.device_count():
        raise KilnError(
            f'torchrun started {processes} processes on this machine but it has '
            f'{torch.cuda.device_count()} GPU(s); pass --cpu to train on the CPU, or use '
            f'--nproc-per-node {torch.cuda.device_count()} (at most the GPU count)'
        )
    launcher = launcher_pid()
    # until the group is joined there is nothing to save, and a worker waiting in the rendezvous (C++) takes
    # no Python signal: it dies with its launcher (at once, also when the launcher died while it started)
    die_with_parent(launcher, 128 + signal.SIGTERM)
    if use_cuda:
        torch.cuda.set_device(local_rank())
    if not dist.is_initialized():
        dist.init_process_group('nccl' if use_cuda else 'gloo', timeout=datetime.timedelta(minutes=10))
    _stop_with_launcher(launcher)
    return True


LAUNCHER_PID = 'KILN_LAUNCHER_PID'  # set by utils/torchrun.py for its workers


def launcher_pid():
    """The pid of the process that started this torchrun worker: utils.torchrun's (it says so in
    KILN_LAUNCHER_PID, true even after it died), else this process's parent now."""
    return int(os.environ.get(LAUNCHER_PID) or 0) or os.getppid()


def die_with_parent(parent, status):
    """Have Linux SIGKILL this process when its parent dies; exit with `status` now when `parent` (its
    pid) is already gone, before the signal could be asked for."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(status)


def _stop_with_launcher(launcher):
    """Have Linux signal this process when its parent (torchrun, pid `launcher`) dies, and take that as
    one SIGTERM, so a worker whose launcher was SIGKILLed saves and stops instead of training on alone.
    Linux sends the parent-death signal again as each thread of the dying launcher ends, and a second
    SIGTERM means "stop at once": so the signal is one of its own (a real-time one: SIGUSR1 and SIGUSR2
    are SLURM's and submitit's), taken once, and only when the parent is really gone (also when it went
    while this process joined the group)."""
    if LAUNCHER_GONE is None:  # not Linux
        return
    heard = []

    def launcher_gone(signum, frame):
        if os.getppid() != launcher and not heard:
            heard.append(signum)
            signal.raise_signal(signal.SIGTERM)

    try:
        signal.signal(LAUNCHER_GONE, launcher_gone)
        ctypes.CDLL(None).prctl(1, LAUNCHER_GONE)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError, ValueError):  # no prctl, or not the main thread
        return
    if os.getppid() != launcher:  # gone before the signal was asked for
        launcher_gone(LAUNCHER_GONE, None)


LAUNCHER_GONE = signal.SIGRTMIN + 2 if hasattr(signal, 'SIGRTMIN') else None  # the parent-death signal


def host_group():
    """A gloo process group for small host-side agreements (the stop flag), so they never wait for a GPU."""
    global _HOST_GROUP
    if _HOST_GROUP is None:
        _HOST_GROUP = dist.group.WORLD if dist.get_backend() == 'gloo' else dist.new_group(backend='gloo')
    return _HOST_GROUP


_HOST_GROUP = None


def wrap_model(model, options):
    """Wrap the (placed) model for several devices: DistributedDataParallel under torchrun, else
    DataParallel when several --gpus are given (the single-process legacy path), else as it is."""
    if is_distributed():
        on_gpu = next(model.parameters()).is_cuda
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank()] if on_gpu else None)
    if options.gpus and len(options.gpus) > 1 and not options.cpu:
        check_data_parallel(options)
        return torch.nn.DataParallel(model, device_ids=options.gpus)
    return model


def check_data_parallel(options):
    """Refuse what DataParallel (several --gpus in one process) gets wrong: its replicas run in threads of
    their own, which enter autocast in float16 whatever --amp says, and a compiled model's replicas all
    call the first GPU's module."""
    for wrong, why in (
        (getattr(options, 'amp', 'off') == 'bf16', '--amp bf16 (its replicas would compute in float16)'),
        (getattr(options, 'compile', False), "--compile (its replicas would all call the first GPU's model)"),
    ):
        if wrong:
            raise KilnError(
                f'--gpus {" ".join(map(str, options.gpus))} (DataParallel) does not work with {why}, given or '
                f"a checkpoint's; use one GPU, or several with torchrun (as bash scripts/train_ddp.sh does)"
            )


def without_ddp(model):
    """The model to evaluate with: a DistributedDataParallel model's own module, after one broadcast of
    rank 0's buffers (BatchNorm statistics: what DDP's next forward would send). Through DDP, every
    forward is a collective, and evaluation gives processes unequal numbers of batches (none at all where
    a split has fewer samples than processes): they would wait for each other for ever."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model
    for buffer in model.module.buffers():
        dist.broadcast(buffer, 0)
    return model.module


def is_distributed():
    """Whether this process is one of several in a process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank():
    """This process's rank (0 without torchrun)."""
    return dist.get_rank() if is_distributed() else 0


def world_size():
    """The number of processes (1 without torchrun)."""
    return dist.get_world_size() if is_distributed() else 1


def is_main_process():
    """Whether this process writes logs, checkpoints and results (rank 0)."""
    return rank() == 0


def barrier():
    """Wait until every process gets here."""
    if is_distributed():
        dist.barrier()


def collective_device():
    """Where tensors for collectives live: this process's GPU under nccl, else the CPU."""
    if is_distributed() and dist.get_backend() == 'nccl':
        return torch.device('cuda', local_rank())
    return torch.device('cpu')


def all_reduce_sum(tensor):
    """Sum `tensor` over all processes, in place; returns it."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor, group=None):
    """Maximum of `tensor` over all processes (of `group`, default all), in place; returns it."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_gather_objects(value):
    """A list with every process's `value` (picklable), indexed by rank."""
    if not is_distributed():
        return [value]
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def run_on_main_process(function, *args):
    """Run `function(*args)` on rank 0 only and give every rank its result; a KilnError there
    is raised on every rank, so no rank waits forever for one that stopped."""
    outcome = [None, None]
    if is_main_process():
        try:
            outcome = [function(*args), None]
        except KilnError as error:
            outcome = [None, str(error)]
    if is_distributed():
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise KilnError(outcome[1])
    return outcome[0]


def cleanup_distributed():
    """Leave the process group (at the end of a run)."""
    global _HOST_GROUP
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _HOST_GROUP = None
