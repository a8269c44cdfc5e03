"""Shared fixtures: the repo root on sys.path, tiny generated datasets, and a script runner."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


# Timeouts only stop hangs: generous, and scaled by one setting on slow machines (KILN_TEST_TIMEOUT_SCALE=3)
TIMEOUT_SCALE = float(os.environ.get('KILN_TEST_TIMEOUT_SCALE', 1))


def timeout(seconds=600):
    """A subprocess timeout for tests: `seconds` times KILN_TEST_TIMEOUT_SCALE."""
    return seconds * TIMEOUT_SCALE


def run_script(*args, cwd=REPO, env=None, timeout_seconds=600):
    """Run a repo script (e.g. 'train.py', '--epochs', '1') in a subprocess; return the CompletedProcess."""
    command = [sys.executable, *args] if args[0].endswith('.py') else list(args)
    return subprocess.run(
        command,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout(timeout_seconds),
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope='session')
def tiny_shapes(tmp_path_factory):
    """A small copy of the shapes dataset (96 train, 48 val images, 6 classes); returns its folder."""
    from data.shapes import generate_shapes

    return generate_shapes(str(tmp_path_factory.mktemp('data') / 'shapes'), train_size=96, val_size=48)


def tiny_run_args(shapes_dir, checkpoints_dir):
    """Command-line options for a fast 2-epoch training run on a tiny dataset, on the CPU (so runs compare
    bit for bit on any machine; tests/test_gpu.py covers the GPU)."""
    return [
        '--data_type',
        'list',
        '--train_list',
        os.path.join(shapes_dir, 'train.txt'),
        '--val_list',
        os.path.join(shapes_dir, 'val.txt'),
        '--checkpoints_dir',
        str(checkpoints_dir),
        '--epochs',
        '2',
        '--batch_size',
        '16',
        '--no-progress_bar',
        '--num_workers',
        '0',
        '--cpu',
    ]


@pytest.fixture
def tiny_args(tiny_shapes, tmp_path):
    """tiny_run_args writing under this test's tmp_path."""
    return tiny_run_args(tiny_shapes, tmp_path / 'ck')


def run_files(folder):
    """The file names in a run folder, sorted, with every TensorBoard event file named 'events'."""
    return sorted(name if not name.startswith('events.') else 'events' for name in os.listdir(folder))
