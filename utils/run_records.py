"""What each run writes about itself: its options (args.txt, args.yaml), the shape of its training
(run_config.json) and a record of each start (reproduce.json: the command, git's commit and diff, library
versions, the host)."""

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import subprocess
import sys

import yaml

from options import DERIVED, saved_options
from utils.checkpoint import atomic_write_bytes, atomic_write_json

ARGS_TXT, ARGS_YAML = 'args.txt', 'args.yaml'
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def save_args(args, folder):
    """Write the options to `folder` as args.txt (for people) and args.yaml (for --config and --resume),
    as durably as checkpoints: fsynced, then renamed (a power cut leaves the old file or the new one)."""
    shown = saved_options(args)
    command = getattr(args, 'command', None) or sys.argv  # (options.parse_args records it)
    lines = ['# ' + shlex.join([os.path.basename(command[0]), *command[1:]]) + '\n']  # to paste into a shell
    width = max(map(len, shown))
    lines += [f'{k:<{width}} : {v}\n' for k, v in sorted(shown.items())]
    atomic_write_bytes(''.join(lines).encode('utf-8', 'surrogateescape'), os.path.join(folder, ARGS_TXT))  # as given
    saved = yaml.safe_dump({k: v for k, v in shown.items() if k not in DERIVED}, sort_keys=True)
    atomic_write_bytes(saved.encode(), os.path.join(folder, ARGS_YAML))


@dataclasses.dataclass(frozen=True)
class TrainerRunConfig:
    """The shape of a training run, fixed when it starts (written as run_config.json; pytorch-accelerated's
    fields, and the gradient clipping as its two options give it)."""

    num_epochs: int
    per_device_batch_size: int
    total_batch_size: int
    gradient_accumulation_steps: int
    gradient_clip_norm: float | None
    gradient_clip_value: float | None
    num_update_steps_per_epoch: int
    max_num_train_steps: int
    world_size: int
    is_local_process_zero: bool  # as pytorch-accelerated's TrainerRunConfig has them (rank 0 writes the file)
    is_world_process_zero: bool
    is_distributed: bool
    mixed_precision: str

    def save(self, folder):
        """Write the config as run_config.json in `folder`."""
        atomic_write_json(dataclasses.asdict(self), os.path.join(folder, 'run_config.json'))


def _git(*command):
    """`git COMMAND` in the template's folder, started now (its output is read by `_output`), or None. The
    folder counts as safe (safe.directory, by its real path as git before 2.46 compares it), as the code run
    from it does: a shared install owned by another user ("dubious ownership") lost its record."""
    try:
        return subprocess.Popen(
            ['git', '-c', f'safe.directory={os.path.realpath(REPO)}', *command], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
            errors='surrogateescape',  # a file name or diff line that is no UTF-8: kept as its bytes
        )  # fmt: skip
    except OSError:
        return None


def _output(process):
    """What a `_git` process printed, or None when it failed or took more than 20 s."""
    if process is None:
        return None
    try:
        stdout, _ = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return None
    return stdout if process.returncode == 0 else None


UNTRACKED_LISTED = 1000  # untracked files named in a record at most (a dataset left unignored has thousands)
UNTRACKED_SOURCE_BYTES = 1 << 20  # the untracked sources the run imported, kept whole up to this much in all
THREAD_VARIABLES = ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'CUDA_VISIBLE_DEVICES', 'CUBLAS_WORKSPACE_CONFIG')


def _untracked(listed):
    """(names, sources) of git's `ls-files --others -z` answer: the untracked files (at most
    UNTRACKED_LISTED, then a line saying how many more) and the text of those the run imported (a new
    model or dataset file, which `git diff` does not show; None for one past UNTRACKED_SOURCE_BYTES)."""
    names = sorted(name for name in (listed or '').split('\0') if name)
    inside = REPO + os.sep  # (a string test first: thousands of modules are torch's, numpy's, ...)
    modules = list(sys.modules.values()) if names else []
    imported = {
        os.path.relpath(path, REPO)
        for module in modules
        if isinstance(path := getattr(module, '__file__', None), str) and path.startswith(inside)
    }
    sources, left = {}, UNTRACKED_SOURCE_BYTES
    for name in sorted(imported.intersection(names)):
        sources[name] = None
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if os.path.getsize(os.path.join(REPO, name)) <= left:
                with open(os.path.join(REPO, name), encoding='utf-8') as f:
                    sources[name] = f.read()
                left -= len(sources[name].encode())
    more = len(names) - UNTRACKED_LISTED
    return names[:UNTRACKED_LISTED] + ([f'... and {more} more'] if more > 0 else []), sources


def _version(package):
    """The version of `package`: the module's own when it is imported, else its metadata (torchvision
    is not imported just for this: that takes seconds)."""
    if package in sys.modules:
        return getattr(sys.modules[package], '__version__', None)
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def reproducibility_record(args):
    """This start of a run (the first, or a resume): the command line and its working folder, the
    resolved options, the git commit, the diff of uncommitted changes and the untracked files (those the
    run imported whole), library versions, torch's thread count and the variables that set it (CPU results
    depend on it, in the last bits), the host and the start time. Call it from the main thread before
    DataLoader workers are forked (git starts here; a fork while git started on another thread would
    leave git's pipe open in the worker, and that thread waiting; `platform.platform()` runs `uname -p`
    the first time, so it is asked here too); `append_reproducibility_record` reads git's answers and
    adds the versions and the host, which take milliseconds to look up and start no process."""
    return {
        'start_time': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
        'command': [sys.executable, *(getattr(args, 'command', None) or sys.argv)],  # under torchrun, each process's
        'world_size': int(os.environ.get('WORLD_SIZE', 1)),  # torchrun's processes, in all and per machine
        'processes_per_machine': int(os.environ.get('LOCAL_WORLD_SIZE', 1)),
        'cwd': os.getcwd(),
        'args': {k: v for k, v in sorted(vars(args).items()) if k != 'command'},
        'git_commit': _git('rev-parse', 'HEAD'),
        'git_diff': _git('diff', 'HEAD'),
        'git_untracked': _git('ls-files', '--others', '--exclude-standard', '-z'),
        'platform': platform.platform(),
        'torch_threads': sys.modules['torch'].get_num_threads() if 'torch' in sys.modules else None,
        'environment': {name: os.environ[name] for name in THREAD_VARIABLES if name in os.environ},
    }


def append_reproducibility_record(folder, record):
    """Add `record` (a `reproducibility_record`) to `folder`/reproduce.json, one entry per start, once git
    has answered, with the library versions and the host."""
    commit, untracked = _output(record['git_commit']), _output(record['git_untracked'])
    names, sources = _untracked(untracked) if untracked is not None else (None, None)
    record = {
        **record,
        'git_commit': commit.strip() if commit else None,
        'git_diff': _output(record['git_diff']),
        'git_untracked': names,
        'git_untracked_sources': sources,
        'python': platform.python_version(),
        **{package: _version(package) for package in ('torch', 'torchvision', 'numpy')},
        'host': socket.gethostname(),
    }
    path = os.path.join(folder, 'reproduce.json')
    try:
        with open(path) as f:
            entries = json.load(f)
    except FileNotFoundError:
        entries = []
    except (OSError, ValueError):
        entries = None
    if not isinstance(entries, list):  # edited by hand, say: the earlier starts' records kept beside it
        aside = f'{path}.unreadable-{datetime.datetime.now():%Y%m%d_%H%M%S_%f}'
        os.replace(path, aside)
        print(f'note: {path} was no list of records; kept as {aside}, and a new one started', flush=True)
        entries = []
    atomic_write_json([*entries, record], path)
