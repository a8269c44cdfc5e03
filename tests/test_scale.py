"""Scale and speed: DDP under torchrun on CPU (gloo, 2 processes), mixed precision, gradient
accumulation, clipping, compile, channels-last, and a training loop with no hidden host syncs."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import REPO, experiment_of, run_files, run_script, timeout, tiny_run_args, tiny_seg_args

TORCHRUN = [sys.executable, '-m', 'utils.torchrun', '--standalone', '--nproc-per-node=2']


def _torchrun(script, *args, seconds=600):
    result = subprocess.run(
        [*TORCHRUN, script, *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(seconds),
        env={**os.environ, 'OMP_NUM_THREADS': '1'},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _train(args, *extra, isolated=False):
    result = run_script('train.py', *args, *extra, isolated=isolated)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _folder(args, model='small_cnn'):
    return os.path.join(args[args.index('--checkpoints_dir') + 1], f'{model}_list_default')


def _last(folder):
    return torch.load(os.path.join(folder, 'last.pth'), weights_only=True, map_location='cpu')


def _step(checkpoint):
    return checkpoint['position']['step']


def _assert_same_weights(a, b, atol):
    for name, tensor in a['model'].items():
        assert torch.allclose(tensor.float(), b['model'][name].float(), atol=atol, rtol=0), name


# the linear model has no BatchNorm, whose batch statistics would differ between 1 x 16 and 2 x 8 images
# a flat schedule, so that a resume may change --epochs without changing the learning rates
LINEAR_SGD = ['--model_type', 'linear', '--optimizer', 'sgd', '--lr', '0.05', '--epochs', '2', '--scheduler', 'none']


@pytest.fixture(scope='module')
def one_and_two_processes(tiny_shapes, tmp_path_factory):
    """The same training as 1 process x 16 images and 2 processes x 8 images: (args1, args2)."""
    one = tiny_run_args(tiny_shapes, tmp_path_factory.mktemp('one'))
    two = tiny_run_args(tiny_shapes, tmp_path_factory.mktemp('two'))
    _train(one, *LINEAR_SGD)
    _torchrun('train.py', *two, *LINEAR_SGD, '--batch_size', '8', '--keep_last', '2')  # epoch 1's for a resume
    return one, two


def test_two_processes_train_like_one_with_the_same_global_batch(one_and_two_processes):
    one, two = one_and_two_processes
    single, double = _last(_folder(one, 'linear')), _last(_folder(two, 'linear'))
    assert _step(single) == _step(double) == 12
    _assert_same_weights(single, double, atol=1e-5)
    # validation metrics over the 2 processes are those of 1 process (reduced sums and counts)
    for name in ('val/acc', 'val/top3'):
        assert single['history']['metrics'][name] == double['history']['metrics'][name]
    assert single['history']['metrics']['val/loss'] == pytest.approx(double['history']['metrics']['val/loss'], 1e-5)
    with open(os.path.join(_folder(two, 'linear'), 'run_config.json')) as f:
        config = json.load(f)
    assert config['world_size'] == 2 and config['total_batch_size'] == 16 and config['is_distributed']


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='needs 2 GPUs: the NCCL variant of the two-process test')
def test_two_gpus_under_nccl_train_like_one_gpu(tiny_shapes, tmp_path):
    one, two = (
        [arg for arg in tiny_run_args(tiny_shapes, tmp_path / name) if arg != '--cpu'] for name in ('one', 'two')
    )
    _train(one, *LINEAR_SGD, '--deterministic', isolated=True)  # see CUBLAS below
    _torchrun('train.py', *two, *LINEAR_SGD, '--deterministic', '--batch_size', '8')
    single, double = _last(_folder(one, 'linear')), _last(_folder(two, 'linear'))
    assert _step(single) == _step(double) == 12
    _assert_same_weights(single, double, atol=1e-4)  # GPU reductions add in another order


def test_only_rank_zero_writes(one_and_two_processes):
    one, two = one_and_two_processes

    # one event file, no per-rank copies; the two-process run keeps two epoch checkpoints (--keep_last 2)
    def files(args):
        return [name for name in run_files(_folder(args, 'linear')) if not name.startswith('epoch')]

    assert files(two) == files(one)
    with open(os.path.join(_folder(two, 'linear'), 'reproduce.json')) as f:
        (entry,) = json.load(f)
    assert entry['world_size'] == entry['processes_per_machine'] == 2  # its command is one process's


def test_fast_dev_run_under_two_processes_trains_evaluates_and_predicts_once(tiny_shapes, tmp_path):
    """--fast_dev_run under torchrun: both processes train and evaluate (eval.py reads the checkpoint
    once rank 0 has written it, in the same process group), and one predicts (into one folder)."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    result = _torchrun('train.py', *args, '--batch_size', '8', '--fast_dev_run')
    throwaway = tmp_path / 'ck' / 'fast_dev_run'
    (folder,) = [throwaway / name for name in os.listdir(throwaway)]
    assert result.stdout.count(f'fast_dev_run: trained, saved, evaluated and predicted in {folder}') == 1, result
    assert json.loads((folder / 'eval' / 'last_val_default' / 'result.json').read_text())['samples'] == 48
    with open(folder / 'predict' / 'last_val_default' / 'predictions.csv') as f:
        assert len(f.read().splitlines()) == 1 + 48  # a header and every validation image, each once


def test_eval_under_two_processes_equals_one(one_and_two_processes):
    one, _ = one_and_two_processes
    checkpoint = os.path.join(_folder(one, 'linear'), 'last.pth')
    # on the CPU (gloo) like the training: a one-GPU machine would refuse two processes
    run_script('eval.py', '--load_model_path', checkpoint, '--save_prefix', 'one', '--no-progress_bar', '--cpu')
    _torchrun('eval.py', '--load_model_path', checkpoint, '--save_prefix', 'two', '--no-progress_bar', '--cpu')
    results = os.path.join(_folder(one, 'linear'), 'eval')

    def read(name, file):
        with open(os.path.join(results, name, file)) as f:
            return f.read()

    assert json.loads(read('last_val_one', 'result.json'))['samples'] == 48
    for file in ('result.txt', 'predictions.csv'):  # no sample counted twice or left out
        assert read('last_val_two', file) == read('last_val_one', file), file
    one_json, two_json = (json.loads(read(name, 'result.json')) for name in ('last_val_one', 'last_val_two'))
    assert two_json == one_json  # the loss too: one process's batches, added up in their order


def test_a_split_smaller_than_the_processes_is_evaluated_without_waiting_for_ever(tiny_shapes, tmp_path):
    """Evaluation ran the DDP-wrapped model, whose every forward is a collective: a process with fewer
    batches (none, for a split of 1 sample under 2 processes) left the other waiting in its next forward,
    in training's validation and in eval.py alike. small_cnn: its BatchNorm buffers come from rank 0."""
    with open(os.path.join(tiny_shapes, 'val.txt')) as f:
        path, label = f.readline().split()
    (tmp_path / 'val1.txt').write_text(f'{os.path.join(tiny_shapes, path)} {label}\n')
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    args[args.index('--val_list') + 1] = str(tmp_path / 'val1.txt')
    _torchrun('train.py', *args, '--epochs', '1', '--limit_train_batches', '2', '--batch_size', '4', seconds=120)
    checkpoint = os.path.join(_folder(args), 'last.pth')
    for launch, name in ((_torchrun, 'two'), (run_script, 'one')):
        evaluate = ['--load_model_path', checkpoint, '--save_prefix', name, '--no-progress_bar', '--cpu']
        result = launch('eval.py', *evaluate, '--data_type', 'list', '--val_list', str(tmp_path / 'val1.txt'))
        assert result.returncode == 0, result.stdout + result.stderr
    results = os.path.join(_folder(args), 'eval')
    for file in ('result.json', 'predictions.csv'):
        with (
            open(os.path.join(results, 'last_val1_one', file)) as one,
            open(os.path.join(results, 'last_val1_two', file)) as two,
        ):
            assert two.read() == one.read(), file


def test_overfit_batches_under_two_processes_validate_on_the_batches_they_train_on(tiny_shapes, tmp_path):
    """--overfit_batches validates on the training batches, each process its slices of them: evaluation
    took them for whole batches dealt out, and stopped at the first validation (zip ... is shorter)."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    _torchrun('train.py', *args, '--model_type', 'linear', '--batch_size', '8', '--overfit_batches', '2', seconds=120)
    with open(os.path.join(_folder(args, 'linear'), 'history.json')) as f:
        assert len(json.load(f)['metrics']['val/acc']) == 2


def test_two_processes_validate_the_weight_average_eval_py_evaluates(tiny_shapes, tmp_path):
    """--ema_decay with BatchNorm under torchrun: each process averaged the running statistics of its own
    batches and validated its half of the images with them, so training's val/loss was not eval.py's on
    the checkpoint (which holds rank 0's average)."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--batch_size', '8', '--ema_decay', '0.9', '--loggers', 'csv']
    _torchrun('train.py', *args, '--epochs', '1')
    folder = _folder(args)
    with open(os.path.join(folder, 'history.json')) as f:
        validated = json.load(f)['metrics']['val/loss'][-1]
    run_script('eval.py', '--load_model_path', os.path.join(folder, 'last.pth'), '--no-progress_bar', '--cpu')
    with open(os.path.join(folder, 'eval', 'last_val_default', 'result.json')) as f:
        result = json.load(f)
    assert result['weights'] == 'ema' and result['metrics']['loss'] == pytest.approx(validated, rel=1e-6)


def test_resume_under_two_processes(one_and_two_processes, tmp_path):
    _, whole = one_and_two_processes  # 2 epochs in one go; continue a copy of it from the end of epoch 1
    copy = tmp_path / 'copy'
    copy.mkdir()
    epoch_1 = [n for n in os.listdir(_folder(whole, 'linear')) if n.startswith('epoch001_')][0]
    for name in ('args.yaml', epoch_1):
        shutil.copy(os.path.join(_folder(whole, 'linear'), name), copy / name)
    # in one process it would restart at the same global batch of half as many samples: some trained twice
    alone = subprocess.run(
        [sys.executable, 'train.py', '--resume', copy / epoch_1, '--cpu'],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(),
    )
    assert alone.returncode == 2 and 'was trained by 2 processes, this run has 1' in alone.stderr, alone.stderr
    assert sorted(os.listdir(copy)) == sorted(['args.yaml', epoch_1])  # refused before any file changed
    resumed = _torchrun('train.py', '--resume', copy / epoch_1, '--cpu', '--no-progress_bar')
    assert 'resuming' in resumed.stdout and resumed.stdout.count('resuming') == 1  # printed by rank 0 only
    assert f'train more:  python -m utils.torchrun --standalone --nproc-per-node=2 train.py --resume {copy}' in (
        resumed.stdout
    )
    _assert_same_weights(_last(_folder(whole, 'linear')), _last(str(copy)), atol=1e-6)


def test_a_shared_error_stops_every_rank_with_one_line(one_and_two_processes):
    _, two = one_and_two_processes
    result = subprocess.run(
        [*TORCHRUN, 'train.py', *two, *LINEAR_SGD], cwd=REPO, capture_output=True, text=True, timeout=timeout()
    )
    assert result.returncode != 0
    assert result.stderr.count('error: ') == 1 and 'already exists' in result.stderr


def test_a_non_finite_loss_is_said_at_the_job_s_first_bad_step(tmp_path):
    """Each process found its own first bad step and the job took the latest: a NaN at step 10 in one
    process, which DDP spreads to the others at step 11, was reported at step 11."""
    script = tmp_path / 'nonfinite.py'
    script.write_text(
        f'import sys\nsys.path.insert(0, {REPO!r})\n'
        'import torch\n'
        'from utils.distributed import cleanup_distributed, init_distributed, rank\n'
        'from utils.stopping import Stopper\n'
        'init_distributed(True, None)\n'  # (on the CPU: gloo)
        'rank, stopper = rank(), Stopper()\n'
        'for step in (9, 10, 11):\n'
        '    bad = step >= (10 if rank == 0 else 11)\n'
        "    stopper.watch_loss(torch.tensor(float('nan') if bad else 1.0), step)\n"
        'assert not stopper.check_finite(step=11)\n'
        "print(f'rank {rank}: {stopper.stop.message}')\n"
        'cleanup_distributed()\n'
    )
    result = _torchrun(str(script), seconds=120)
    said = sorted(re.findall(r'rank \d: non-finite loss at step \d+', result.stdout))
    assert said == ['rank 0: non-finite loss at step 10', 'rank 1: non-finite loss at step 10'], result.stdout


@pytest.mark.parametrize(
    'mistake, needle',
    [
        (['--batchsize', '8'], 'did you mean --batch_size?'),
        (['--model_type', 'my_nett'], "unknown --model_type 'my_nett'"),
    ],
)
def test_a_mistake_in_the_options_is_said_once_under_torchrun(mistake, needle):
    """Every rank parses the same command line; each printed the error (twice for two processes)."""
    result = subprocess.run(
        [*TORCHRUN, 'train.py', '--cpu', *mistake], cwd=REPO, capture_output=True, text=True, timeout=timeout()
    )
    assert result.returncode != 0 and result.stderr.count('error: ') == 1 and needle in result.stderr, result.stderr


@pytest.mark.parametrize('script', ['train.py', 'eval.py'])
def test_a_missing_file_is_said_once_under_torchrun(script, tiny_shapes, tmp_path):
    """Every rank met the missing list alike and printed it, at times two lines run into one."""
    missing = str(tmp_path / 'missing.txt')
    args = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--train_list', missing, '--val_list', missing]
    if script == 'eval.py':
        args = ['--load_model_path', str(tmp_path / 'missing.pth'), '--cpu']
    result = subprocess.run([*TORCHRUN, script, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout())
    assert result.returncode == 2 and result.stderr.count('error: ') == 1, result.stderr
    assert 'does not exist' in result.stderr
    assert not os.path.exists(tmp_path / 'ck') or os.listdir(tmp_path / 'ck') == []  # the new run's folder removed


def test_predict_under_torchrun_is_refused_in_one_line():
    """Every process predicted every image into the same folder; the second to make it failed."""
    result = subprocess.run(
        [*TORCHRUN, 'predict.py', '--load_model_path', 'any.pth', '--input', 'any'],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(),
    )
    assert result.returncode == 2 and result.stderr.count('error: ') == 1, result.stderr
    assert 'error: predict.py runs in one process: start it with python predict.py' in result.stderr


def test_options_after_the_script_are_the_script_s_under_utils_torchrun():
    """torchrun takes any abbreviation of its own options: --monitor was an ambiguous --monitor-interval."""
    result = subprocess.run(
        [*TORCHRUN, 'train.py', '--monitor', 'val/loss', '--help'],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(),
    )
    assert result.returncode == 0 and '--monitor MONITOR' in result.stdout, result.stderr


def test_a_rank_other_than_0_leaves_a_shared_mistake_to_rank_0():
    """Seen in CI: rank 1 exited at once on a mistyped option, torchrun stopped rank 0 before it had
    printed the line, and the user saw no error at all. Rank 1 now waits (torchrun stops it when rank
    0 exits) and says the mistake itself only when rank 0 has not."""
    env = {**os.environ, 'RANK': '1', 'WORLD_SIZE': '2'}
    process = subprocess.Popen(
        [sys.executable, 'train.py', '--batchsize', '8'], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=1.5)  # still waiting for rank 0's line
    finally:
        process.kill()
        _, stderr = process.communicate()
    assert stderr == '', stderr

    from utils import errors

    code = (
        f'import sys; sys.path.insert(0, {REPO!r}); from utils import errors; errors.SHARED_ERROR_WAIT = 0; '
        f'errors.exit_with_error("error: the same mistake")'
    )
    alone = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=timeout())
    assert alone.returncode == 2 and alone.stderr == 'rank 1: error: the same mistake\n', alone.stderr
    assert errors.SHARED_ERROR_WAIT >= 10  # long enough for a rank 0 that is slow to start


def _worker_pids(launcher):
    deadline = time.time() + timeout(120)
    while time.time() < deadline:
        children = subprocess.run(
            ['ps', '-o', 'pid=', '--ppid', str(launcher.pid)], capture_output=True, text=True
        ).stdout.split()
        if len(children) == 2:
            return [int(pid) for pid in children]
        time.sleep(0.1)
    raise AssertionError('torchrun did not start 2 workers')


def _wait_for_checkpoint(folder, launcher):
    deadline = time.time() + timeout(300)
    while not os.path.exists(os.path.join(folder, 'last.pth')):
        assert launcher.poll() is None, launcher.communicate()
        assert time.time() < deadline
        time.sleep(0.05)


# (SIGTERM to torchrun itself: tests/test_faults.py)
@pytest.mark.parametrize('target, signame', [('one worker', 'SIGUSR1')])
def test_a_signal_stops_all_ranks_at_the_same_step(tiny_shapes, tmp_path, target, signame):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    launcher = subprocess.Popen(
        [
            *TORCHRUN,
            'train.py',
            *args,
            *LINEAR_SGD,
            '--batch_size',
            '8',
            '--epochs',
            '500',
            '--print_freq',
            '3',
            '--save_interval',
            '6',
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers = _worker_pids(launcher)
    _wait_for_checkpoint(_folder(args, 'linear'), launcher)
    # to one worker: only that one hears it; to torchrun (as SLURM or a Ctrl-C does): it passes it on
    os.kill(max(workers) if target == 'one worker' else launcher.pid, getattr(signal, signame))
    stdout, stderr = launcher.communicate(timeout=timeout())
    # each rank stopped for the signal (exit 128 + its number), none because the other had gone
    assert launcher.returncode == 128 + getattr(signal, signame), stdout + stderr
    assert 'another process of this torchrun job is gone' not in stderr, stderr
    # (torchrun names the ranks it saw ended at one check: one or both)
    assert re.match(rf'torchrun: ranks? [0-9, ]+ stopped on {signame}', stderr.strip().splitlines()[-1]), stderr
    # every process that says where it stopped (rank 0 does) names the same step, the one last.pth holds
    stopped_at = {int(step) for step in re.findall(rf'stopped by {signame} after \d+s at step (\d+)', stdout)}
    assert len(stopped_at) == 1, stdout + stderr
    last = _last(_folder(args, 'linear'))
    assert _step(last) == stopped_at.pop() < 500 * 6


def test_a_crashed_rank_ends_the_job(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    launcher = subprocess.Popen(
        [*TORCHRUN, 'train.py', *args, *LINEAR_SGD, '--batch_size', '8', '--epochs', '500', '--save_interval', '6'],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers = _worker_pids(launcher)
    _wait_for_checkpoint(_folder(args, 'linear'), launcher)
    os.kill(max(workers), signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=timeout())  # no hang
    assert launcher.returncode != 0 and ('Signal 9' in stderr or 'SIGKILL' in stderr), stderr[-2000:]


def test_gradient_accumulation_equals_a_bigger_batch(tiny_shapes, tmp_path):
    big = tiny_run_args(tiny_shapes, tmp_path / 'big')
    accumulated = tiny_run_args(tiny_shapes, tmp_path / 'acc')
    _train(big, *LINEAR_SGD)
    _train(accumulated, *LINEAR_SGD, '--batch_size', '8', '--grad_accum_steps', '2')
    big_state, accumulated_state = _last(_folder(big, 'linear')), _last(_folder(accumulated, 'linear'))
    assert _step(big_state) == _step(accumulated_state) == 12  # steps count optimizer updates
    _assert_same_weights(big_state, accumulated_state, atol=1e-5)
    # the logged loss is the loss of the batches, not divided by the accumulation steps
    assert accumulated_state['history']['metrics']['train/loss'] == pytest.approx(
        big_state['history']['metrics']['train/loss'], rel=1e-4
    )


def test_accumulation_with_a_short_last_group(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    _train(args, '--batch_size', '8', '--grad_accum_steps', '5', '--epochs', '1')  # 12 batches: 5 + 5 + 2
    assert _step(_last(_folder(args))) == 3
    with open(os.path.join(_folder(args), 'run_config.json')) as f:
        config = json.load(f)
    assert config['num_update_steps_per_epoch'] == 3 and config['gradient_accumulation_steps'] == 5


@pytest.mark.parametrize('amp', ['bf16', 'fp16'])
def test_mixed_precision_on_cpu_and_its_scaler_resumes(tiny_shapes, tmp_path, amp):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--limit_train_batches', '2', '--limit_val_batches', '1']
    _train(args, '--amp', amp, '--epochs', '1')  # half precision is slow on a CPU: 2 batches an epoch
    first = _last(_folder(args))
    assert first['args']['amp'] == amp
    assert bool(first['scaler']) == (amp == 'fp16')  # a GradScaler only for float16, its state checkpointed
    _train(args, '--amp', amp, '--epochs', '2', '--resume')
    assert _step(_last(_folder(args))) == 4


def test_clipping_bounds_the_update(tiny_shapes, tmp_path):
    import train

    run = train.start(
        tiny_run_args(tiny_shapes, tmp_path / 'ck')
        + [
            '--model_type',
            'linear',
            '--optimizer',
            'sgd',
            '--momentum',
            '0',
            '--weight_decay',
            '0',
            '--lr',
            '1',
            '--scheduler',
            'none',
            '--clip_grad_norm',
            '0.001',
            '--max_iteration',
            '1',
            '--loggers',
            'csv',
        ]
    )
    before = [p.detach().clone() for p in run.setup.model.parameters()]
    run.train()
    run.logger.close()
    change = torch.cat([(p.detach() - b).flatten() for p, b in zip(run.setup.model.parameters(), before)])
    assert 0 < change.norm() <= 0.001 * 1.0001  # lr 1 x clipped gradient norm


def test_compiled_and_channels_last_checkpoints_load_uncompiled(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')  # the linear model: few kernels for inductor to build
    _train(args, '--compile', '--channels_last', '--model_type', 'linear', '--epochs', '1', '--no-log_images')
    state = _last(_folder(args, 'linear'))
    assert not any(name.startswith(('_orig_mod.', 'module.')) for name in state['model'])
    result = run_script('eval.py', '--load_model_path', os.path.join(_folder(args, 'linear'), 'last.pth'), '--cpu')
    assert result.returncode == 0, result.stderr


SYNCS = ('item', 'tolist', 'cpu', 'numpy', '__float__', '__int__', '__bool__', '__index__')


def _record_iterations(run):
    """Make `run`'s task note (model in training mode?, step before, [calls]) at every forward pass."""
    iterations, forward = [], run.task.forward

    def noting_forward(model, batch):
        iterations.append((model.training, run.position.step, []))
        return forward(model, batch)

    run.task.forward = noting_forward
    return iterations


RECIPE = ['--augment', 'resized_crop,hflip,color,erase,mixup,cutmix', '--ema_decay', '0.99']  # issue 19's


# from a DataLoader, from memory by indexing, and with the whole training recipe
@pytest.mark.parametrize(('data_type', 'extra'), [('list', []), ('mem_list', []), ('mem_list', RECIPE)])
def test_training_steps_between_print_intervals_make_no_host_sync(tiny_shapes, tmp_path, monkeypatch, data_type, extra):
    """Count the host-syncing tensor calls that Kiln's own code makes, step by step, through the real loop."""
    import train

    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--print_freq', '4', *extra]
    args[args.index('--data_type') + 1] = data_type
    run = train.start(args)
    iterations = _record_iterations(run)
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counted(name):
        def call(tensor, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            training_thread = threading.current_thread() is threading.main_thread()  # not the writer's host work
            where = os.path.relpath(caller, REPO)  # Kiln's own files: not ../venv/.../torch, not the tests
            in_kiln = os.path.isabs(caller) and not where.startswith(('..', 'tests' + os.sep))
            if iterations and training_thread and in_kiln:
                iterations[-1][2].append(f'{name} in {where}:{sys._getframe(1).f_lineno}')
            return originals[name](tensor, *a, **k)

        return call

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    run.train()
    monkeypatch.undo()
    run.logger.close()  # its writer thread done: no file or import of this run in the next test's

    training = [(step, calls) for is_training, step, calls in iterations if is_training]
    assert len(training) == 12  # 2 epochs of 6 batches
    for step_before, calls in training:
        step = step_before + 1
        if step % 4 and step % 6:  # neither a print interval nor an epoch end (validation, checkpoint)
            assert calls == [], f'step {step} synced: {calls}'
    assert any(calls for _, calls in training), 'the counter saw nothing: the test is broken'


class KernelCount(TorchDispatchMode):
    """Counts the operators dispatched while active that compute (a kernel on a GPU), not views."""

    def __init__(self):
        super().__init__()
        self.computing = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.computing += not func.is_view
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('model_type', ['linear', 'small_cnn'])
def test_a_training_step_computes_what_a_hand_written_step_does_and_little_more(tiny_shapes, tmp_path, model_type):
    """On a GPU each operator is a kernel launch: Kiln's step (its loss, running means, train metrics
    and loss watch) may add at most one per step, averaged over 64 steps (the kept values are added up
    every 32 or 64 steps), to the forward, loss, backward and optimizer step a hand-written loop makes."""
    import train

    run = train.start(tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--model_type', model_type])
    batches = [batch for epoch in range(11) for batch in run.train_data.epoch(epoch)][:64]
    assert len(batches) == 64
    model, optimizer = run.setup.wrapped, run.optimizer

    def hand_written_step(batch):
        loss = torch.nn.functional.cross_entropy(model(batch['image']), batch['label'])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        run.scheduler.step()

    def kiln_step(batch):
        run.train_step(batch, 1, True)
        run.optimizer_step()
        run.position.step += 1
        run.stopper.after_step()

    counts = {}
    for name, step in (('hand', hand_written_step), ('kiln', kiln_step)):
        with KernelCount() as counter:
            for batch in batches:
                step(batch)
        counts[name] = counter.computing
    run.logger.close()
    assert counts['hand'] > 64 * 5, counts  # the counter saw the steps
    assert counts['kiln'] - counts['hand'] <= len(batches), counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize(
    ('data_type', 'extra'),
    # fp16: the fused optimizer takes GradScaler's inf check on the device (the plain one reads it every step)
    [('list', []), ('mem_list', []), ('mem_list', RECIPE), ('mem_list', ['--amp', 'fp16'])],
)
def test_cuda_training_steps_make_no_sync(tiny_shapes, tmp_path, monkeypatch, data_type, extra):
    import train

    args = [a for a in tiny_run_args(tiny_shapes, tmp_path / 'ck') if a != '--cpu'] + ['--print_freq', '4', *extra]
    args[args.index('--data_type') + 1] = data_type
    run = train.start(args)
    assert run.device.type == 'cuda'
    forward, after_update = run.task.forward, train.Trainer.after_update

    def checked_forward(model, batch):
        step = run.position.step
        between_checks = step % 4 not in (0, 3) and run.position.batch not in (0, len(run.train_data) - 1)
        torch.cuda.set_sync_debug_mode('error' if model.training and between_checks else 0)
        return forward(model, batch)

    def unchecked_after_update(trainer):  # validation and saving read results: they may sync
        torch.cuda.set_sync_debug_mode(0)
        after_update(trainer)

    run.task.forward = checked_forward
    monkeypatch.setattr(train.Trainer, 'after_update', unchecked_after_update)
    try:
        run.train()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        run.logger.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_a_cuda_run_continued_from_its_epoch_1_checkpoint_ends_bitwise_like_the_whole_run(tiny_shapes, tmp_path):
    """The counters a checkpoint restores onto the CPU meet the GPU's at the first step after the resume
    (they crashed there on CUDA); with --deterministic the continued run ends with the same bits."""
    whole = [a for a in tiny_run_args(tiny_shapes, tmp_path / 'whole') if a != '--cpu']
    # a fresh interpreter: torch before 2.10 read CUBLAS_WORKSPACE_CONFIG (set by --deterministic) once per
    # process, at its first cuBLAS call, which an earlier test in this one may have made
    _train(whole, '--deterministic', '--keep_last', '2', isolated=True)
    epoch_1 = [n for n in os.listdir(_folder(whole)) if n.startswith('epoch001_')][0]
    copy = tmp_path / 'copy'
    copy.mkdir()
    for name in ('args.yaml', epoch_1):
        shutil.copy(os.path.join(_folder(whole), name), copy / name)
    _train(['--resume', copy / epoch_1, '--no-progress_bar'], isolated=True)
    finished, continued = _last(_folder(whole)), _last(str(copy))
    _assert_same_weights(finished, continued, atol=0)
    assert continued['history'] == finished['history']


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_segmentation_and_detection_train_deterministically_on_cuda(tiny_shapes, tmp_path):
    """torch's deterministic mode refuses two CUDA kernels seg_net and center_net would meet (bilinear
    upsampling's gradient, the 2-d cross entropy): Kiln swaps in deterministic equivalents. Detection
    also runs its box-aware crop on the device here."""
    from data.shapes import generate_shape_boxes

    segment = [a for a in tiny_seg_args(tiny_shapes, tmp_path / 'seg') if a != '--cpu']
    _train(segment, '--task', 'segment', '--deterministic', '--epochs', '1', isolated=True)  # see CUBLAS above
    boxes = generate_shape_boxes(str(tmp_path / 'boxes'), train_size=64, val_size=32, seed=1)
    lists = ['--train_list', os.path.join(boxes, 'train.txt'), '--val_list', os.path.join(boxes, 'val.txt')]
    detect = ['--task', 'detect', '--data_type', 'shapes_det', *lists, '--checkpoints_dir', tmp_path / 'det']
    detect += ['--epochs', '1', '--batch_size', '16', '--augment', 'resized_crop,hflip', '--deterministic']
    _train(detect, isolated=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('mode', ['reduce-overhead'])
def test_cuda_graphs_train_and_their_checkpoint_loads_without_compile(tiny_shapes, tmp_path, mode):
    """CUDA graphs replay into the same output memory: outputs the train metrics keep for later must
    be copies (reading them crashed), and the checkpoint is the plain model's."""
    args = [a for a in tiny_run_args(tiny_shapes, tmp_path) if a != '--cpu']
    _train(args, '--compile', '--compile_mode', mode, '--epochs', '1', isolated=True)  # (its graphs' memory pool)
    result = run_script('eval.py', '--load_model_path', os.path.join(_folder(args), 'last.pth'), '--no-progress_bar')
    assert result.returncode == 0, result.stderr
    assert 'acc' in result.stdout


def test_tensorboard_is_imported_only_when_logging_is_on(tiny_shapes, tmp_path, monkeypatch):
    import builtins

    import train

    imported, original = [], builtins.__import__

    def watching(name, *args, **kwargs):
        imported.append(name)
        return original(name, *args, **kwargs)

    monkeypatch.setattr(builtins, '__import__', watching)  # sees imports even of modules loaded before
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    train.start([*args, '--epochs', '1', '--loggers', 'csv']).run()
    monkeypatch.undo()
    assert imported and not [name for name in imported if 'tensorboard' in name]
    assert not any(name.startswith('events.') for name in os.listdir(_folder(args)))
    assert os.path.isfile(os.path.join(_folder(args), 'metrics.csv'))


def test_loader_defaults(tiny_shapes, monkeypatch):
    from data.list_dataset import ListDataset
    from data.loader import Batches
    from data.mem_list_dataset import MemListDataset
    from options import parse_args, parse_train_args

    args = parse_args(
        parse_train_args, tiny_run_args(tiny_shapes, 'unused')[:6] + ['--img_size', '32']
    )  # workers unset
    monkeypatch.setattr(os, 'cpu_count', lambda: 32)  # the machine's: it counted them, not those it may run on
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: set(range(8)), raising=False)  # taskset -c 0-7
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '4')
    cpu = torch.device('cpu')
    loader = Batches(ListDataset(args, 'train'), cpu, batch_size=16, shuffle=True, seed=0).loader
    assert loader.num_workers == 2 and loader.persistent_workers  # 8 CPUs shared by 4 processes
    assert loader.pin_memory is False and loader.worker_init_fn is not None  # pinned only for a GPU
    in_memory = Batches(MemListDataset(args, 'train'), cpu, batch_size=16, shuffle=True, seed=0)
    assert in_memory.loader is None and in_memory.memory['image'].dtype == torch.uint8  # batched by indexing
    batch = next(in_memory.epoch(0))
    assert batch['image'].dtype == torch.float32 and batch['image'].shape == (16, 3, 32, 32)


def _eval_once_and_under_two_processes(checkpoint, *options):
    """eval.py on `checkpoint` in 1 process (--save_prefix one) and under torchrun (two), on the CPU."""
    common = ['--load_model_path', checkpoint, *options, '--num_workers', '0', '--no-progress_bar', '--cpu']
    result = run_script('eval.py', *common, '--save_prefix', 'one')
    assert result.returncode == 0, result.stdout + result.stderr
    _torchrun('eval.py', *common, '--save_prefix', 'two', seconds=300)


def _result_files(folder):
    """{name: bytes} of an eval.py result folder's results: result.txt/json, predictions.csv, pictures."""
    names = [n for n in os.listdir(folder) if n.startswith(('result.', 'predictions')) or n.endswith('.png')]
    return {name: (folder / name).read_bytes() for name in names}


def _assert_same_results(experiment, evaluated_list):
    """The 1-process and 2-process results of `_eval_once_and_under_two_processes` are the same bytes."""
    one, two = (_result_files(experiment / 'eval' / f'last_{evaluated_list}_{n}') for n in ('one', 'two'))
    assert sorted(two) == sorted(one)
    for name in one:
        assert two[name] == one[name], name


def _list_of(count, shapes, path):
    """A list file at `path` of the tiny shapes' first `count` images (training's, then validation's)."""
    lines = []
    for split in ('train.txt', 'val.txt'):
        with open(os.path.join(shapes, split)) as f:
            lines += [os.path.join(shapes, line) for line in f.read().splitlines()]
    path.write_text('\n'.join(lines[:count]) + '\n')
    return path


def test_eval_under_two_processes_writes_one_process_s_results_byte_for_byte(
    one_and_two_processes, tiny_shapes, tmp_path
):
    """2 processes dealt samples round-robin: rank 0 pictured its own batches, numbered per rank (half the
    files, other images), and the loss added float32 means of other batches (1.8013029169328143 against
    1.8013028862452742). Now they evaluate one process's batches (101 images: 7 batches of 16, the last
    of 5, 4 for rank 0 and 3 for rank 1) and every file is one process's."""
    one, _ = one_and_two_processes
    experiment = Path(_folder(one, 'linear'))
    val101 = _list_of(101, tiny_shapes, tmp_path / 'val101.txt')
    options = ['--data_type', 'list', '--val_list', val101, '--batch_size', '16', '--viz_freq', '2']
    _eval_once_and_under_two_processes(experiment / 'last.pth', *options)
    pictures = sorted(n for n in os.listdir(experiment / 'eval' / 'last_val101_one') if 'batch' in n)
    assert pictures == [f'predictions_batch{n:04d}.png' for n in (0, 2, 4, 6)]
    _assert_same_results(experiment, 'val101')


def test_validation_under_two_processes_is_eval_py_s_in_one(one_and_two_processes):
    """Validation under 2 processes of 8 images dealt its samples round-robin: its val/loss added the means
    of other batches than the 8-image batches eval.py evaluates in one process, and differed in the last
    digits. Now it measures, to the bit, what eval.py measures on the checkpoint it saved."""
    _, two = one_and_two_processes
    experiment = Path(_folder(two, 'linear'))
    options = ['--batch_size', '8', '--save_prefix', 'one', '--no-progress_bar', '--cpu']
    result = run_script('eval.py', '--load_model_path', experiment / 'last.pth', *options)
    assert result.returncode == 0, result.stdout + result.stderr
    evaluated = json.loads((experiment / 'eval' / 'last_val_one' / 'result.json').read_text())['metrics']
    validated = {name[len('val/') :]: values[-1] for name, values in _last(experiment)['history']['metrics'].items()}
    assert {name: validated[name] for name in ('loss', 'acc', 'top3')} == {
        name: evaluated[name] for name in ('loss', 'acc', 'top3')
    }


def test_segmentation_eval_under_two_processes_writes_one_process_s_results_byte_for_byte(tiny_shapes, tmp_path):
    """As for classification: 48 masks in 3 batches of 16, 2 for rank 0 and 1 for rank 1, each pictured."""
    args = tiny_seg_args(tiny_shapes, tmp_path / 'ck')
    _train(args, '--task', 'segment', '--epochs', '1', '--limit_train_batches', '2')
    experiment = Path(experiment_of(args, 'seg_net', 'seg_list'))
    _eval_once_and_under_two_processes(experiment / 'last.pth', '--batch_size', '16', '--viz_freq', '1')
    assert len([n for n in os.listdir(experiment / 'eval' / 'last_val_one') if 'batch' in n]) == 3
    _assert_same_results(experiment, 'val')


@pytest.mark.parametrize('length, batch_size, limit', [(101, 16, None), (48, 8, 3), (48, 8, 0.5), (3, 4, None)])
def test_evaluation_deals_out_one_process_s_batches_whole(length, batch_size, limit):
    """Evaluation dealt samples round-robin, so each process's batches were not one process's. Now rank r
    takes one process's batches r, r + 2, ..., with their samples' places in the file (which seed a
    dataset's own randomness) and seeds; --limit_val_batches counts one process's batches."""
    from data.sampler import ResumableBatchSampler, in_global_order

    alone = ResumableBatchSampler(length, batch_size, False, limit=limit)
    dealt = [ResumableBatchSampler(length, batch_size, False, 0, rank, 2, limit) for rank in (0, 1)]
    assert [sampler.num_batches() for sampler in dealt] == [alone.num_batches()] * 2 == [len(alone.batches())] * 2
    assert [len(sampler) for sampler in dealt] == [len(sampler.batches()) for sampler in dealt]
    assert in_global_order([sampler.batches() for sampler in dealt]) == alone.batches()

    def seeded(sampler):
        return [(list(batch), batch.positions, batch.seeds) for batch in sampler]

    assert in_global_order([seeded(sampler) for sampler in dealt]) == seeded(alone)


def test_detection_eval_under_two_processes_writes_one_process_s_results_byte_for_byte(tmp_path):
    """mAP took the images back in order as if dealt one by one: with whole batches dealt (24 and 16 of 40
    images) it failed with an IndexError. Now it takes them in one process's order, which decides between
    detections of equal score."""
    from data.shapes import generate_shape_boxes

    boxes = generate_shape_boxes(str(tmp_path / 'boxes'), train_size=32, val_size=40, seed=1)
    lists = ['--train_list', os.path.join(boxes, 'train.txt'), '--val_list', os.path.join(boxes, 'val.txt')]
    detect = ['--task', 'detect', '--data_type', 'shapes_det', *lists, '--checkpoints_dir', tmp_path / 'ck']
    _train(detect, '--epochs', '1', '--limit_train_batches', '2', '--batch_size', '16', '--no-progress_bar', '--cpu')
    experiment = tmp_path / 'ck' / 'center_net_shapes_det_default'
    _eval_once_and_under_two_processes(experiment / 'last.pth', '--batch_size', '16', '--viz_freq', '1')
    assert len([n for n in os.listdir(experiment / 'eval' / 'last_val_one') if 'batch' in n]) == 3
    _assert_same_results(experiment, 'val')


def test_train_ddp_sh_on_several_machines_needs_their_meeting_point():
    """NNODES=2 without RDZV_ENDPOINT gave each machine a rendezvous of its own: it waited, silent, until
    torchrun's join timeout."""
    env = {'NNODES': '2', 'NPROC': '1'}
    result = run_script('bash', 'scripts/train_ddp.sh', '--cpu', env=env, timeout_seconds=60)
    assert result.returncode == 2 and result.stderr.startswith('error: NNODES=2 needs RDZV_ENDPOINT=host:port'), (
        result.stderr
    )


def test_train_ddp_sh_and_its_continue_line_work_from_another_folder(tiny_shapes, tmp_path):
    """scripts/train_ddp.sh no longer changes to the project's folder (relative paths are the working
    folder's): from a folder with a `utils` package of its own, `python -m utils.torchrun` found that one,
    and the printed continue line has to find Kiln's from there too."""
    (tmp_path / 'utils').mkdir()
    (tmp_path / 'utils' / '__init__.py').write_text('')  # a project's own utils package
    args = tiny_run_args(tiny_shapes, 'ck')  # relative: the working folder's
    env = {'NPROC': '2', 'SAVE_PREFIX': 'ddp'}
    script = os.path.join(REPO, 'scripts', 'train_ddp.sh')
    trained = run_script('bash', script, *args, '--model_type', 'linear', '--batch_size', '8', cwd=tmp_path, env=env)
    assert trained.returncode == 0, trained.stderr
    folder = tmp_path / 'ck' / 'linear_list_ddp'
    assert _step(_last(folder)) == 12  # 2 epochs of 96 images, 2 processes of 8
    (line,) = [line.split(':', 1)[1].strip() for line in trained.stdout.splitlines() if 'train more:' in line]
    assert line.startswith('PYTHONPATH=') and ' -P -m utils.torchrun ' in line, line
    resumed = subprocess.run(
        ['bash', '-c', line.replace(' python ', f' {shlex.quote(sys.executable)} ', 1)],  # ... --epochs 4
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout(),
    )
    assert resumed.returncode == 0, resumed.stderr
    assert _step(_last(folder)) == 24
