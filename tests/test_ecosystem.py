"""Kiln's real entry points end to end on tiny data: train.py with every tracker across a SIGKILL and
--resume, a missing tracker package, the debugging options (--fast_dev_run, --overfit_batches,
--limit_*_batches, --profile, --detect_anomaly) and TensorBoard's HParams view across tasks.

Runs whose process matters (a kill, stdout, exit codes) are subprocesses; the others run in this
process through train.start / train.main, which is cheaper and lets a test watch the batches.
Everything is offline: W&B writes offline runs, MLflow a local SQLite store, both under tmp paths.
Every run uses one torch thread: on CPUs shared with other work, a second thread mostly spins
(measured: the --overfit_batches run took 42 s of CPU with two threads, 7 s with one).
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_script, timeout, tiny_run_args, tiny_seg_args
from test_trackers import read_events, read_metrics_csv, wandb_logged, wandb_records

# MLflow 3.17's SQLite store uses an SQLAlchemy loader option that SQLAlchemy 2.1 deprecates
pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning:mlflow')

EXPERIMENT = 'small_cnn_list_default'
INSTALL_LINE = "error: --loggers wandb needs the wandb package: python3 -m pip install -e '.[trackers]'"

# Every task's final and best metric names: what each run declares in TensorBoard's HParams tab
TASK_METRICS = {
    'classify': ['loss', 'acc', 'top3'],
    'segment': ['loss', 'pixel_acc', 'miou'],
    'detect': ['loss', 'map50', 'map'],
}
MONITORS = {'classify': 'val/acc', 'segment': 'val/miou', 'detect': 'val/map'}


TRAIN_METRICS = {**TASK_METRICS, 'detect': ['loss']}  # detection's curves have no mAP (its train_metrics: none)


def final_names(task):
    return (
        {f'final/train/{name}' for name in TRAIN_METRICS[task]}
        | {f'final/val/{name}' for name in TASK_METRICS[task]}
        | {f'best/{MONITORS[task]}'}
    )


# --- running train.py ----------------------------------------------------------------------------

# Run as `python wrapper.py ARGS`, it is `python train.py ARGS` with two test hooks:
# KILN_TEST_BLOCK=a,b makes importing those modules fail as if they were not installed;
# KILN_TEST_PAUSE_AT=S stops the run while the checkpoint of optimizer step S is assembled (after
# its points were logged and the trackers' state taken, before the file is written): it writes
# KILN_TEST_MARKER and sleeps until the test SIGKILLs it, a kill at an exact moment.
WRAPPER = textwrap.dedent("""\
    import importlib.abc
    import os
    import runpy
    import sys
    import time

    REPO = {repo!r}
    sys.path.insert(0, REPO)
    BLOCKED = [name for name in os.environ.get('KILN_TEST_BLOCK', '').split(',') if name]


    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == blocked or name.startswith(blocked + '.') for blocked in BLOCKED):
                raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)
            return None


    sys.meta_path.insert(0, Blocker())
    if os.environ.get('KILN_TEST_PAUSE_AT'):
        import utils.trackers as trackers
        pause_at = int(os.environ['KILN_TEST_PAUSE_AT'])
        log_metrics, state_dict = trackers.Trackers.log_metrics, trackers.Trackers.state_dict

        def logged(self, metrics, step, epoch):
            self.logged_step = step
            return log_metrics(self, metrics, step, epoch)

        def assembled(self):
            state = state_dict(self)
            if getattr(self, 'logged_step', None) == pause_at:
                with open(os.environ['KILN_TEST_MARKER'], 'w') as f:
                    f.write(str(pause_at))
                time.sleep(3600)
            return state
        trackers.Trackers.log_metrics, trackers.Trackers.state_dict = logged, assembled
    sys.argv = [os.path.join(REPO, 'train.py'), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name='__main__')
""")


@pytest.fixture(scope='module')
def wrapper(tmp_path_factory):
    path = tmp_path_factory.mktemp('wrapper') / 'train_with_hooks.py'
    path.write_text(WRAPPER.format(repo=REPO))
    return str(path)


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.autograd.set_detect_anomaly(False)


def offline_env(home):
    """The environment of a train.py that may use W&B and MLflow: offline, nothing read from this machine
    (and one torch thread, like the runs in this process)."""
    env = {k: v for k, v in os.environ.items() if k not in ('WANDB_API_KEY', 'WANDB_BASE_URL', 'MLFLOW_TRACKING_URI')}
    env['OMP_NUM_THREADS'] = '1'
    env.update(
        {
            name: str(home / name.lower())
            for name in ('WANDB_DIR', 'WANDB_CACHE_DIR', 'WANDB_CONFIG_DIR', 'WANDB_DATA_DIR', 'WANDB_ARTIFACT_DIR')
        }
    )
    env.update(
        NETRC=str(home / '.netrc'),
        WANDB_MODE='offline',
        WANDB_SILENT='true',
        WANDB_ERROR_REPORTING='false',
        MLFLOW_DISABLE_TELEMETRY='true',
        DO_NOT_TRACK='true',
    )
    return env


def train_py(args, env, *, script='train.py', code=0, **extra_env):
    result = subprocess.run(
        [sys.executable, script, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**env, **extra_env},
        timeout=timeout(600),
    )
    assert result.returncode == code, result.stdout + result.stderr
    return result


def load(path):
    return torch.load(path, weights_only=True, map_location='cpu')


def folder_of(args):
    return os.path.join(args[args.index('--checkpoints_dir') + 1], EXPERIMENT)


# --- 1. every tracker through train.py, across a SIGKILL and --resume ----------------------------

# 12 optimizer steps (2 epochs of 6 batches), validated every 2 steps, saved every step
KILL_AT = 6  # a validation step: its points are logged when the run dies, its checkpoint is not written
# W&B's service writes what it was given to the .wandb file every 0.1 s (FLUSH_INTERVAL_S in
# utils/trackers/wandb_tracker.py); a kill within that moment after a commit loses the committed
# points, like one between a checkpoint's write and its commit (the gap README's "Experiment
# trackers" names). The pause comes before step KILL_AT's checkpoint is written (so not in the
# latter) and the last W&B commit before it is step 4's: waiting this long before the SIGKILL keeps
# the test out of the former too. test_wandb_has_committed_points_on_disk_within_a_moment checks
# that moment itself. (Longer on a slow machine: the run is paused meanwhile, so waiting more changes nothing.)
WANDB_FLUSH_MARGIN_S = timeout(1.5)


@pytest.fixture(scope='module')
def tracker_runs(tiny_shapes, tmp_path_factory, wrapper):
    """The same run with all four trackers twice: never interrupted, and SIGKILLed while the
    checkpoint of step KILL_AT is being assembled, then resumed (from step KILL_AT - 1) with --resume."""
    pytest.importorskip('wandb', reason='wandb is not installed')
    for module in ('mlflow', 'sqlalchemy', 'alembic'):
        pytest.importorskip(module, reason=f"{module} is not installed (python3 -m pip install -e '.[trackers]')")
    base = tmp_path_factory.mktemp('trackers')
    env = offline_env(base / 'home')
    uri = f'sqlite:///{base / "mlflow.db"}'  # one store for both runs, given by --mlflow_uri
    extra = [
        '--valid_interval',
        '2',
        '--image_interval',
        '0',  # pictures at every validation, so that every tracker's pictures are compared across the kill
        '--save_interval',
        '1',
        '--deterministic',
        '--print_freq',
        '100',
        '--loggers',
        'tensorboard',
        'csv',
        'wandb',
        'mlflow',
        '--mlflow_uri',
        uri,
    ]
    whole, killed = (tiny_run_args(tiny_shapes, base / name) + extra for name in ('whole', 'killed'))
    train_py(whole, env)

    marker = base / 'paused'
    process = subprocess.Popen(
        [sys.executable, wrapper, *killed],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, 'KILN_TEST_PAUSE_AT': str(KILL_AT), 'KILN_TEST_MARKER': str(marker)},
    )
    try:
        deadline = time.time() + timeout(600)
        while not marker.exists():
            assert process.poll() is None, process.communicate()
            assert time.time() < deadline, 'the run never reached the step to kill'
            time.sleep(0.05)
        time.sleep(WANDB_FLUSH_MARGIN_S)
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate()
    folder = folder_of(killed)
    # what the killed run left: its checkpoint of step KILL_AT - 1, and points of step KILL_AT that
    # TensorBoard and metrics.csv already hold and that the resumed run must not show twice
    left = {
        'checkpoint': load(os.path.join(folder, 'last.pth')),
        'tensorboard': [e.step for e in read_events(folder).Scalars('val/acc')],
        'csv': sorted(read_metrics_csv(os.path.join(folder, 'metrics.csv'))[1]['val/acc']),
    }
    resumed = train_py([*killed, '--resume'], env)
    return {'whole': folder_of(whole), 'killed': folder, 'left': left, 'resumed_stdout': resumed.stdout, 'uri': uri}


def test_the_killed_run_left_points_after_its_checkpoint(tracker_runs):
    left = tracker_runs['left']
    assert left['checkpoint']['position']['step'] == KILL_AT - 1
    assert left['tensorboard'] == left['csv'] == [2, 4, KILL_AT]
    assert f'step {KILL_AT - 1}' in tracker_runs['resumed_stdout']
    final = load(os.path.join(tracker_runs['killed'], 'last.pth'))
    whole = load(os.path.join(tracker_runs['whole'], 'last.pth'))
    assert final['position']['step'] == whole['position']['step'] == 12
    # the resumed run went on with the tracker runs it started with
    assert final['trackers']['wandb']['run_id'] == left['checkpoint']['trackers']['wandb']['run_id']
    assert final['trackers']['mlflow']['run_id'] == left['checkpoint']['trackers']['mlflow']['run_id']
    for name, tensor in whole['model'].items():
        assert torch.equal(tensor, final['model'][name]), name


def hparams_plugin(events):
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    content = events.PluginTagToContent('hparams')
    experiment = HParamsPluginData.FromString(content['_hparams_/experiment']).experiment
    session = HParamsPluginData.FromString(content['_hparams_/session_start_info']).session_start_info
    values = {name: getattr(value, value.WhichOneof('kind')) for name, value in session.hparams.items()}
    return {info.name.tag for info in experiment.metric_infos}, values


def test_tensorboard_has_every_point_once_and_the_hparams(tracker_runs):
    whole, killed = read_events(tracker_runs['whole']), read_events(tracker_runs['killed'])
    tags = whole.Tags()['scalars']
    assert {'train/loss', 'train/acc', 'train/lr', 'val/loss', 'val/acc', 'final/val/acc', 'best/val/acc'} <= set(tags)
    assert sorted(killed.Tags()['scalars']) == sorted(tags)
    for tag in tags:
        points = [(e.step, e.value) for e in killed.Scalars(tag)]
        assert len({step for step, _ in points}) == len(points), f'{tag}: a step twice in {points}'
        assert points == [(e.step, e.value) for e in whole.Scalars(tag)], tag
    assert [e.step for e in whole.Scalars('val/acc')] == [2, 4, 6, 8, 10, 12]
    pictures = [(e.step, e.encoded_image_string) for e in killed.Images('val/predictions')]
    assert pictures == [(e.step, e.encoded_image_string) for e in whole.Images('val/predictions')]
    assert [step for step, _ in pictures] == [2, 4, 6, 8, 10, 12]
    declared, values = hparams_plugin(killed)
    assert declared >= set().union(*map(final_names, TASK_METRICS))
    assert hparams_plugin(whole) == (declared, values)
    assert values['task'] == 'classify' and values['lr'] == 3e-3 and values['batch_size'] == 16
    assert values['valid_interval'] == 2 and values['deterministic'] == 1  # changed from their defaults
    assert 'checkpoints_dir' not in values


def test_metrics_csv_has_every_row_once(tracker_runs):
    columns, table = read_metrics_csv(os.path.join(tracker_runs['killed'], 'metrics.csv'))
    assert (columns, table) == read_metrics_csv(os.path.join(tracker_runs['whole'], 'metrics.csv'))
    assert columns[:2] == ['step', 'epoch'] and {'train/loss', 'val/acc', 'train/lr'} <= set(columns)
    assert sorted(table['val/acc']) == [2, 4, 6, 8, 10, 12]
    assert not [name for name in os.listdir(tracker_runs['killed']) if name.startswith('metrics.csv.')]


def mlflow_run(client, folder):
    """The one MLflow run of the experiment folder `folder` (by the tag Kiln gives it)."""
    from utils.trackers.mlflow_tracker import EXPERIMENT as MLFLOW_EXPERIMENT

    experiment = client.get_experiment_by_name(MLFLOW_EXPERIMENT)
    runs = [
        run
        for run in client.search_runs([experiment.experiment_id])
        if run.data.tags.get('kiln.folder') == os.path.abspath(folder)
    ]
    assert len(runs) == 1, [run.info.run_id for run in runs]
    return runs[0]


def test_mlflow_has_one_run_with_every_point_once(tracker_runs):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracker_runs['uri'])
    whole, killed = mlflow_run(client, tracker_runs['whole']), mlflow_run(client, tracker_runs['killed'])
    assert killed.info.run_id == tracker_runs['left']['checkpoint']['trackers']['mlflow']['run_id']
    assert killed.info.status == whole.info.status == 'FINISHED'
    assert sorted(killed.data.metrics) == sorted(whole.data.metrics)
    assert {'train/loss', 'val/acc', 'final/val/acc', 'best/val/acc'} <= set(whole.data.metrics)
    for name in whole.data.metrics:
        points = [(m.step, m.value) for m in client.get_metric_history(killed.info.run_id, name)]
        assert len({step for step, _ in points}) == len(points), f'{name}: a step twice in {points}'
        assert sorted(points) == sorted((m.step, m.value) for m in client.get_metric_history(whole.info.run_id, name))
    assert sorted(m.step for m in client.get_metric_history(killed.info.run_id, 'val/acc')) == [2, 4, 6, 8, 10, 12]

    def picture_steps(run):
        paths = [a.path for a in client.list_artifacts(run.info.run_id, 'images') if a.path.endswith('.png')]
        return sorted(int(re.search(r'\Wstep\W(\d+)\W', path).group(1)) for path in paths)

    assert picture_steps(killed) == picture_steps(whole) == [2, 4, 6, 8, 10, 12]
    assert killed.data.params == whole.data.params
    tensorboard_values = hparams_plugin(read_events(tracker_runs['killed']))[1]
    assert {name: killed.data.params[name] for name in tensorboard_values} == {
        name: str(value) for name, value in wandb_config(tracker_runs['killed']).items() if name in tensorboard_values
    }
    assert killed.data.params['task'] == 'classify' and killed.data.params['lr'] == '0.003'


def read_wandb(folder):
    """Every offline W&B run in `folder`/wandb, in order: (run ids, history {key: [(step, value)]},
    config, summary) as the .wandb transaction logs record them."""
    runs = sorted(os.listdir(os.path.join(folder, 'wandb')))
    runs = [os.path.join(folder, 'wandb', run) for run in runs if run.startswith('offline-run-')]
    logs = []
    for run in runs:
        (log,) = [name for name in os.listdir(run) if name.endswith('.wandb')]
        logs.append(Path(run, log))
    ids = [re.fullmatch(r'run-(\w+)\.wandb', log.name).group(1) for log in logs]
    return (ids, *wandb_logged(logs))


def wandb_config(folder):
    return {name: value for name, value in read_wandb(folder)[2].items() if not name.startswith('_')}


def test_wandb_has_one_run_with_every_point_once(tracker_runs):
    ids, history, config, summary = read_wandb(tracker_runs['killed'])
    whole_ids, whole_history, whole_config, whole_summary = read_wandb(tracker_runs['whole'])
    run_id = tracker_runs['left']['checkpoint']['trackers']['wandb']['run_id']
    assert ids == [run_id, run_id] and len(whole_ids) == 1  # the killed run's offline part, then the resumed one's
    keys = {key for key in whole_history if not key.startswith('_')}
    assert {'train/loss', 'val/acc', 'epoch', 'val/predictions'} <= keys
    assert {key for key in history if not key.startswith('_')} == keys
    for key in keys:
        steps = [step for step, _ in history[key]]
        assert len(set(steps)) == len(steps), f'{key}: a step twice in {steps}'
        if key == 'val/predictions':  # pictures: the same image file (by content) at the same steps
            assert [(s, v['sha256']) for s, v in history[key]] == [(s, v['sha256']) for s, v in whole_history[key]]
        else:
            assert history[key] == whole_history[key], key
    assert [step for step, _ in history['val/acc']] == [2, 4, 6, 8, 10, 12]
    finals = {key: value for key, value in whole_summary.items() if key.startswith(('final/', 'best/'))}
    assert finals and {key: summary[key] for key in finals} == finals
    config = {name: value for name, value in config.items() if not name.startswith('_')}
    assert config == {name: value for name, value in whole_config.items() if not name.startswith('_')}
    assert config['task'] == 'classify' and config['lr'] == 3e-3 and config['deterministic'] is True
    tensorboard_values = hparams_plugin(read_events(tracker_runs['killed']))[1]
    assert {
        name: float(config[name]) if isinstance(config[name], (bool, int, float)) else config[name]
        for name in tensorboard_values
    } == tensorboard_values


def test_wandb_has_committed_points_on_disk_within_a_moment(tmp_path, monkeypatch):
    """What a SIGKILL leaves of a W&B run is its .wandb file: a point committed (its checkpoint written)
    must be in it within a moment, not at W&B's next flush of the file, up to 15 s later by default
    (a kill in between lost every point committed since the last flush)."""
    wandb = pytest.importorskip('wandb', reason='wandb is not installed')
    from types import SimpleNamespace

    from utils.trackers import build_trackers

    for name, value in offline_env(tmp_path / 'home').items():
        monkeypatch.setenv(name, value)
    trackers = build_trackers(
        ['wandb'], tmp_path / 'run', 'run', options=SimpleNamespace(wandb_project='kiln', checkpoints_dir=str(tmp_path))
    )
    try:
        trackers.log_metrics({'train/loss': 0.5}, 1, 0)
        trackers.state_dict()
        trackers.commit(1)
        committed = time.monotonic()
        (log,) = (tmp_path / 'run' / 'wandb').glob('offline-run-*/run-*.wandb')
        steps = []
        # W&B's default would take up to 15 s: a slow machine gets longer, but well under that
        while not steps and time.monotonic() < committed + min(timeout(3), 7.5):
            time.sleep(0.05)
            with contextlib.suppress(Exception):  # a record being written
                steps = [
                    json.loads(item.value_json)
                    for record in wandb_records(log)
                    if record.WhichOneof('record_type') == 'history'
                    for item in record.history.item
                    if [item.key] == ['_step'] or item.nested_key == ['_step']
                ]
        assert steps == [1], f'not in {log} {time.monotonic() - committed:.1f}s after the commit'
    finally:
        trackers.close()
        wandb.teardown()


def test_a_missing_tracker_package_is_one_line_naming_the_pip_command(tiny_shapes, tmp_path, wrapper):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--loggers', 'tensorboard', 'wandb']
    result = train_py(args, offline_env(tmp_path / 'home'), script=wrapper, code=2, KILN_TEST_BLOCK='wandb')
    assert result.stderr.strip() == INSTALL_LINE, result.stderr
    assert not os.path.exists(folder_of(args))  # the folder it had just made is gone: the same command can run again


# --- 2. debugging options ------------------------------------------------------------------------


@pytest.fixture
def watched(monkeypatch):
    """Watch an in-process run: `losses` gets ('train' or 'val', images, labels) for every batch whose
    loss is computed, and `validations` the number of samples each validation counted."""
    import train
    from tasks.task import Task

    losses, validations = [], []
    task_loss, evaluate = Task.loss, train.evaluate

    def loss(self, outputs, batch):
        target = batch[self.targets[0]]
        losses.append(('train' if torch.is_grad_enabled() else 'val', batch['image'].clone(), target.clone()))
        return task_loss(self, outputs, batch)

    def counted(*args, **kwargs):
        evaluation = evaluate(*args, **kwargs)
        validations.append(int(evaluation.metric_object.confusion.sum()))
        return evaluation

    monkeypatch.setattr(Task, 'loss', loss)
    monkeypatch.setattr(train, 'evaluate', counted)
    yield losses, validations
    torch.autograd.set_detect_anomaly(False)


def train_in_process(argv):
    """train.py's main in this process (what `python train.py ARGV` does, less the exit code)."""
    import train

    return train.main(argv)


def test_fast_dev_run_trains_saves_evaluates_and_predicts_in_a_throwaway_folder(tiny_shapes, tmp_path, watched):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--fast_dev_run']
    result = run_script('train.py', *args)  # the command as a user types it (in this process: see conftest)
    assert result.returncode == 0, result.stdout + result.stderr
    throwaway = tmp_path / 'ck' / 'fast_dev_run'
    (folder,) = [throwaway / name for name in os.listdir(throwaway)]
    assert f'fast_dev_run: trained, saved, evaluated and predicted in {folder}' in result.stdout
    assert os.listdir(tmp_path / 'ck') == ['fast_dev_run']  # no real experiment folder made or touched
    # its folder goes with the next one: a run trained on there would too. Not offered, and refused
    assert 'train more:' not in result.stdout and 'continue:' not in result.stdout, result.stdout
    resumed = run_script('train.py', '--resume', folder / 'last.pth', '--max_iteration', '4')
    assert resumed.returncode == 2 and resumed.stderr == (
        f'error: --resume {folder}/last.pth: a --fast_dev_run check, in a throwaway folder; start a real run '
        f'(from its weights: --load_model_path {folder}/last.pth)\n'
    ), resumed.stderr
    last = load(folder / 'last.pth')
    assert last['position']['step'] == 2
    with open(folder / 'checkpoints.json') as f:
        assert len(json.load(f)['files']) == 1  # saved once
    with open(folder / 'run_config.json') as f:
        config = json.load(f)
    assert config['max_num_train_steps'] == 2 and config['num_update_steps_per_epoch'] == 2
    # evaluated and predicted from that checkpoint (last.pth), into the same throwaway folder
    assert os.listdir(folder / 'eval') == os.listdir(folder / 'predict') == ['last_val_default']
    assert 'acc:' in (folder / 'eval' / 'last_val_default' / 'result.txt').read_text()
    with open(folder / 'predict' / 'last_val_default' / 'predictions.csv') as f:
        assert len(f.read().splitlines()) == 1 + 48  # a header and every validation image

    # again: 2 batches trained, 2 validated (32 images), in a new folder; the first one goes (throwaway
    # folders piled up, a checkpoint each), not one in use or not a run's
    losses, validations = watched
    losses.clear(), validations.clear()
    (throwaway / 'notes').mkdir()
    (throwaway / 'mine').mkdir()  # a run of yours given this --checkpoints_dir: locked, but no fast_dev_run's
    (throwaway / 'mine' / '.lock').write_text('')
    (throwaway / 'mine' / 'args.yaml').write_text('fast_dev_run: false\n')
    (throwaway / 'killed').mkdir()  # a fast_dev_run killed before it wrote its args.yaml: nothing in it yet
    (throwaway / 'killed' / '.lock').write_text('')
    running = subprocess.Popen(
        [sys.executable, '-c', HOLD_LOCK, str(throwaway / 'running')], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert running.stdout.readline() == 'locked\n'
        run = train_in_process(args)
    finally:
        running.kill()
        running.wait()
    assert [kind for kind, _, _ in losses].count('train') == 2 and validations == [32]
    assert sorted(os.listdir(throwaway)) == sorted(
        ['mine', 'notes', 'running', os.path.basename(run.options.model_dir)]
    )
    assert os.listdir(tmp_path / 'ck') == ['fast_dev_run']


def test_a_fast_dev_run_keeps_its_folder_locked_through_eval_and_predict(tiny_shapes, tmp_path, monkeypatch):
    """Its lock went with the training: another --fast_dev_run, finishing meanwhile, removed the folder
    while this one's eval.py and predict.py read it."""
    import predict

    seen = []

    def checked(argv):
        folder = os.path.dirname(argv[argv.index('--load_model_path') + 1])
        code = f'import sys; sys.path.insert(0, {REPO!r}); from utils.run_folder import FolderLock; '
        code += f'FolderLock.refuse_if_held({folder!r})'
        seen.append(subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=timeout(60)))
        return real(argv)

    real = predict.main
    monkeypatch.setattr(predict, 'main', checked)
    result = run_script('train.py', *tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--fast_dev_run')
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(seen) == 1 and seen[0].returncode != 0 and 'is in use by process' in seen[0].stderr, seen


HOLD_LOCK = """
import os, sys, time
from utils.run_folder import FolderLock
os.makedirs(sys.argv[1])
lock = FolderLock(sys.argv[1])
print('locked', flush=True)
time.sleep(600)
"""


def test_fast_dev_run_notes_only_the_flags_the_user_gave(tiny_shapes, tmp_path):
    """With --overfit_batches it noted that the run ignored --limit_train_batches and --limit_val_batches,
    which --fast_dev_run adds itself."""
    args = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--fast_dev_run', '--overfit_batches', '2']
    result = run_script('train.py', *args)
    assert result.returncode == 0 and 'note:' not in result.stdout, result.stdout + result.stderr
    given = run_script('train.py', *args, '--limit_train_batches', '3')  # the user's own: still said
    notes = [line for line in given.stdout.splitlines() if line.startswith('note:')]
    assert given.returncode == 0 and len(notes) == 1 and '--limit_train_batches' in notes[0], given.stdout


def test_fast_dev_run_refuses_resume_in_one_line(tiny_shapes, tmp_path):
    """--fast_dev_run --resume ignored --resume without a word."""
    result = run_script('train.py', *tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--fast_dev_run', '--resume')
    assert result.returncode == 2 and result.stderr.strip() == (
        'error: --fast_dev_run trains in a throwaway folder of its own: drop --resume'
    ), result.stderr
    assert not (tmp_path / 'ck').exists()


# --overfit_batches 2 --epochs 30 --lr 3e-3 (cosine to 0 over 60 steps) on the tiny shapes, train
# loss by epoch, measured: 1.84 1.39 1.09 0.90 0.75 0.64 0.54 0.46 0.38 0.33 (epoch 10) 0.29 0.25
# 0.22 0.20 0.18 0.16 0.15 0.14 0.13 0.13 (epoch 20) 0.12 0.12 0.11 0.11 0.11 0.11 0.11 0.11 0.11
# 0.105; the validation accuracy (on the same 32 images) is 1.0 from epoch 20 on
OVERFIT_LOSS = 0.25  # more than twice the 0.105 measured, and 1/7 of ln(6) = 1.79, the loss of a guess


def test_overfit_batches_drives_the_train_loss_to_about_zero_on_the_same_batches(tiny_shapes, tmp_path, watched):
    losses, validations = watched
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + [
        '--overfit_batches',
        '2',
        '--epochs',
        '30',
        '--lr',
        '3e-3',
        '--no-log_images',
        '--loggers',
        'csv',
    ]
    run = train_in_process(args)
    with open(os.path.join(run.options.model_dir, 'history.json')) as f:
        history = json.load(f)['metrics']
    curve = history['train/loss']
    print('--overfit_batches 2: train loss by epoch', ' '.join(f'{value:.3f}' for value in curve))
    assert len(curve) == 30 and curve[0] > 1.5 and curve[-1] < OVERFIT_LOSS
    assert history['val/acc'][-1] == 1.0 and history['val/loss'][-1] < 2 * OVERFIT_LOSS
    # the first line says what is used (it named the whole list as validated)
    assert '96 training and 96 validation samples (using 2 and 2 batches)' in run.summary_line()
    _, table = read_metrics_csv(os.path.join(run.options.model_dir, 'metrics.csv'))
    assert sorted(table['train/loss']) == list(range(2, 61, 2))  # 2 steps per epoch
    # the same 2 batches, in the same order, every epoch; validated on exactly those (32 images, not
    # the 48 of --val_list); the trained images equal the validated ones, so nothing was augmented
    train_batches = [(images, labels) for kind, images, labels in losses if kind == 'train']
    val_batches = [(images, labels) for kind, images, labels in losses if kind == 'val']
    assert len(train_batches) == 60 and len(val_batches) == 60 and validations == [32] * 30
    first = train_batches[:2]
    assert not torch.equal(first[0][0], first[1][0])
    for number, (images, labels) in enumerate(train_batches + val_batches):
        assert torch.equal(images, first[number % 2][0]) and torch.equal(labels, first[number % 2][1]), number


# batch 10: 96 training images make 9 batches an epoch (the last incomplete one dropped), 48
# validation images 5 batches (10, 10, 10, 10, 8)
LIMITS = {  # limits -> (optimizer steps an epoch, images per validation)
    ('3', '2'): (3, 20),  # counts
    ('0.5', '0.7'): (4, 30),  # fractions: int(9 * 0.5), int(5 * 0.7) batches
    ('1', '1.0'): (1, 48),  # the count 1, and the fraction 1.0: all
}


@pytest.mark.parametrize('limits', list(LIMITS), ids=['counts', 'fractions', 'one_and_all'])
def test_limit_batches_as_counts_and_fractions(tiny_shapes, tmp_path, watched, limits):
    losses, validations = watched
    steps, images = LIMITS[limits]
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + [
        '--batch_size',
        '10',
        '--epochs',
        '2',
        '--limit_train_batches',
        limits[0],
        '--limit_val_batches',
        limits[1],
        '--no-log_images',
        '--loggers',
        'csv',
    ]
    run = train_in_process(args)
    with open(os.path.join(run.options.model_dir, 'run_config.json')) as f:
        config = json.load(f)
    assert config['num_update_steps_per_epoch'] == steps and config['max_num_train_steps'] == 2 * steps
    position = load(os.path.join(run.options.model_dir, 'last.pth'))['position']
    assert (position['epoch'], position['batch'], position['step']) == (2, 0, 2 * steps)
    assert [kind for kind, _, _ in losses].count('train') == 2 * steps
    assert validations == [images, images]
    _, table = read_metrics_csv(os.path.join(run.options.model_dir, 'metrics.csv'))
    assert sorted(table['val/acc']) == [steps, 2 * steps]


def test_profile_writes_a_trace_and_prints_the_top_operators(tiny_shapes, tmp_path, capsys):
    import train

    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + [
        '--profile',
        '--epochs',
        '1',
        '--batch_size',
        '8',
        '--no-log_images',
        '--loggers',
        'csv',
    ]
    run = train.start(args)
    run.run()  # 12 steps: 2 waiting, 2 warm-up, 6 recorded
    out = capsys.readouterr().out
    profile = os.path.join(run.options.model_dir, 'profile')
    (trace,) = os.listdir(profile)
    assert trace.endswith('.pt.trace.json')  # what TensorBoard's profiler plugin and Perfetto open
    with open(os.path.join(profile, trace)) as f:
        events = json.load(f)['traceEvents']
    names = {event.get('name', '') for event in events}
    assert len({name for name in names if name.startswith('ProfilerStep#')}) == 6
    assert {'aten::conv2d', 'aten::convolution_backward'} <= names
    assert f'profile: trace in {profile}' in out
    # the table: the 12 operators that took the most CPU time themselves, most first
    lines = out.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith('-----')]
    header, rows = lines[rules[0] + 1], lines[rules[1] + 1 : rules[2]]
    assert header.split()[:3] == ['Name', 'Self', 'CPU'] and 'Self CPU %' in header
    assert len(rows) == 12 and lines[rules[2] + 1].startswith('Self CPU time total')
    percents = [float(re.search(r'\s(\d+\.\d+)%', row).group(1)) for row in rows]  # the Self CPU % column
    assert percents == sorted(percents, reverse=True) and percents[0] > 0


# --profile's profiler, as train.py sets it up: a few CPU steps, in a process of its own (kineto reads its
# log level once, as it first starts, and says its error once per process)
PROFILED_STEPS = """
import sys, torch
from utils.debug import training_profiler

with training_profiler(True, sys.argv[1], torch.device('cpu'), wait=0, warmup=1, active=1) as profiler:
    for _ in range(3):
        torch.ones(8).sum()
        profiler.step()
"""


@pytest.mark.parametrize('level', [None, '3'])
def test_profile_without_cuda_prints_no_kineto_error(level, tmp_path):
    """On a machine without CUDA, --profile printed kineto's "ERROR: ... gpuGetDeviceCount failed with code
    35" in the middle of a run that worked; a KINETO_LOG_LEVEL the user set still applies."""
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': '', 'PYTHONPATH': str(REPO)}
    env.pop('KINETO_LOG_LEVEL', None)
    if level:
        env['KINETO_LOG_LEVEL'] = level  # 3: kineto's STAGE lines and up
    result = subprocess.run(
        [sys.executable, '-c', PROFILED_STEPS, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout(120),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'profile: trace in' in result.stdout
    if level:
        assert 'Completed Stage' in result.stderr, result.stderr[-3000:]
    else:
        assert 'gpuGetDeviceCount' not in result.stderr and 'ERROR' not in result.stderr, result.stderr[-3000:]


def test_detect_anomaly_names_the_operation_whose_backward_made_a_nan(tiny_shapes, tmp_path, monkeypatch, watched):
    import train
    from tasks.task import Task

    anomaly_mode = []
    loss = Task.loss  # `watched`'s

    def nan_in_backward(self, outputs, batch):
        anomaly_mode.append(torch.is_anomaly_enabled())
        # finite forward (0 * 0), NaN backward: sqrt's gradient at 0 is inf, times the 0 from above
        return loss(self, outputs, batch) + 0 * torch.sqrt(outputs - outputs).sum()

    monkeypatch.setattr(Task, 'loss', nan_in_backward)
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--max_iteration', '2', '--no-log_images', '--loggers', 'csv']
    run = train.start(args + ['--save_prefix', 'anomaly', '--detect_anomaly'])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with pytest.raises(RuntimeError, match=r"Function 'SqrtBackward0' returned nan values in its 0th output"):
            run.run()
    assert anomaly_mode == [True]
    # anomaly mode's warning shows where the forward pass made that operation
    (warning,) = [w for w in caught if 'Error detected in SqrtBackward0' in str(w.message)]
    assert 'nan_in_backward' in str(warning.message)

    def watch_mode(self, outputs, batch):
        anomaly_mode.append(torch.is_anomaly_enabled())
        return loss(self, outputs, batch)

    monkeypatch.setattr(Task, 'loss', watch_mode)
    train.start(args + ['--save_prefix', 'plain']).run()
    assert anomaly_mode[1:] and not any(anomaly_mode[1:])  # off again without the flag, in the same process


# --- 3. TensorBoard's HParams view across tasks --------------------------------------------------


def test_an_unset_option_is_left_out_of_the_hparams_not_shown_as_text():
    """--max_iteration unset was the text 'None', so its HParams column was one of text, not numbers."""
    from options import parse_args, parse_train_args, resolve
    from train import hparams

    unset = hparams(resolve(parse_args(parse_train_args, ['--cpu'])))
    assert 'max_iteration' not in unset and unset['epochs'] == 12
    assert all(value is not None and value != 'None' for value in unset.values()), unset
    assert hparams(resolve(parse_args(parse_train_args, ['--max_iteration', '30'])))['max_iteration'] == 30


def test_hparams_rows_of_a_classify_and_a_segment_run_in_one_logdir(tiny_shapes, tmp_path):
    classify = train_in_process(tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--epochs', '1', '--no-log_images'])
    segment = train_in_process(
        tiny_seg_args(tiny_shapes, tmp_path / 'ck') + ['--task', 'segment', '--epochs', '1', '--no-log_images']
    )
    assert sorted(os.listdir(tmp_path / 'ck')) == sorted(
        os.path.basename(run.options.model_dir) for run in (classify, segment)
    )
    every_task = set().union(*map(final_names, TASK_METRICS))
    rows = {}
    for run in (classify, segment):
        events = read_events(run.options.model_dir)
        declared, values = hparams_plugin(events)
        assert declared >= every_task  # whichever run TensorBoard reads the columns from, all are there
        task = values['task']
        finals = {tag for tag in events.Tags()['scalars'] if tag.startswith(('final/', 'best/'))}
        rows[task] = finals
        assert finals - {'final/train/lr'} == final_names(task), task  # its own metrics, no other task's
    assert set(rows) == {'classify', 'segment'}
    assert {'final/val/miou', 'final/val/pixel_acc', 'best/val/miou'} <= rows['segment']
    assert 'final/val/acc' in rows['classify'] and not rows['segment'] & {'final/val/acc', 'best/val/acc'}


# --- 4. paths that name a file where a folder is wanted, and nothing trained yet -----------------


def test_a_file_given_as_a_folder_option_says_it_is_a_file(tmp_path):
    """--checkpoints_dir FILE said `FILE/<experiment> already exists; choose a new --save_prefix`, and
    --data_root FILE `cannot use FILE: File exists; free disk space or fix the permissions`: both say what
    FILE is now."""
    file = tmp_path / 'notes.txt'
    file.write_text('x')
    result = run_script('train.py', '--checkpoints_dir', file, '--save_prefix', 'zz', '--cpu', '--no-progress_bar')
    assert (result.returncode, result.stderr) == (
        2,
        f'error: {file} is a file, not a folder; give a folder you can write to as --checkpoints_dir\n',
    )
    result = run_script('train.py', '--data_root', file, '--checkpoints_dir', tmp_path / 'ck', '--cpu')
    assert (result.returncode, result.stderr) == (
        2,
        f'error: {file} is a file, not a folder; give a folder as --data_root\n',
    )
    assert not (tmp_path / 'ck').exists()  # the run folder made before the data is gone again, and ck/
    broken = tmp_path / 'results'  # a link whose target is gone (an unmounted disk): it was called a file
    broken.symlink_to(tmp_path / 'unmounted')
    result = run_script('train.py', '--checkpoints_dir', broken, '--save_prefix', 'zz', '--cpu', '--no-progress_bar')
    assert (result.returncode, result.stderr) == (
        2,
        f'error: {broken} is a link to {tmp_path / "unmounted"}, which does not exist; give a folder you can '
        f'write to as --checkpoints_dir\n',
    )


def test_making_a_folder_where_a_file_is_is_one_line_saying_so_wherever_it_is_made(tmp_path, capsys):
    """run_cli said "File exists"/"Not a directory" from making a folder meant "free disk space or fix the
    permissions"; it now says which path on the way is a file."""
    from utils.errors import run_cli

    file = tmp_path / 'notes.txt'
    file.write_text('x')
    for folder, start in [
        (file, f'{file} is a file'),
        (file / 'a' / 'b', f'cannot make the folder {file / "a"}: {file} is a file'),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(lambda argv, folder=folder: os.makedirs(folder, exist_ok=True), [])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == (
            f'error: {start}, not a folder; name a folder there instead, or move the file away (--debug shows where)\n'
        )


def test_the_eval_script_with_nothing_trained_says_to_train_first(tmp_path):
    """scripts/eval.sh on a fresh clone blamed --load_model_path, which the user never gave."""
    result = run_script('bash', 'scripts/eval.sh', '--cpu', env={'CHECKPOINTS_DIR': str(tmp_path / 'ck')})
    assert result.returncode == 2
    assert result.stderr == (
        f'error: nothing trained in {tmp_path / "ck"} yet (no {tmp_path / "ck"}/*/best.pth); run bash '
        f'scripts/train.sh first, or set CHECKPOINT=path/to/best.pth\n'
    )
