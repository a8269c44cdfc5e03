"""The parts the design names (Trainer, Evaluator, a Recorder-backed Logger) are the code that runs,
and the defects found around them stay fixed: options that shape the metrics reach eval.py, state_dict()
of any part never talks to other processes, args files are durable, predict lists with spaces."""

import csv
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from conftest import REPO, experiment_of, run_script, timeout, tiny_run_args, train_succeeds

# --- the named parts are the ones that run ---------------------------------------------------------


def test_train_eval_and_logging_run_through_trainer_evaluator_and_logger(tiny_shapes, tmp_path, monkeypatch):
    """train.py's and eval.py's main, with the named methods counted; every tracker call comes from the
    Logger (or, for the trackers' state, the checkpointer's job on the writer thread)."""
    import eval as evaluation
    import train
    from utils.background import BackgroundWriter
    from utils.logger import Logger
    from utils.trackers import Trackers

    calls = {}

    def counting(owner, name):
        method = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[f'{owner.__name__}.{name}'] = calls.get(f'{owner.__name__}.{name}', 0) + 1
            return method(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for name in ('build', 'train', 'train_step', 'optimizer_step', 'validate', 'save'):
        counting(train.Trainer, name)
    counting(evaluation.Evaluator, 'eval')
    for name in ('record', 'summary', 'log_metrics', 'log_pictures'):
        counting(Logger, name)
    callers, submitters = set(), set()  # who calls the trackers; who hands tracker calls to the writer thread
    for name in ('log_metrics', 'log_images', 'log_text', 'log_hparams', 'commit', 'finish', 'state_dict'):
        method = getattr(Trackers, name)

        def watched(self, *args, method=method):
            callers.add(os.path.relpath(sys._getframe(1).f_code.co_filename, REPO))
            return method(self, *args)

        monkeypatch.setattr(Trackers, name, watched)
    submit = BackgroundWriter.submit

    def noted(self, function, *args):
        if isinstance(getattr(function, '__self__', None), Trackers):
            submitters.add(os.path.relpath(sys._getframe(1).f_code.co_filename, REPO))
        return submit(self, function, *args)

    monkeypatch.setattr(BackgroundWriter, 'submit', noted)

    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--image_interval', '0']  # pictures at both validations
    train.main(args)  # what `python train.py ARGS` runs (the modules patched above are its own)
    evaluation.main(['--load_model_path', experiment_of(args), '--cpu', '--no-progress_bar'])
    steps = 2 * 6  # 2 epochs of 96 images in batches of 16
    assert calls['Trainer.build'] == 1 and calls['Trainer.train'] == 1 and calls['Evaluator.eval'] == 1
    assert calls['Trainer.train_step'] == calls['Trainer.optimizer_step'] == calls['Logger.record'] == steps
    assert calls['Trainer.validate'] == calls['Trainer.save'] == calls['Logger.summary'] == 2
    assert calls['Logger.log_metrics'] == calls['Logger.log_pictures'] == 2
    # directly by the writer thread's jobs (the trackers' state: the checkpointer's), handed over by the Logger
    assert callers == {'utils/background.py', 'utils/logger.py', 'utils/checkpointer.py'}, callers
    assert submitters == {'utils/logger.py'}, submitters


def test_a_custom_training_step_is_one_overridden_method(tiny_shapes, tmp_path):
    """A second loss term (an L2 penalty on the head) by overriding train_step alone."""
    import train
    from options import parse_args, parse_train_args, resolve
    from utils.run_folder import open_experiment

    penalties = []

    class PenalizedTrainer(train.Trainer):
        def train_step(self, batch, group_size, update):
            model = self.setup.wrapped
            with self.setup.autocast():
                outputs = self.task.forward(model, batch)
                penalty = 0.1 * model.head.weight.square().sum()
                loss = self.task.loss(outputs, batch) + penalty
            loss.backward()
            penalties.append(penalty.detach())
            self.logger.record('train/loss', loss, self.task.count(batch))
            self.logger.record('train/penalty', penalty, self.task.count(batch))
            self.logger.record_outputs(outputs, batch)
            return self.task.count(batch)

    argv = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--epochs', '1', '--loggers', 'csv']
    options, lock = open_experiment(argv, resolve(parse_args(parse_train_args, argv)))
    trainer = PenalizedTrainer.build(options, lock)
    assert type(trainer) is PenalizedTrainer
    assert trainer.run() is None
    assert len(penalties) == 6
    with open(os.path.join(options.model_dir, 'metrics.csv')) as f:
        header = f.readline().strip().split(',')
    assert 'train/penalty' in header and 'val/acc' in header


SUBCLASS_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
import train
from utils.errors import run_to_exit


class PenalizedTrainer(train.Trainer):
    def train_step(self, batch, group_size, update):
        with self.setup.autocast():
            outputs = self.task.forward(self.setup.wrapped, batch)
            penalty = 0.01 * outputs.float().square().mean()
            loss = self.task.loss(outputs, batch) + penalty
        (loss / group_size).backward()
        self.logger.record('train/loss', loss, self.task.count(batch))
        self.logger.record('train/penalty', penalty, self.task.count(batch))
        self.logger.record_outputs(outputs, batch)
        return self.task.count(batch)


if __name__ == '__main__':
    run_to_exit(lambda argv: train.main(argv, trainer_type=PenalizedTrainer))
"""


def test_a_trainer_subclass_runs_from_its_own_script_as_train_py_does(tiny_shapes, tmp_path):
    """A subclass had no entry point: run by hand, it skipped --fast_dev_run (a full run), one-line errors
    (a traceback, and the failed start's folder stayed) and the exit status of a stop, hung at exit
    holding its DataLoader workers, and its "continue" line resumed with train.py, without its loss."""
    script = tmp_path / 'my_train.py'
    script.write_text(SUBCLASS_SCRIPT.format(repo=REPO))
    checkpoints = tmp_path / 'ck'
    argv = [*tiny_run_args(tiny_shapes, checkpoints), '--loggers', 'csv', '--num_workers', '1']

    def run(*extra):
        command = [sys.executable, str(script), *argv, *extra]
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=timeout(300))

    typo = run('--model_type', 'small_cnnn')
    assert typo.returncode == 2 and typo.stderr.startswith('error: unknown --model_type'), typo.stderr
    assert 'Traceback' not in typo.stderr and not checkpoints.exists()

    dev = run('--fast_dev_run')
    assert dev.returncode == 0, dev.stderr
    (folder,) = glob.glob(str(checkpoints / 'fast_dev_run' / '*'))  # 2 steps in a throwaway folder
    with open(os.path.join(folder, 'metrics.csv')) as f:
        assert 'train/penalty' in f.readline().split(',')
    assert 'train more:' not in dev.stdout  # a throwaway run: not to be trained on (the next one removes it)
    real = run('--max_iteration', '2', '--save_prefix', 'real')
    last = checkpoints / 'small_cnn_list_real' / 'last.pth'
    assert f'train more:  python my_train.py --resume {last} --max_iteration 4' in real.stdout, real.stdout


PYTHON_SESSION = """
import json, os, re, signal, sys, time
from pathlib import Path
import torch
sys.path.insert(0, {repo!r})
handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.excepthook
import eval, predict, train
assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.excepthook) == handlers, 'handlers'
try:  # a Ctrl-C in the session's own code, after the import
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    print('interrupt caught', flush=True)


class NoOutputsTrainer(train.Trainer):  # a train_step of the user's that keeps no outputs for train/acc
    def train_step(self, batch, group_size, update):
        with self.setup.autocast():
            loss = self.task.loss(self.task.forward(self.setup.wrapped, batch), batch)
        loss.backward()
        self.logger.record('train/loss', loss, self.task.count(batch))
        try:
            self.logger.record('train/per_sample', torch.ones(self.task.count(batch)))
        except ValueError as error:
            self.wrong_record = str(error)
        return self.task.count(batch)


time.sleep(4)  # the first run's first step is timed from its call, not from the import
argv = json.loads(sys.argv[1])
words = [Path(word) if '/' in word else int(word) if word.isdigit() else word for word in argv]  # not all text
first = train.main(
    [*words, '--deterministic', '--detect_anomaly', '--save_prefix', 'one'],
    trainer_type=NoOutputsTrainer,
)
settings = torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled()
print('settings after the run', settings, os.environ.get('CUBLAS_WORKSPACE_CONFIG'), flush=True)
print('wrong record:', first.wrong_record, flush=True)
print('train metrics:', sorted(first.history.get_metric_names()), flush=True)
time.sleep(2)
called = time.perf_counter()
train.main([*argv, '--save_prefix', 'two'])
print('second run took', time.perf_counter() - called, flush=True)
train.main(['--resume', str(Path(argv[argv.index('--checkpoints_dir') + 1], 'small_cnn_list_one')), '--epochs', '2'])
"""


def test_a_python_session_keeps_its_ctrl_c_and_settings_and_gets_a_call_to_continue(tiny_shapes, tmp_path):
    """Importing train.py made any later Ctrl-C end the Python session (exit 130); --deterministic and
    --detect_anomaly stayed on after the run; a second run's "first step" was timed from the import; a
    subclass made in a notebook was to be continued with `python train.py` (without its train_step), and
    resumed so, went on without a word; a train_step without record_outputs showed train/acc 0; record()
    summed a tensor of values as one mean; numbers and paths in main's list were a TypeError."""
    argv = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--loggers', 'csv', '--epochs', '1']
    code = PYTHON_SESSION.format(repo=REPO)
    result = subprocess.run(
        [sys.executable, '-c', code, json.dumps([str(word) for word in argv])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout(300),
        env={name: value for name, value in os.environ.items() if name != 'CUBLAS_WORKSPACE_CONFIG'},  # (GPU CI's)
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert 'interrupt caught' in out
    assert 'settings after the run (False, False) None' in out, out
    assert "record('train/per_sample', ...) takes one number (a mean), not a tensor of (16,)" in out, out
    metrics = out.split('train metrics:')[1].splitlines()[0]
    assert 'train/loss' in metrics and 'train/acc' not in metrics and 'val/acc' in metrics, metrics
    last = tmp_path / 'ck' / 'small_cnn_list_one' / 'last.pth'
    call = f"train.main(['--resume', '{last}', '--epochs', '2'], trainer_type=NoOutputsTrainer)"
    assert f'train more:  {call}' in out, out
    first_step = [float(seconds) for seconds in re.findall(r'first step ([0-9.]+)s after train.py started', out)]
    second_run = float(out.split('second run took ')[1].split()[0])
    assert len(first_step) == 3 and first_step[1] < second_run, out  # timed from its own call, not the import
    assert first_step[0] < 4, out  # (the session has no script: the first run too)
    # the subclass's run resumed by train.py's Trainer goes on without its train_step: said
    assert 'was trained by NoOutputsTrainer, this run trains with Trainer: to keep its train_step' in out, out


def test_monitoring_a_train_metric_that_training_does_not_log_is_refused_before_training():
    """--task detect --monitor train/map trained a whole epoch, then stopped: training logs no mAP."""
    import train
    from options import parse_args, parse_train_args, resolve
    from tasks.detect import DetectTask

    options = resolve(parse_args(parse_train_args, ['--task', 'detect', '--monitor', 'train/map']))
    with pytest.raises(train.KilnError, match='--monitor train/map is not a metric of --task detect'):
        train.check_monitor(options, DetectTask)
    train.check_monitor(options.replace(monitor='val/map'), DetectTask)


def test_a_subclass_can_monitor_a_metric_of_its_own(tiny_shapes, tmp_path):
    """--monitor took only the task's metrics: a curve a subclass records (train/penalty) was refused."""
    import train

    class Penalized(train.Trainer):
        own_metrics = ('train/penalty', 'val/never_logged')

        def train_step(self, batch, group_size, update):
            count = super().train_step(batch, group_size, update)
            self.logger.record('train/penalty', torch.tensor(0.01 * self.position.step), count)
            return count

    argv = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--loggers', 'csv', '--epochs', '1']
    with pytest.raises(train.KilnError, match='--monitor train/penalty is not a metric of --task classify'):
        train.main([*argv, '--monitor', 'train/penalty'])
    run = train.main([*argv, '--monitor', 'train/penalty', '--monitor_mode', 'min'], trainer_type=Penalized)
    monitored = torch.load(run.folder('best.pth'), weights_only=True, map_location='cpu')['monitor_value']
    assert monitored == pytest.approx(run.history.get_latest_metric('train/penalty')) and monitored > 0
    # resumed by train.py's Trainer, which has no such metric: the one that has it is named
    last = run.folder('last.pth')
    said = rf'^--monitor train/penalty: {re.escape(last)} was trained by .*Penalized, whose metric it is'
    with pytest.raises(train.KilnError, match=said):
        train.main(['--resume', last, '--epochs', '2'])
    with pytest.raises(train.KilnError, match='--monitor val/never_logged: the validation at step 6 gave no such'):
        train.main([*argv, '--monitor', 'val/never_logged', '--save_prefix', 'b'], trainer_type=Penalized)


class MinimalDataset(torch.utils.data.Dataset):
    """Only what data/data_entry.py says a dataset must have: 48 random 16x16 images of 2 classes."""

    num_classes, class_names = 2, ['dark', 'light']

    def __init__(self, args, split):
        generator = torch.Generator().manual_seed(int(split == 'val'))
        self.labels = torch.randint(0, 2, (48,), generator=generator)
        noise = torch.randint(0, 64, (48, 3, 16, 16), generator=generator, dtype=torch.uint8)
        self.images = noise + (self.labels * 128).to(torch.uint8).view(-1, 1, 1, 1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {'image': self.images[index], 'label': int(self.labels[index])}


def test_a_dataset_with_only_the_required_members_trains_evaluates_and_fast_dev_runs(tmp_path, monkeypatch):
    """eval.py needed image_paths() and --fast_dev_run list_path (tracebacks), and a checkpoint of a
    dataset without `resize` kept None, which predict.py took for a crop."""
    from data import data_entry

    monkeypatch.setitem(data_entry.DATASETS, 'minimal', 'test_design:MinimalDataset')
    argv = ['--data_type', 'minimal', '--img_size', '16', '--batch_size', '16', '--cpu', '--no-progress_bar']
    dev = run_script('train.py', *argv, '--fast_dev_run', '--checkpoints_dir', tmp_path / 'dev')
    assert dev.returncode == 0 and 'no predict.py' in dev.stdout, dev.stderr
    trained = run_script('train.py', *argv, '--epochs', '1', '--checkpoints_dir', tmp_path)
    assert trained.returncode == 0, trained.stderr
    folder = str(tmp_path / 'small_cnn_minimal_default')
    trained_with = torch.load(os.path.join(folder, 'best.pth'), map_location='cpu', weights_only=True)['args']
    assert trained_with['resize'] == 'squash'  # what predict.py reads: files made square whole
    evaluated = run_script('eval.py', '--load_model_path', folder, '--cpu', '--no-progress_bar')
    assert evaluated.returncode == 0, evaluated.stderr
    with open(os.path.join(folder, 'eval', 'best_val_default', 'predictions.csv')) as f:
        assert [row['image'] for row in csv.DictReader(f)] == [str(i) for i in range(48)]  # sample numbers


def test_train_metrics_without_the_checkpoint_methods_are_refused_at_the_start():
    """A task's metrics with only update and compute trained a whole epoch, then failed at the first
    checkpoint (AttributeError: no state_dict)."""
    from utils.errors import KilnError
    from utils.logger import Logger

    class CountingMetrics:
        def update(self, outputs, batch):
            pass

        def compute(self, class_names=None):
            return {}

    class CountingTask:
        def train_metrics(self):
            return CountingMetrics()

    with pytest.raises(KilnError, match=r'without reset, state_dict, load_state_dict: train metrics need'):
        Logger(task=CountingTask())


def test_printed_speed_is_that_since_the_previous_line(tiny_shapes, tmp_path, monkeypatch, capsys):
    """img/s on a printed line counts the steps since the line before (a slow stretch shows where it
    happened and is gone from the next line), on a clock that moves 1 s per step and 10 s more in step 3."""
    import types

    import train
    from options import parse_args, parse_train_args, resolve
    from utils.run_folder import open_experiment

    clock = [0.0]
    monkeypatch.setattr(train, 'time', types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class TimedTrainer(train.Trainer):
        def train_step(self, batch, group_size, update):
            clock[0] += 1.0 + 10.0 * (self.position.step == 2)  # the step that makes optimizer step 3
            return super().train_step(batch, group_size, update)

    argv = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--epochs', '1', '--print_freq', '2', '--loggers', 'csv']
    options, lock = open_experiment(argv, resolve(parse_args(parse_train_args, argv)))
    assert TimedTrainer.build(options, lock).run() is None
    speeds = [int(line.split()[-2]) for line in capsys.readouterr().out.splitlines() if line.endswith(' img/s')]
    assert speeds == [16, 3, 16], speeds  # 2 steps of 16 images: in 2 s, 12 s, 2 s (from the start: 16, 5, 6)


# --- options that shape the metrics reach eval.py unchanged ----------------------------------------


def test_eval_reproduces_the_validation_numbers_of_training(tiny_shapes, tmp_path):
    """Every option that decides what validation measures (top-k, loss, image size, mixed precision) is
    taken from the checkpoint: eval.py's result equals the last validation of training."""
    from options import INHERITED

    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    extra = ['--topk', '5', '--loss', 'label_smoothing', '--img_size', '24', '--amp', 'bf16', '--channels_last']
    extra += ['--normalize', 'imagenet']  # not the default of its model
    train_succeeds(args, *extra, '--epochs', '1', '--limit_train_batches', '2')
    folder = experiment_of(args)
    with open(os.path.join(folder, 'history.json')) as f:
        validated = {name[4:]: values[-1] for name, values in json.load(f)['metrics'].items() if name[:4] == 'val/'}
    assert 'top5' in validated
    result = run_script('eval.py', '--load_model_path', os.path.join(folder, 'last.pth'), '--cpu', '--no-progress_bar')
    assert result.returncode == 0, result.stderr
    (evaluated,) = [os.path.join(folder, 'eval', name) for name in os.listdir(os.path.join(folder, 'eval'))]
    with open(os.path.join(evaluated, 'result.json')) as f:
        metrics = json.load(f)['metrics']
    assert {name: pytest.approx(value, abs=1e-6) for name, value in validated.items()} == {
        name: metrics[name] for name in validated
    }
    # the options eval.py ran with, saved in its result folder: the training run's, not the parser's defaults
    with open(os.path.join(evaluated, 'args.yaml')) as f:
        saved = yaml.safe_load(f)
    trained = torch.load(os.path.join(folder, 'last.pth'), weights_only=True, map_location='cpu')['args']
    assert {name: saved[name] for name in INHERITED} == {name: trained[name] for name in INHERITED}
    # given on the command line, an option wins over the checkpoint
    result = run_script(
        'eval.py', '--load_model_path', folder, '--topk', '2', '--save_prefix', 'top2', '--cpu', '--no-progress_bar'
    )
    assert 'top2' in result.stdout and 'top5' not in result.stdout, result.stdout + result.stderr
    # `none` puts an option back to its default, which in eval.py is the checkpoint's (it was the parser's:
    # --normalize none evaluated Kiln's normalization, silently other numbers)
    from options import given_options, inherit, parse_args, parse_test_args

    argv = ['--load_model_path', folder, '--normalize', 'none', '--img_size', 'none', '--topk', '2', '--task', 'none']
    options = inherit(parse_args(parse_test_args, argv), given_options(parse_test_args, argv), trained)
    assert (options.normalize, options.img_size, options.topk, options.task) == ('imagenet', 24, 2, 'classify')


# --- state_dict() talks to no other process ----------------------------------------------------------

STATE_WORKER = textwrap.dedent("""\
    import datetime, json, os, sys
    sys.path.insert(0, {repo!r})
    import torch
    import torch.distributed as dist
    from metrics import ClassificationMetrics
    from utils.checkpointer import Checkpointer, RandomStates
    from utils.recorder import Recorder

    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    torch.manual_seed(rank)
    recorder, metrics = Recorder(), ClassificationMetrics(3, topk=2)
    recorder.record('train/loss', torch.tensor(float(rank + 1)), 4)
    metrics.update(torch.eye(3)[[0, 1, 2, rank]], {{'label': torch.tensor([0, 1, 2, 0])}})
    if rank == 0:  # as checkpoint code usually does: ask rank 0 alone
        alone = [recorder.state_dict(), metrics.state_dict()['matrix'].tolist(), sorted(RandomStates().state_dict())]
    parts = {{'recorder': recorder, 'metrics': metrics, 'rng': RandomStates()}}
    state = Checkpointer(parts, per_process=['rng'], summed=['recorder', 'metrics']).state_dict()
    # resumed: a validation before any step (left due by a stop signal) adds up the loaded sums at once
    fresh = {{'recorder': Recorder(), 'metrics': ClassificationMetrics(3, topk=2), 'rng': RandomStates()}}
    Checkpointer(fresh, per_process=['rng'], summed=['recorder', 'metrics']).load(state, 'a checkpoint')
    resumed = [fresh['recorder'].summary(all_ranks=True), fresh['metrics'].compute()['acc']]
    if rank == 0:
        with open(sys.argv[1], 'w') as f:
            json.dump({{'alone': alone, 'recorder': state['recorder'], 'matrix': state['metrics']['matrix'].tolist(),
                       'processes': len(state['rng']['per_rank']), 'resumed': resumed}}, f)
    dist.destroy_process_group()
""")


def test_state_dicts_need_no_other_process_and_the_checkpointer_adds_them_up(tmp_path):
    script, output = tmp_path / 'worker.py', tmp_path / 'state.json'
    script.write_text(STATE_WORKER.format(repo=REPO))
    result = subprocess.run(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node=2', str(script), str(output)],
        capture_output=True,
        text=True,
        timeout=timeout(300),
        env={**os.environ, 'OMP_NUM_THREADS': '1'},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    state = json.loads(output.read_text())
    recorder, matrix, streams = state['alone']
    assert recorder == {'train/loss': [4.0, 4]} and sum(map(sum, matrix)) == 4  # rank 0's own
    assert streams == ['cuda', 'cuda_device', 'numpy', 'python', 'torch']
    assert state['recorder'] == {'train/loss': [4.0 + 8.0, 8]}  # both processes' sums
    assert sum(map(sum, state['matrix'])) == 8 and state['matrix'][1][1] == 2
    assert state['processes'] == 2
    # the resumed processes agree on the sums (rank 1 skipped the collective that rank 0 entered: a
    # torchrun resume whose first act was a validation crashed or hung)
    assert state['resumed'] == [{'train/loss': 1.5}, 7 / 8]


# --- durable run records -------------------------------------------------------------------------


def test_args_files_are_fsynced_before_they_replace_the_old_ones(tmp_path, monkeypatch):
    from options import parse_args, parse_train_args
    from utils.run_records import save_args

    synced, fsync = [], os.fsync

    def recording(fd):
        synced.append(os.path.basename(os.readlink(f'/proc/self/fd/{fd}')))
        return fsync(fd)

    monkeypatch.setattr(os, 'fsync', recording)
    save_args(parse_args(parse_train_args, ['--epochs', '3']), str(tmp_path))
    for name in ('args.txt', 'args.yaml'):
        assert any(name in path for path in synced), (name, synced)
        assert (tmp_path / name).read_text()


def test_a_checkpoint_keeps_one_epoch_counter(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    train_succeeds(args, '--epochs', '1', '--loggers', 'csv')
    checkpoint = torch.load(os.path.join(experiment_of(args), 'last.pth'), weights_only=True, map_location='cpu')
    assert checkpoint['position']['epoch'] == 1 and set(checkpoint['history']) == {'metrics'}


# --- predict lists of plain paths ----------------------------------------------------------------


def test_a_predict_list_of_plain_paths_with_spaces(tiny_shapes, tmp_path):
    import shutil

    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    train_succeeds(args, '--epochs', '1', '--loggers', 'csv', '--limit_train_batches', '1')
    images = tmp_path / 'my images'
    images.mkdir()
    sources = sorted(os.listdir(os.path.join(tiny_shapes, 'images', 'val')))[:3]
    for index, name in enumerate(sources):
        shutil.copy(os.path.join(tiny_shapes, 'images', 'val', name), images / f'photo {index} with spaces.png')
    listed = tmp_path / 'list.txt'
    listed.write_text(''.join(f'{images / name}\n' for name in sorted(os.listdir(images))))  # what `find` writes
    result = run_script('predict.py', '--load_model_path', experiment_of(args), '--input', listed, '--cpu')
    assert result.returncode == 0 and '3 images predicted' in result.stdout, result.stdout + result.stderr

    # the same paths, unquoted, with labels after them: a list that train.py and eval.py read
    labelled = tmp_path / 'labelled.txt'
    labelled.write_text(''.join(f'{images / name}  {index}\n' for index, name in enumerate(sorted(os.listdir(images)))))
    result = run_script(
        'predict.py', '--load_model_path', experiment_of(args), '--input', labelled, '--cpu', '--save_prefix', 'l'
    )
    assert result.returncode == 0 and '3 images predicted' in result.stdout, result.stdout + result.stderr

    listed.write_text(f'{images / "photo 9 with spaces.png"} 2\n')
    result = run_script(
        'predict.py', '--load_model_path', experiment_of(args), '--input', listed, '--cpu', '--save_prefix', 'b'
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and 'Traceback' not in result.stderr, result.stderr
    assert f'{listed}:1' in lines[0] and 'put quotes around a path with spaces' in lines[0], lines[0]

    # one image file, named as it is (not read as a list file), predicted as it was in the list
    single = images / 'photo 1 with spaces.PNG'
    os.rename(images / 'photo 1 with spaces.png', single)
    result = run_script(
        'predict.py', '--load_model_path', experiment_of(args), '--input', single, '--cpu', '--save_prefix', 'c'
    )
    assert result.returncode == 0 and '1 image predicted in' in result.stdout, result.stdout + result.stderr
    rows = {}
    for csv_path in glob.glob(os.path.join(experiment_of(args), 'predict', '*', 'predictions.csv')):
        with open(csv_path) as f:
            for row in list(csv.reader(f))[1:]:
                rows.setdefault(os.path.basename(row[0]).lower(), []).append(row[1:])
    assert len(rows['photo 1 with spaces.png']) == 3 and len({tuple(r) for r in rows['photo 1 with spaces.png']}) == 1


def test_processes_are_started_from_the_main_thread_only(tiny_args, monkeypatch):
    """A process started from the writer thread while the main thread forks DataLoader workers can hang the
    run: a worker inherits the pipe the writer waits on. git, and `uname` (platform.platform() runs it the
    first time), must start on the main thread; platform's cache is emptied so that it runs here."""
    import platform
    import threading

    started = []
    original = subprocess.Popen.__init__

    def recording(self, *args, **kwargs):
        started.append((threading.current_thread().name, args[0] if args else kwargs.get('args')))
        original(self, *args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, '__init__', recording)
    monkeypatch.setattr(platform, '_uname_cache', None, raising=False)
    train_succeeds(tiny_args, '--num_workers', '2', '--loggers', 'tensorboard', 'csv')
    assert started, 'the run started no process: git and uname were expected'
    assert {thread for thread, _ in started} == {threading.main_thread().name}, started


def test_the_printed_commands_work_pasted_from_another_folder(tiny_shapes, tmp_path):
    """Run from another folder into --checkpoints_dir=-dash, train.py printed `python eval.py
    --load_model_path -dash/...` and `python train.py --resume -dash/...`: pasted there, the first found no
    eval.py and, from the project folder, took -dash/... for an option."""
    args = tiny_run_args(tiny_shapes, 'unused')
    at = args.index('--checkpoints_dir')
    args[at : at + 2] = ['--checkpoints_dir=-dash']  # (a shell takes `--checkpoints_dir -dash` for two options)
    args[args.index('--epochs') + 1] = '1'
    trained = run_script(os.path.join(REPO, 'train.py'), *args, '--model_type', 'linear', cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    printed = dict(line.strip().split(':  ', 1) for line in trained.stdout.splitlines() if ':  ' in line)
    printed = {name: command.strip() for name, command in printed.items()}
    assert printed['evaluate'].startswith('python ') and printed['train more'].startswith('python ')
    assert printed['train more'].endswith(' --epochs 2')  # the run ended: resumed as it is, it trains nothing
    for command, more in ((printed['evaluate'], ' --no-progress_bar'), (printed['train more'], '')):
        pasted = subprocess.run(
            f'{shlex.quote(sys.executable)} {command.removeprefix("python ")}{more}',
            shell=True,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=timeout(300),
        )
        assert pasted.returncode == 0, f'{command}: {pasted.stderr}'
    run = tmp_path / '-dash' / 'linear_list_default'
    assert (
        os.path.isdir(run / 'eval')
        and torch.load(run / 'last.pth', weights_only=True, map_location='cpu')['position']['epoch'] == 2
    )


def test_a_name_the_locale_cannot_write_is_kept_as_its_bytes_or_is_one_line(tiny_shapes, tmp_path, capsys, monkeypatch):
    """In an ASCII locale without Python's UTF-8 mode, a non-ASCII --save_prefix (or path) ended in a
    UnicodeEncodeError traceback while args.txt was written; then in one line saying to use a UTF-8
    locale. The command line's bytes are now the folder's name and args.txt's, as given; text that the
    locale cannot write (a UTF-8 class name in an ASCII locale's file) is still one line saying so."""
    from utils.errors import run_cli

    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    ascii_locale = {'PYTHONUTF8': '0', 'PYTHONCOERCECLOCALE': '0', 'LC_ALL': 'C', 'LANG': 'C'}
    result = run_script('train.py', *args, '--max_iteration', '1', '--save_prefix', 'é', env=ascii_locale)
    assert result.returncode == 0 and 'Traceback' not in result.stderr, result.stderr
    (folder,) = os.listdir(os.fsencode(tmp_path / 'ck'))
    assert folder == 'small_cnn_list_é'.encode(), folder
    with open(os.path.join(os.fsencode(tmp_path / 'ck'), folder, b'args.txt'), 'rb') as f:
        assert b"--save_prefix '\xc3\xa9'" in f.read()  # (quoted: a shell reads it back)

    def ascii_file(argv):
        raise UnicodeEncodeError('ascii', 'recall/\u00e9t\u00e9: 1.0', 7, 8, 'ordinal not in range(128)')

    with pytest.raises(SystemExit):
        run_cli(ascii_file, [])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: cannot write 'recall/\u00e9t\u00e9' in the ascii encoding"), line
    assert 'PYTHONUTF8=1' in line
    # PYTHONIOENCODING=ascii outdoes both: the line said to set them, which changed nothing
    monkeypatch.setenv('PYTHONIOENCODING', 'ascii')
    with pytest.raises(SystemExit):
        run_cli(ascii_file, [])
    assert 'unset PYTHONIOENCODING' in capsys.readouterr().err
    # an error line names a path as its bytes, as the standard output does there (it wrote \udcc3\udcb6)
    import utils.errors  # noqa: F401  (registers the handler)

    assert '\u00e9\udcc3\udca9'.encode('ascii', 'kiln_names_as_bytes') == b'\\xe9\xc3\xa9'  # each as it can be
    absent = str(tmp_path / 'n\u00f6ne.txt')
    missing = run_script('train.py', *args, '--train_list', absent, env=ascii_locale)
    assert f'list file {absent} does not exist' in missing.stderr, missing.stderr


def test_the_first_step_time_is_where_the_benchmark_reads_it(tiny_args):
    """bench/bench_overhead.py reads the time to the first step from train.py's last line: a new wording
    of that line broke the benchmark, and no test saw it."""
    sys.path.insert(0, os.path.join(REPO, 'bench'))
    try:
        from bench_overhead import FIRST_STEP
    finally:
        sys.path.remove(os.path.join(REPO, 'bench'))
    trained = train_succeeds(tiny_args, '--max_iteration', '1', '--model_type', 'linear')
    assert 0 <= float(FIRST_STEP.search(trained.stdout).group(1)) < 600  # (in this process: no imports)


def test_a_profile_of_a_run_too_short_to_record_says_so(tiny_args):
    """--profile on a run of 3 steps printed an empty table and named a trace folder that was never made."""
    trained = train_succeeds(tiny_args, '--max_iteration', '3', '--model_type', 'linear', '--profile')
    assert 'profile: nothing recorded: the run made fewer than 5 optimizer steps' in trained.stdout
    assert 'trace in' not in trained.stdout
