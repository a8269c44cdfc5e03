"""Shared fixtures: the repo root on sys.path, tiny generated datasets, and a script runner."""

import contextlib
import hashlib
import io
import os
import re
import runpy
import signal
import subprocess
import sys
import traceback

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# one thread per process: the test workers already use every core, and oversubscribed threads spin
os.environ.setdefault('OMP_NUM_THREADS', '1')


# Timeouts only stop hangs: generous, and scaled by one setting on slow machines (KILN_TEST_TIMEOUT_SCALE=3)
TIMEOUT_SCALE = float(os.environ.get('KILN_TEST_TIMEOUT_SCALE', 1))


def timeout(seconds=600):
    """A subprocess timeout for tests: `seconds` times KILN_TEST_TIMEOUT_SCALE."""
    return seconds * TIMEOUT_SCALE


ENTRY_SCRIPTS = ('train.py', 'eval.py', 'predict.py')


def run_script(*args, cwd=REPO, env=None, timeout_seconds=600, isolated=False):
    """Run a repo script (e.g. 'train.py', '--epochs', '1') as `python <script> <args>` would; return a
    CompletedProcess. train.py, eval.py and predict.py run in this process (they are entry points with
    one-line errors and exit codes, so this is the same run without a second interpreter loading torch);
    anything else, a run with its own `env` or `cwd`, or `isolated=True` (signals, kills, resource
    limits) gets a real subprocess."""
    args = [str(a) for a in args]
    if args[0] in ENTRY_SCRIPTS and cwd == REPO and env is None and not isolated:
        return run_in_process(*args)
    command = [sys.executable, *args] if args[0].endswith('.py') else args
    return subprocess.run(
        command,
        cwd=cwd,
        capture_output=True,
        text=True,
        errors='surrogateescape',  # names printed as their bytes (utils.errors.print_names_as_their_bytes)
        timeout=timeout(timeout_seconds),
        env={**os.environ, **(env or {})},
    )


def run_in_process(script, *args):
    """`python <script> <args>` in this process: its exit code, stdout and stderr as a CompletedProcess."""
    stdout, stderr = io.StringIO(), io.StringIO()
    saved_argv, saved_cwd, code = sys.argv, os.getcwd(), 0
    saved_interrupt = signal.getsignal(signal.SIGINT)  # the script's own (utils.errors.quiet_interrupts) is for it
    sys.argv = [script, *args]
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(script, run_name='__main__')
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else 0 if exit_info.code is None else 1
        if isinstance(exit_info.code, str):
            stderr.write(exit_info.code + '\n')
    except Exception:  # noqa: BLE001 - what the interpreter would print and exit 1 with
        traceback.print_exc(file=stderr)
        code = 1
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        signal.signal(signal.SIGINT, saved_interrupt)
    return subprocess.CompletedProcess([script, *args], code, stdout.getvalue(), stderr.getvalue())


@pytest.fixture(autouse=True)
def seeded_torch():
    """A test that draws from torch's global generator (torch.randn for a shape check) draws the same
    numbers whichever tests ran before it in its worker (torch imported by the test's module, or not at all)."""
    if 'torch' in sys.modules:
        sys.modules['torch'].manual_seed(0)


@pytest.fixture(scope='session', autouse=True)
def no_cache_left_for_temporary_lists(tmp_path_factory):
    """data/generated/.cache keeps a file per list that runs read (decoded images, passed header checks),
    named by a hash of the list's path. The suite's lists live in its temporary folders: at the end,
    their cache files go too, so that the suite leaves the working tree as it found it."""
    yield
    cache = os.path.join(REPO, 'data', 'generated', '.cache')
    if not os.path.isdir(cache):
        return
    temporary = set()
    for folder, folders, files in os.walk(tmp_path_factory.getbasetemp()):
        for name in folders + files:
            temporary.add(hashlib.sha256(os.fsencode(os.path.join(folder, name))).hexdigest()[:12])
    for name in os.listdir(cache):
        match = re.search(r'_([0-9a-f]{12})[_.]', name)
        if match and match.group(1) in temporary:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(cache, name))


@pytest.fixture(scope='session')
def tiny_shapes(tmp_path_factory):
    """A small copy of the shapes dataset (96 train, 48 val images, 6 classes); returns its folder."""
    from data.shapes import generate_shapes

    return generate_shapes(str(tmp_path_factory.mktemp('data') / 'shapes'), train_size=96, val_size=48)


def tiny_run_args(shapes_dir, checkpoints_dir):
    """Command-line options for a fast 2-epoch training run on a tiny dataset, on the CPU (so runs compare
    bit for bit on any machine; the CUDA tests in test_scale.py and test_data_path.py cover the GPU)."""
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


def tiny_seg_args(shapes_dir, checkpoints_dir):
    """tiny_run_args on the tiny shapes' segmentation lists (the masks); add --task segment to train."""
    args = tiny_run_args(shapes_dir, checkpoints_dir)
    args[args.index('--data_type') + 1] = 'seg_list'
    args[args.index('--train_list') + 1] = os.path.join(shapes_dir, 'seg_train.txt')
    args[args.index('--val_list') + 1] = os.path.join(shapes_dir, 'seg_val.txt')
    return args


@pytest.fixture
def tiny_args(tiny_shapes, tmp_path):
    """tiny_run_args writing under this test's tmp_path."""
    return tiny_run_args(tiny_shapes, tmp_path / 'ck')


def train_succeeds(args, *extra):
    """train.py with `args` and `extra` (see run_script), asserting that it succeeded; its CompletedProcess."""
    result = run_script('train.py', *args, *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def experiment_of(args, model='small_cnn', data='list'):
    """The experiment folder a run of tiny_run_args-style `args` makes: <checkpoints_dir>/<model>_<data>_default."""
    return os.path.join(args[args.index('--checkpoints_dir') + 1], f'{model}_{data}_default')


def run_files(folder):
    """The file names in a run folder, sorted, with every TensorBoard event file named 'events'."""
    return sorted(name if not name.startswith('events.') else 'events' for name in os.listdir(folder))


def copy_of_the_project(dest):
    """Copy the project into `dest` as scripts/new_task.py does: as committed (git archive HEAD), or,
    outside a git checkout (a project just made from Kiln), every file but outputs and caches."""
    sys.path.insert(0, os.path.join(REPO, 'scripts'))
    try:
        from new_task import copy_template
    finally:
        sys.path.pop(0)
    copy_template(str(dest))


def project_files(dest):
    """The project's files (relative paths) in a copy of it made by `copy_of_the_project`."""
    return sorted(
        os.path.relpath(os.path.join(folder, name), dest) for folder, _, names in os.walk(dest) for name in names
    )
