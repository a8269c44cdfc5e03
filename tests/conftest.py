"""Shared fixtures: the repo root on sys.path, tiny generated datasets, and a script runner."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def run_script(*args, cwd=REPO, env=None, timeout=300):
    """Run a repo script (e.g. 'train.py', '--epochs', '1') in a subprocess; return the CompletedProcess."""
    command = [sys.executable, *args] if args[0].endswith('.py') else list(args)
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope='session')
def tiny_shapes(tmp_path_factory):
    """A small copy of the shapes dataset (96 train, 48 val images, 6 classes); returns its folder."""
    from data.shapes import generate_shapes
    return generate_shapes(str(tmp_path_factory.mktemp('data') / 'shapes'), train_size=96, val_size=48)


@pytest.fixture
def tiny_args(tiny_shapes, tmp_path):
    """Command-line options for a fast training run on the tiny dataset, writing under tmp_path."""
    return ['--data_type', 'list', '--train_list', os.path.join(tiny_shapes, 'train.txt'),
            '--val_list', os.path.join(tiny_shapes, 'val.txt'), '--checkpoints_dir', str(tmp_path / 'ck'),
            '--epochs', '2', '--batch_size', '16', '--no-progress_bar', '--num_workers', '0']
