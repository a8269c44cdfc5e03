"""What a training run is and how to reproduce it, written into its experiment folder."""
import dataclasses
import datetime
import json
import os
import platform
import socket
import subprocess
import sys

from utils.checkpoint import atomic_write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class TrainerRunConfig:
    """The shape of a training run, fixed when it starts (written as run_config.json)."""
    num_epochs: int
    per_device_batch_size: int
    total_batch_size: int
    gradient_accumulation_steps: int
    gradient_clip_value: float | None
    num_update_steps_per_epoch: int
    max_num_train_steps: int
    world_size: int
    is_local_process_zero: bool
    is_world_process_zero: bool
    is_distributed: bool
    mixed_precision: str

    def save(self, folder):
        """Write the config as run_config.json in `folder`."""
        atomic_write_json(dataclasses.asdict(self), os.path.join(folder, 'run_config.json'))


def _git(*command):
    try:
        result = subprocess.run(['git', *command], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def append_reproducibility_record(folder, args):
    """Add this start of the run (the first, or a resume) to `folder`/reproduce.json.

    Each entry holds the command line, the resolved options, the git commit and the diff of
    uncommitted changes, library versions, the host and the start time.
    """
    import torch
    import torchvision
    path = os.path.join(folder, 'reproduce.json')
    entries = []
    if os.path.exists(path):
        with open(path) as f:
            entries = json.load(f)
    commit = _git('rev-parse', 'HEAD')
    entries.append({
        'start_time': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
        'command': [sys.executable] + sys.argv,
        'cwd': os.getcwd(),
        'args': {k: v for k, v in sorted(vars(args).items())},
        'git_commit': commit.strip() if commit else None,
        'git_diff': _git('diff', 'HEAD'),
        'python': platform.python_version(),
        'torch': torch.__version__,
        'torchvision': torchvision.__version__,
        'host': socket.gethostname(),
        'platform': platform.platform(),
    })
    atomic_write_json(entries, path)
