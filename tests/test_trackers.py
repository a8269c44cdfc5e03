"""Experiment trackers (utils/trackers): a run killed and resumed from its last checkpoint ends with
exactly the points of a run never interrupted, read back through each library's own reader.

Everything runs in this process and offline: W&B writes offline runs, MLflow a local SQLite store.
"""

import csv
import json
import re
import struct
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from utils.errors import KilnError
from utils.trackers import Trackers, build_trackers
from utils.trackers.wandb_tracker import logged_in, wandb_mode

# MLflow 3.17's SQLite store uses an SQLAlchemy loader option that SQLAlchemy 2.1 deprecates
pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning:mlflow')

HPARAMS = {'task': 'classification', 'lr': 0.01, 'batch_size': 16, 'amp': True, 'load_model_path': None}
METRIC_NAMES = ('final/train/loss', 'final/val/acc', 'final/val/miou', 'best/val/acc')
IMAGE_STEPS = [3, 7, 10]
RESUME_STEP, LAST_STEP = 5, 10


def loss(step):
    return step / 8  # exact in float32 too (TensorBoard's precision)


def acc(step):
    return 1 - step / 16


# what a run never interrupted logs: train/loss from step 1, val/acc (a column added later) from step 3
EXPECTED = {
    'train/loss': {step: loss(step) for step in range(1, LAST_STEP + 1)},
    'val/acc': {step: acc(step) for step in range(3, LAST_STEP + 1)},
}


def log_step(trackers, step):
    """The points of one step, as the loop logs them: train and val metrics in separate calls."""
    epoch = (step - 1) // 4
    trackers.log_metrics({'train/loss': loss(step)}, step, epoch)
    if step >= 3:
        trackers.log_metrics({'val/acc': acc(step)}, step, epoch)
    if step in IMAGE_STEPS:
        trackers.log_images({'val/predictions': np.full((8, 8, 3), step * 10, np.uint8)}, step)


def kill_and_resume(names, folder, options, kill='after_commit', on_kill=lambda: None):
    """Run A logs steps 1..5 and assembles the checkpoint of step 5; with kill='after_commit' it is
    committed, A goes on to step 7 and is killed while the checkpoint of step 7 is being written;
    with kill='before_commit' A is killed right after writing the checkpoint of step 5. Either way
    A is abandoned without finish or close (`on_kill` stands for the end of its process), and run B
    resumes from step 5 with the saved states, logs 6..10 and finishes.
    Returns (A, the states saved at step 5, the states B saved at its last checkpoint)."""
    first = build_trackers(names, folder, folder.name, METRIC_NAMES, options=options)
    first.log_hparams(HPARAMS)
    first.log_text('args', '    lr: 0.01', 0)
    for step in range(1, RESUME_STEP + 1):
        log_step(first, step)
    saved = first.state_dict()
    if kill == 'after_commit':
        first.commit(RESUME_STEP)
        for step in (6, 7):
            log_step(first, step)
        first.state_dict()  # the checkpoint of step 7 is never written
    on_kill()
    return first, saved, resume_to_the_end(names, folder, options, RESUME_STEP, saved)


def resume_to_the_end(names, folder, options, resume_step, saved, last_step=LAST_STEP, hparams=HPARAMS):
    """A run resumed from the checkpoint of `resume_step` (whose states are `saved`; None: a new run): it
    logs the steps after it up to `last_step`, commits its checkpoint and finishes. Returns the states of
    that checkpoint."""
    trackers = build_trackers(
        names, folder, folder.name, METRIC_NAMES, resume_step=resume_step, states=saved, options=options
    )
    trackers.log_hparams(hparams)
    trackers.log_text('args', '    lr: 0.01', resume_step or 0)
    for step in range((resume_step or 0) + 1, last_step + 1):
        log_step(trackers, step)
    last = trackers.state_dict()
    trackers.commit(last_step)
    trackers.finish(final_metrics(last_step))
    trackers.close()
    return last


def final_metrics(last_step):
    """The final and best metrics of a run that ended at `last_step`."""
    return {'final/train/loss': loss(last_step), 'final/val/acc': acc(last_step), 'best/val/acc': acc(last_step)}


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No tracker may reach a server or read this machine's settings."""
    for name in ('WANDB_API_KEY', 'WANDB_BASE_URL', 'MLFLOW_TRACKING_URI'):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / 'home'
    monkeypatch.setenv('NETRC', str(home / '.netrc'))  # no W&B login
    for name in ('WANDB_DIR', 'WANDB_CACHE_DIR', 'WANDB_CONFIG_DIR', 'WANDB_DATA_DIR', 'WANDB_ARTIFACT_DIR'):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')
    monkeypatch.setenv('WANDB_ERROR_REPORTING', 'false')
    monkeypatch.setenv('MLFLOW_DISABLE_TELEMETRY', 'true')
    monkeypatch.setenv('DO_NOT_TRACK', 'true')


def options(checkpoints_dir):
    return SimpleNamespace(mlflow_uri=None, wandb_project='kiln', checkpoints_dir=str(checkpoints_dir))


def steps_and_values(points):
    """{step: value} from (step, value) pairs, failing on a step seen twice."""
    points = list(points)
    steps = [step for step, _ in points]
    assert len(steps) == len(set(steps)), f'duplicate steps in {sorted(steps)}'
    return dict(points)


# --- TensorBoard -------------------------------------------------------------------------------


def read_events(folder):
    """Everything TensorBoard shows of `folder`, through its own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={'scalars': 0, 'images': 0, 'tensors': 0})
    events.Reload()
    return events


@pytest.mark.parametrize('kill', ['after_commit', 'before_commit'])
def test_tensorboard_resume_has_every_point_once(tmp_path, kill):
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    folder = tmp_path / 'run'
    left = []  # what the killed run left on disk: with 'after_commit', steps 6 and 7 that the resume must hide
    kill_and_resume(
        ['tensorboard'],
        folder,
        options(tmp_path),
        kill,
        on_kill=lambda: left.append(read_events(folder).Scalars('train/loss')[-1].step),
    )
    assert left == [7 if kill == 'after_commit' else RESUME_STEP]
    events = read_events(folder)
    for name, expected in EXPECTED.items():
        assert steps_and_values((e.step, e.value) for e in events.Scalars(name)) == expected
    assert [e.step for e in events.Images('val/predictions')] == IMAGE_STEPS
    # after the last step, where a resume from the run's last checkpoint purges it (see the next test)
    assert [(e.step, e.value) for e in events.Scalars('final/val/acc')] == [(LAST_STEP + 1, acc(LAST_STEP))]
    # the HParams row: every task's metrics declared, this run's options in the session
    content = events.PluginTagToContent('hparams')
    experiment = HParamsPluginData.FromString(content['_hparams_/experiment']).experiment
    assert {metric.name.tag for metric in experiment.metric_infos} == set(METRIC_NAMES)
    session = HParamsPluginData.FromString(content['_hparams_/session_start_info']).session_start_info
    assert session.hparams['lr'].number_value == 0.01 and session.hparams['task'].string_value == 'classification'
    assert 'args/text_summary' in events.Tags()['tensors']


def test_tensorboard_run_extended_past_its_end_shows_its_end_once(tmp_path):
    """A finished run resumed from its last checkpoint with a larger --max_iteration: the end of the first
    start (final and best points, HParams row) is purged, the extended run's end is shown once. The
    HParams row showed the first start's options (TensorBoard keeps a tag's first description, and a
    purge drops only points) beside the extended run's results."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    folder = tmp_path / 'run'
    saved = resume_to_the_end(['tensorboard'], folder, options(tmp_path), None, None)
    extended = {**HPARAMS, 'max_iteration': LAST_STEP + 5}
    resume_to_the_end(['tensorboard'], folder, options(tmp_path), LAST_STEP, saved, LAST_STEP + 5, extended)
    events = read_events(folder)
    for name, value in final_metrics(LAST_STEP + 5).items():
        assert [(e.step, e.value) for e in events.Scalars(name)] == [(LAST_STEP + 6, value)]
    assert [e.step for e in events.Scalars('val/acc')] == list(range(3, LAST_STEP + 6))
    # what the HParams tab reads (TensorBoard's data provider): one session, at the extended run's end
    hparams = EventAccumulator(str(folder))
    hparams.Reload()
    for tag in ('_hparams_/experiment', '_hparams_/session_start_info', '_hparams_/session_end_info'):
        assert [e.step for e in hparams.Tensors(tag)] == [LAST_STEP + 6]
    content = hparams.PluginTagToContent('hparams')['_hparams_/session_start_info']
    assert HParamsPluginData.FromString(content).session_start_info.hparams['max_iteration'].number_value == (
        LAST_STEP + 5
    )


def test_dropping_hparams_keeps_every_other_record_and_a_cut_short_end(tmp_path):
    """What a rewrite of an earlier event file leaves: the same bytes without the HParams summaries."""
    import os

    from utils.trackers.tb_tracker import EventFile, drop_hparams, hparams_summaries, text_summary

    (tmp_path / 'run').mkdir()
    file = EventFile(str(tmp_path / 'run'))
    file.add_summary(text_summary('args', '_hparams_/ in a text'), 1)  # the tag's bytes, in no HParams summary
    before = os.path.getsize(file.records.name)
    for summary in hparams_summaries({'lr': 0.1}, ['final/val/acc']):
        file.add_summary(summary, 2)
    after = os.path.getsize(file.records.name)
    file.add_summary(text_summary('notes', 'last'), 3)
    file.close()
    with open(file.records.name, 'rb') as f:
        data = f.read()
    cut = data + data[:20]  # a record cut short by a kill
    with open(file.records.name, 'wb') as f:
        f.write(cut)
    drop_hparams(file.records.name)
    with open(file.records.name, 'rb') as f:
        assert f.read() == cut[:before] + cut[after:]


def test_tensorboard_reads_a_resumed_run_after_the_run_it_continues(tmp_path):
    """TensorBoard reads a folder's event files in name order, and names start with the time in seconds:
    the killed run's file is renamed here as if its clock were ahead (or as if the resume started in the
    same second from a lower process id). The resumed run's file must still be read after it."""
    import os
    import time

    folder = tmp_path / 'run'
    first = build_trackers(['tensorboard'], folder, 'run', METRIC_NAMES)
    for step in range(1, 8):
        log_step(first, step)
    first.state_dict()
    (killed,) = os.listdir(folder)
    ahead = killed.split('.')
    ahead[3], ahead[5] = str(int(time.time()) + 3600), '999999'
    os.rename(folder / killed, folder / '.'.join(ahead))
    second = build_trackers(['tensorboard'], folder, 'run', METRIC_NAMES, resume_step=RESUME_STEP, states={})
    for step in range(RESUME_STEP + 1, LAST_STEP + 1):
        log_step(second, step)
    second.close()
    assert sorted(os.listdir(folder))[0] == '.'.join(ahead)
    events = read_events(folder)
    for name, expected in EXPECTED.items():
        assert [(e.step, e.value) for e in events.Scalars(name)] == sorted(expected.items())


def test_event_records_carry_the_checksums_tensorboard_checks(tmp_path, monkeypatch):
    """Kiln computes the TFRecord checksums in C (google-crc32c); TensorBoard's reader checks them with
    its own: every record of a file with scalars, a text and a picture reads back."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards

    from utils.trackers.tb_tracker import masked_crc32c

    rng = np.random.default_rng(3)
    for size in (0, 1, 8, 1000, 70001):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert masked_crc32c(data) == struct.pack('<I', tensorboards(data)), f'{size} bytes (seed 3)'
    monkeypatch.setitem(sys.modules, 'google_crc32c', None)  # not installed: TensorBoard's own, same bytes
    assert masked_crc32c(data) == struct.pack('<I', tensorboards(data))
    monkeypatch.undo()
    trackers = build_trackers(['tensorboard'], tmp_path / 'run', 'run', METRIC_NAMES)
    for step in range(1, 11):
        log_step(trackers, step)
    trackers.log_text('args', 'lr: 0.1', 0)
    trackers.close()
    events = read_events(tmp_path / 'run')
    assert [e.step for e in events.Images('val/predictions')] == IMAGE_STEPS
    assert 'args/text_summary' in events.Tags()['tensors']


TENSORBOARD_IMPORTS = """
import sys
import numpy as np
from utils.trackers import build_trackers
trackers = build_trackers(['tensorboard'], sys.argv[1], 'run', ['final/val/acc'])
trackers.log_hparams({'lr': 0.1, 'amp': False, 'task': 'classify'})
trackers.log_text('args', 'lr: 0.1', 0)
trackers.log_metrics({'val/acc': 0.5}, 1, 0)
trackers.log_images({'val/predictions': np.zeros((8, 8, 3), np.uint8)}, 1)
trackers.finish({'final/val/acc': 0.5})
trackers.close()
slow = ('torch.utils.tensorboard', 'tensorboard.compat.tensorflow_stub', 'boto3')
print(sorted(name for name in slow if name in sys.modules))
"""


def test_writing_every_kind_of_tensorboard_record_imports_only_its_protocol_buffers(tmp_path):
    """torch.utils.tensorboard imports torch.export, and TensorBoard's file layer imports boto3: a tenth of
    a second each, on the writer thread holding the interpreter lock while training runs."""
    import subprocess

    from conftest import REPO, timeout

    result = subprocess.run(
        [sys.executable, '-c', TENSORBOARD_IMPORTS, str(tmp_path / 'run')],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '[]'
    events = read_events(tmp_path / 'run')
    assert [e.step for e in events.Images('val/predictions')] == [1] and 'args/text_summary' in events.Tags()['tensors']


def test_tensorboard_is_imported_only_when_something_is_written(tmp_path, monkeypatch):
    # None in sys.modules makes any import of it fail: building, keeping the options and
    # checkpointing must not import it; the first point does, and fails with the install line
    monkeypatch.setitem(sys.modules, 'tensorboard.compat.proto.summary_pb2', None)
    trackers = build_trackers(['tensorboard'], tmp_path / 'run', 'run', METRIC_NAMES)
    trackers.log_hparams(HPARAMS)
    trackers.state_dict()
    trackers.commit(0)
    assert not list((tmp_path / 'run').iterdir())
    with pytest.raises(KilnError, match=r'^--loggers tensorboard needs the tensorboard package: .*pip install'):
        trackers.log_metrics({'train/loss': 1.0}, 1, 0)
    trackers.close()


# --- CSV ---------------------------------------------------------------------------------------


def read_metrics_csv(path):
    """{column: {step: value}} read with pandas when it is installed, else with the csv module."""
    try:
        import pandas
    except ImportError:
        with open(path, newline='') as f:
            rows = list(csv.DictReader(f))
        columns = list(rows[0])
        table = {c: {int(r['step']): float(r[c]) for r in rows if r[c] != ''} for c in columns}
        steps = [int(r['step']) for r in rows]
    else:
        frame = pandas.read_csv(path)
        columns = list(frame.columns)
        table = {c: {int(s): float(v) for s, v in zip(frame['step'], frame[c]) if not pandas.isna(v)} for c in columns}
        steps = frame['step'].tolist()
    assert len(steps) == len(set(steps)), f'duplicate rows in {steps}'
    return columns, table


@pytest.mark.parametrize('kill', ['after_commit', 'before_commit'])
def test_csv_resume_has_every_row_once(tmp_path, kill):
    folder = tmp_path / 'run'
    left = []  # what the killed run left: with 'after_commit', rows 6 and 7 that the resume must drop
    kill_and_resume(
        ['csv'],
        folder,
        options(tmp_path),
        kill,
        on_kill=lambda: left.append(max(read_metrics_csv(folder / 'metrics.csv')[1]['train/loss'])),
    )
    assert left == [7 if kill == 'after_commit' else RESUME_STEP]
    columns, table = read_metrics_csv(folder / 'metrics.csv')
    assert columns == ['step', 'epoch', 'train/loss', 'val/acc']
    for name, expected in EXPECTED.items():
        assert table[name] == expected
    assert table['epoch'] == {step: (step - 1) // 4 for step in range(1, LAST_STEP + 1)}
    assert [p.name for p in folder.iterdir()] == ['metrics.csv']  # no temporary file left


def test_csv_appends_new_rows_and_rewrites_only_for_a_change(tmp_path, monkeypatch):
    """metrics.csv was rewritten whole at every checkpoint: a run of thousands of validations spent its
    saves rewriting it (0.3 s at 50k rows). New rows of the same columns are appended now."""
    import utils.trackers.csv_tracker as csv_tracker

    rewrites = []
    monkeypatch.setattr(
        csv_tracker,
        'atomic_write_bytes',
        lambda data, path: (rewrites.append(data), (tmp_path / 'metrics.csv').write_bytes(data)),
    )
    tracker = csv_tracker.CsvTracker(str(tmp_path), 'run')
    for step in range(1, 6):
        tracker.log_metrics({'train/loss': 1 / step}, step, 0)
        tracker.commit(step)
    assert len(rewrites) == 1  # the first write (the header); then appended rows
    tracker.log_metrics({'train/loss': 0.1, 'val/acc': 0.5}, 6, 1)  # a new column: the header changes
    tracker.commit(6)
    tracker.log_metrics({'val/acc': 0.7}, 5, 0)  # a row the file has changes
    tracker.commit(7)
    tracker.log_metrics({'train/loss': 0.05, 'val/acc': 0.8}, 7, 1)
    tracker.close()
    assert len(rewrites) == 3
    columns, table = read_metrics_csv(tmp_path / 'metrics.csv')
    assert columns == ['step', 'epoch', 'train/loss', 'val/acc']
    assert table['train/loss'] == {1: 1.0, 2: 0.5, 3: 1 / 3, 4: 0.25, 5: 0.2, 6: 0.1, 7: 0.05}
    assert table['val/acc'] == {5: 0.7, 6: 0.5, 7: 0.8}

    # an append that failed (a full disk) after writing part of a row: the next write replaces the file
    def half_written(data, path):
        with open(path, 'ab') as f:
            f.write(data[: len(data) // 2])
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(csv_tracker, 'append_bytes', half_written)
    tracker.log_metrics({'train/loss': 0.04, 'val/acc': 0.9}, 8, 1)
    with pytest.raises(OSError):
        tracker.commit(8)
    monkeypatch.undo()
    tracker.close()
    assert read_metrics_csv(tmp_path / 'metrics.csv')[1]['val/acc'] == {5: 0.7, 6: 0.5, 7: 0.8, 8: 0.9}
    # a power cut while a row was appended: a resumed run drops the half row (and rewrites the file)
    with open(tmp_path / 'metrics.csv', 'a') as f:
        f.write('9,1,0.0')
    resumed = csv_tracker.CsvTracker(str(tmp_path), 'run', resume_step=9)
    assert sorted(resumed.rows) == [1, 2, 3, 4, 5, 6, 7, 8]


# --- MLflow ------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def mlflow_checkpoints(tmp_path_factory):
    """One checkpoints folder, so one local MLflow store, for this module (creating it takes seconds)."""
    for module in ('mlflow', 'sqlalchemy', 'alembic'):
        pytest.importorskip(module, reason=f"{module} is not installed (python3 -m pip install -e '.[trackers]')")
    return tmp_path_factory.mktemp('checkpoints')


@pytest.mark.parametrize('kill', ['after_commit', 'before_commit'])
def test_mlflow_resume_has_every_point_once_in_one_run(tmp_path, mlflow_checkpoints, kill):
    from mlflow.tracking import MlflowClient

    from utils.trackers.mlflow_tracker import EXPERIMENT, local_store

    folder = tmp_path / f'run_{kill}'
    _, saved, last = kill_and_resume(['mlflow'], folder, options(mlflow_checkpoints), kill)
    run_id = saved['mlflow']['run_id']
    assert last['mlflow']['run_id'] == run_id
    client = MlflowClient(tracking_uri=local_store(mlflow_checkpoints)[0])
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], f"attributes.run_name = '{folder.name}'")
    assert [run.info.run_id for run in runs] == [run_id]
    run = runs[0]
    assert run.info.status == 'FINISHED'
    assert run.data.params['lr'] == '0.01' and run.data.params['load_model_path'] == 'None'
    for name, expected in EXPECTED.items():
        assert steps_and_values((m.step, m.value) for m in client.get_metric_history(run_id, name)) == expected
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, 'final/val/acc')] == [(10, acc(10))]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert 'args.md' in artifacts
    # images/<key>+step+<step>+timestamp+<uuid>.png (MLflow 3.17), each beside a compressed .webp
    images = [a.path for a in client.list_artifacts(run_id, 'images') if a.path.endswith('.png')]
    # pictures are not kept in the checkpoint's state: a kill before the commit loses step 3's
    expected = IMAGE_STEPS if kill == 'after_commit' else IMAGE_STEPS[1:]
    assert sorted(int(re.search(r'\Wstep\W(\d+)\W', path).group(1)) for path in images) == expected


def test_mlflow_resume_from_an_older_checkpoint_writes_no_point_twice(tmp_path, mlflow_checkpoints):
    """A finished run resumed from its checkpoint of step 5 (named with --resume, or the newest one whole):
    MLflow holds the points of steps 6 to 10 and the end already, and gets none of them again."""
    from mlflow.tracking import MlflowClient

    from utils.trackers.mlflow_tracker import local_store

    folder = tmp_path / 'run'
    first = build_trackers(['mlflow'], folder, folder.name, METRIC_NAMES, options=options(mlflow_checkpoints))
    for step in range(1, RESUME_STEP + 1):
        log_step(first, step)
    saved = first.state_dict()
    first.commit(RESUME_STEP)
    first.close()  # a kill: the rest of the run is logged by a resume from step 5 that is not killed
    resume_to_the_end(['mlflow'], folder, options(mlflow_checkpoints), RESUME_STEP, saved)
    resume_to_the_end(['mlflow'], folder, options(mlflow_checkpoints), RESUME_STEP, saved)
    client = MlflowClient(tracking_uri=local_store(mlflow_checkpoints)[0])
    run_id = saved['mlflow']['run_id']
    for name, expected in EXPECTED.items():
        assert steps_and_values((m.step, m.value) for m in client.get_metric_history(run_id, name)) == expected
    for name, value in final_metrics(LAST_STEP).items():
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, name)] == [(LAST_STEP, value)]
    images = [a.path for a in client.list_artifacts(run_id, 'images') if a.path.endswith('.png')]
    assert sorted(int(re.search(r'\Wstep\W(\d+)\W', path).group(1)) for path in images) == IMAGE_STEPS


def test_mlflow_resume_writes_a_nan_point_once(tmp_path, mlflow_checkpoints):
    """NaN equals nothing, so a held NaN (a mIoU with no class present) never matched: each resume wrote the
    checkpoint's pending NaN point again."""
    from mlflow.tracking import MlflowClient

    from utils.trackers.mlflow_tracker import local_store

    folder = tmp_path / 'run'
    first = build_trackers(['mlflow'], folder, folder.name, METRIC_NAMES, options=options(mlflow_checkpoints))
    first.log_metrics({'val/acc': 0.5, 'val/miou': float('nan')}, 1, 0)
    saved = first.state_dict()  # its pending points, as a checkpoint keeps them
    first.commit(1)
    first.close()
    for _ in range(2):
        resumed = build_trackers(
            ['mlflow'], folder, folder.name, METRIC_NAMES, 1, saved, options=options(mlflow_checkpoints)
        )
        resumed.close()
    client = MlflowClient(tracking_uri=local_store(mlflow_checkpoints)[0])
    history = client.get_metric_history(saved['mlflow']['run_id'], 'val/miou')
    assert len(history) == 1 and history[0].step == 1, [(m.step, m.value) for m in history]


def test_mlflow_takes_a_folder_name_that_is_no_utf8(tmp_path, mlflow_checkpoints):
    """--save_prefix $'r\\xe9' (a Latin-1 byte) ended in MLflow's traceback: 'utf-8' codec can't encode."""
    from mlflow.tracking import MlflowClient

    from utils.trackers.mlflow_tracker import local_store

    folder = tmp_path / 'r\udce9'  # as Python keeps the byte 0xe9 of a name
    folder.mkdir()
    trackers = build_trackers(['mlflow'], folder, folder.name, METRIC_NAMES, options=options(mlflow_checkpoints))
    trackers.log_hparams({'save_prefix': 'r\udce9'})
    trackers.log_text('args', 'save_prefix: r\udce9', 0)
    state = trackers.state_dict()
    trackers.close()
    run = MlflowClient(tracking_uri=local_store(mlflow_checkpoints)[0]).get_run(state['mlflow']['run_id'])
    assert run.info.run_name == 'r\\xe9' and run.data.params['save_prefix'] == 'r\\xe9'


def test_mlflow_resume_that_changes_values_writes_the_new_ones(tmp_path, mlflow_checkpoints):
    """A resume may change what it logs (--epochs under a cosine schedule changes the learning rate):
    MLflow kept the first run's values at those steps, beside the other trackers' new ones."""
    from mlflow.tracking import MlflowClient

    from utils.trackers.mlflow_tracker import local_store

    folder = tmp_path / 'run'
    first = build_trackers(['mlflow'], folder, folder.name, METRIC_NAMES, options=options(mlflow_checkpoints))
    log_step(first, RESUME_STEP)
    saved = first.state_dict()
    first.commit(RESUME_STEP)
    for step in (RESUME_STEP + 1, RESUME_STEP + 2):
        first.log_metrics({'train/lr': 0.1}, step, 1)
    first.commit(RESUME_STEP + 2)
    first.close()
    resumed = build_trackers(
        ['mlflow'],
        folder,
        folder.name,
        METRIC_NAMES,
        resume_step=RESUME_STEP,
        states=saved,
        options=options(mlflow_checkpoints),
    )
    resumed.log_metrics({'train/lr': 0.1}, RESUME_STEP + 1, 1)  # the same value: held already
    resumed.log_metrics({'train/lr': 0.05}, RESUME_STEP + 2, 1)  # another value: written
    resumed.commit(RESUME_STEP + 2)
    resumed.close()
    client = MlflowClient(tracking_uri=local_store(mlflow_checkpoints)[0])
    points = sorted((m.step, m.value) for m in client.get_metric_history(saved['mlflow']['run_id'], 'train/lr'))
    assert points == [(RESUME_STEP + 1, 0.1), (RESUME_STEP + 2, 0.05), (RESUME_STEP + 2, 0.1)]


def test_mlflow_resume_needs_the_store_of_its_run(tmp_path, mlflow_checkpoints):
    with pytest.raises(KilnError, match=f'the MLflow run {"0" * 32} of this checkpoint is not in sqlite:///'):
        build_trackers(
            ['mlflow'],
            tmp_path / 'run',
            'run',
            resume_step=5,
            states={'mlflow': {'run_id': '0' * 32}},
            options=options(mlflow_checkpoints),
        )


def mlflow_settings_error(tmp_path, uri=None):
    """The KilnError of a run with --mlflow_uri `uri` (None: MLFLOW_TRACKING_URI or the local store)."""
    pytest.importorskip('mlflow', reason='mlflow-skinny is not installed')
    with pytest.raises(KilnError) as error:
        build_trackers(['mlflow'], tmp_path / 'run', 'run', options=SimpleNamespace(mlflow_uri=uri))
    return str(error.value)


def test_mlflow_uri_that_mlflow_refuses_is_one_line_saying_what_to_give(tmp_path, monkeypatch):
    database = tmp_path / 'x.db'
    assert mlflow_settings_error(tmp_path, str(database)) == (
        f"--mlflow_uri {database} is a folder of MLflow's file store, which MLflow 3 refuses; for a database "
        f'file give sqlite:///{database}, or give no URI for the local store in <checkpoints_dir>/mlruns'
    )
    monkeypatch.setenv('MLFLOW_TRACKING_URI', str(tmp_path / 'store'))
    assert mlflow_settings_error(tmp_path).startswith(f'MLFLOW_TRACKING_URI {tmp_path / "store"} is a folder of')
    assert mlflow_settings_error(tmp_path, 'bogus://x').startswith(
        '--mlflow_uri bogus://x: MLflow has no store for bogus:// URIs; give sqlite:///<database file>, http(s)://'
    )


def test_mlflow_server_not_there_fails_at_once(tmp_path, monkeypatch):
    """MLflow's own retries would wait four minutes; the user's retry settings still count."""
    import socket

    from mlflow.utils import rest_utils

    with socket.socket() as port:  # bound, never listening: a connection is refused
        port.bind(('127.0.0.1', 0))
        uri = f'http://127.0.0.1:{port.getsockname()[1]}'
        started = time.monotonic()
        assert mlflow_settings_error(tmp_path, uri).startswith(f'no MLflow server answers at {uri} (--mlflow_uri): ')
        assert time.monotonic() - started < 10
        requests = []
        monkeypatch.setattr(rest_utils, 'http_request', lambda *args, **kwargs: requests.append(kwargs) or 1 / 0)
        monkeypatch.setenv('MLFLOW_HTTP_REQUEST_MAX_RETRIES', '3')
        monkeypatch.setenv('MLFLOW_HTTP_REQUEST_TIMEOUT', '60')
        with pytest.raises(ZeroDivisionError):
            build_trackers(['mlflow'], tmp_path / 'run', 'run', options=SimpleNamespace(mlflow_uri=uri))
        assert requests[0]['max_retries'] is None and requests[0]['timeout'] is None  # MLflow reads them


def test_mlflow_deleted_experiment_is_one_line_saying_how_to_restore_it(tmp_path, mlflow_checkpoints):
    from mlflow.tracking import MlflowClient

    from utils.trackers.mlflow_tracker import EXPERIMENT

    uri = f'sqlite:///{mlflow_checkpoints}/deleted/mlflow.db'  # its own store: the experiment goes
    client = MlflowClient(tracking_uri=uri)
    client.delete_experiment(client.create_experiment(EXPERIMENT))
    assert re.fullmatch(
        rf"the MLflow experiment 'kiln' in {uri} is deleted; restore it \(mlflow experiments restore "
        r'--experiment-id \d+, with that tracking URI\) or give another --mlflow_uri',
        mlflow_settings_error(tmp_path, uri),
    )


NEW_STORE_AT_ONCE = """
import os, sys, time
from types import SimpleNamespace
from utils.trackers import build_trackers
import mlflow.tracking
open(sys.argv[2], 'w').close()
while not os.path.exists(sys.argv[3]):  # every process ready: they open the new store together
    time.sleep(0.01)
options = SimpleNamespace(mlflow_uri=None, checkpoints_dir=sys.argv[1])
build_trackers(['mlflow'], os.path.join(sys.argv[1], os.path.basename(sys.argv[2])), 'run', options=options).close()
"""


def test_runs_that_start_together_on_a_new_mlflow_store_both_start(tmp_path, mlflow_checkpoints):
    """MLflow creates a new SQLite store's tables when it first opens it; two processes that do so at
    once fail in one of them (alembic "Online migration expected to match one row") without a lock."""
    import subprocess

    from conftest import REPO, timeout

    go = tmp_path / 'go'
    ready = [tmp_path / f'ready{number}' for number in range(2)]
    runs = [
        subprocess.Popen(
            [sys.executable, '-c', NEW_STORE_AT_ONCE, str(tmp_path / 'checkpoints'), str(name), str(go)],
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ready
    ]
    while not all(name.exists() for name in ready) and all(run.poll() is None for run in runs):
        time.sleep(0.01)
    go.touch()
    for run in runs:
        assert run.wait(timeout=timeout(120)) == 0, run.communicate()[1]


def test_mlflow_needs_sqlalchemy_for_its_local_store(tmp_path, monkeypatch):
    pytest.importorskip('mlflow', reason='mlflow-skinny is not installed')
    monkeypatch.setitem(sys.modules, 'sqlalchemy', None)
    with pytest.raises(KilnError, match=r'^--loggers mlflow needs the sqlalchemy package: .*pip install'):
        build_trackers(['mlflow'], tmp_path / 'run', 'run', options=options(tmp_path))


# --- W&B ---------------------------------------------------------------------------------------


def wandb_records(path):
    """The records of a .wandb transaction log: a 7-byte header (':W&B', magic, version), then
    LevelDB-log chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks,
    each record a wandb_internal_pb2.Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, position, record = path.read_bytes(), 7, b''
    assert data[:4] == b':W&B'
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack('<IHB', data[position : position + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at a block's end
            position += left
            continue
        record += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            yield Record.FromString(record)
            record = b''


def wandb_logged(logs):
    """What the .wandb transaction logs `logs` record, in order: history ({key: [(step, value)]}),
    config and summary."""
    history, config, summary = {}, {}, {}
    for record in (record for log in logs for record in wandb_records(log)):
        kind = record.WhichOneof('record_type')
        if kind == 'history':
            row = {}
            for item in record.history.item:  # an image is several items: nested_key [tag, field]
                key, *field = [item.key] if item.key else item.nested_key
                value = json.loads(item.value_json)
                row[key] = {**row.get(key, {}), field[0]: value} if field else value
            for key, value in row.items():
                history.setdefault(key, []).append((row['_step'], value))
        elif kind in ('run', 'config'):
            updates = record.run.config.update if kind == 'run' else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
        elif kind == 'summary':
            summary.update(
                {item.key or '/'.join(item.nested_key): json.loads(item.value_json) for item in record.summary.update}
            )
    return history, config, summary


@pytest.fixture
def wandb_module():
    wandb = pytest.importorskip('wandb', reason='wandb is not installed')
    yield wandb
    wandb.teardown()  # stop this test's W&B service, started with this test's environment


def read_offline_runs(folder, run_id):
    """The history ({key: [(step, value)]}), config and summary in the offline runs of `run_id`."""
    # A's and B's: offline-run-<start time>-<id>, with a -1 added when both started in the same second
    runs = sorted((folder / 'wandb').glob('offline-run-*'))
    assert len(runs) == 2 and all(re.fullmatch(rf'offline-run-\d+_\d+-{run_id}(-\d+)?', run.name) for run in runs)
    logs = [run / f'run-{run_id}.wandb' for run in runs]
    # W&B's service writes the log on its own: under load, after finish() has returned
    deadline = time.time() + 30
    while not all(any(r.WhichOneof('record_type') == 'exit' for r in wandb_records(log)) for log in logs):
        assert time.time() < deadline, 'a W&B run log never got its exit record'
        time.sleep(0.1)
    return wandb_logged(logs)


@pytest.mark.parametrize('kill', ['after_commit', 'before_commit'])
def test_wandb_offline_resume_has_every_point_once_in_one_run(tmp_path, wandb_module, kill):
    """A kill between a checkpoint's write and its commit lost the checkpoint's points for good: they were
    in no W&B run and in no checkpoint."""
    folder = tmp_path / 'run'
    # the end of A's process: W&B's service goes, A's run is never finished
    _, saved, last = kill_and_resume(['wandb'], folder, options(tmp_path), kill, on_kill=wandb_module.teardown)
    run_id = saved['wandb']['run_id']
    assert last['wandb']['run_id'] == run_id
    history, config, summary = read_offline_runs(folder, run_id)
    for name, expected in EXPECTED.items():
        assert steps_and_values(history[name]) == expected
    # pictures are not kept in the checkpoint's state: a kill before the commit loses step 3's
    expected = IMAGE_STEPS if kill == 'after_commit' else IMAGE_STEPS[1:]
    assert sorted(step for step, _ in history['val/predictions']) == expected
    assert history['val/predictions'][0][1]['_type'] == 'image-file'
    assert steps_and_values(history['epoch']) == {step: (step - 1) // 4 for step in range(1, LAST_STEP + 1)}
    assert {key: config.get(key) for key in HPARAMS} == HPARAMS
    assert summary['final/val/acc'] == acc(LAST_STEP) and summary['args'] == '    lr: 0.01'


def test_wandb_resume_from_an_older_checkpoint_logs_to_a_new_run(tmp_path, wandb_module, capsys):
    """W&B cannot take back steps: a resume from the checkpoint of step 5 of a run that wrote steps up to
    10 logged 6..10 into the same run again, where W&B keeps the first values. It goes to a new run."""
    folder = tmp_path / 'run'
    first = build_trackers(['wandb'], folder, folder.name, METRIC_NAMES, options=options(tmp_path))
    for step in range(1, LAST_STEP + 1):
        log_step(first, step)
        if step == RESUME_STEP:
            saved = first.state_dict()
            first.commit(step)
    first.commit(LAST_STEP)
    first.finish(final_metrics(LAST_STEP))
    first.close()
    old_id = saved['wandb']['run_id']
    last = resume_to_the_end(['wandb'], folder, options(tmp_path), RESUME_STEP, saved)
    new_id = last['wandb']['run_id']
    assert new_id != old_id
    assert f'note: W&B run {old_id} has points after step {RESUME_STEP}' in capsys.readouterr().out
    runs = {run.name.split('-')[-1]: run for run in (folder / 'wandb').glob('offline-run-*')}
    wandb_module.teardown()  # the service writes what it holds
    for run_id, steps in ((old_id, range(1, LAST_STEP + 1)), (new_id, range(RESUME_STEP + 1, LAST_STEP + 1))):
        history, _, _ = wandb_logged([runs[run_id] / f'run-{run_id}.wandb'])
        assert [step for step, _ in history['train/loss']] == list(steps), run_id
    # the new run's own resume from its newest checkpoint continues it
    again = build_trackers(['wandb'], folder, 'run', resume_step=LAST_STEP, states=last, options=options(tmp_path))
    assert again.state_dict()['wandb']['run_id'] == new_id
    again.close()


@pytest.mark.parametrize('tracker', ['mlflow', 'wandb'])
def test_a_copied_experiment_folder_logs_to_a_run_of_its_own_and_a_moved_one_to_its_run(
    tmp_path, tracker, capsys, request
):
    """`cp -a run copy` and a resume of the copy wrote into the original's MLflow run (and W&B's): both
    then held two values at the same steps. A folder moved away continues its run, as before."""
    import os
    import shutil

    checkpoints = request.getfixturevalue('mlflow_checkpoints') if tracker == 'mlflow' else tmp_path
    if tracker == 'wandb':
        request.getfixturevalue('wandb_module')
    folder = tmp_path / 'run'
    folder.mkdir()
    first = build_trackers([tracker], folder, folder.name, METRIC_NAMES, options=options(checkpoints))
    for step in range(1, RESUME_STEP + 1):
        log_step(first, step)
    saved = first.state_dict()
    first.commit(RESUME_STEP)
    first.close()
    run_id = saved[tracker]['run_id']
    shutil.copytree(folder, tmp_path / 'copy')
    copy = build_trackers([tracker], tmp_path / 'copy', 'copy', METRIC_NAMES, RESUME_STEP, saved, options(checkpoints))
    own = copy.state_dict()[tracker]['run_id']
    assert own != run_id
    assert f'is the run of {folder}, which this folder is a copy of' in capsys.readouterr().out
    copy.close()
    if tracker == 'mlflow':  # the points the checkpoint kept are the original's: the copy's run starts after them
        from mlflow.tracking import MlflowClient

        from utils.trackers.mlflow_tracker import local_store

        client = MlflowClient(tracking_uri=local_store(checkpoints)[0])
        assert client.get_metric_history(own, 'train/loss') == []
    os.rename(folder, tmp_path / 'moved')
    moved = build_trackers([tracker], tmp_path / 'moved', 'run', METRIC_NAMES, RESUME_STEP, saved, options(checkpoints))
    assert moved.state_dict()[tracker]['run_id'] == run_id
    moved.close()


def test_wandb_setting_it_refuses_is_one_line(tmp_path, wandb_module):
    with pytest.raises(KilnError) as error:
        build_trackers(['wandb'], tmp_path / 'run', 'run', options=SimpleNamespace(wandb_project='a/b'))
    assert re.fullmatch(
        r"W&B refuses to start the run: Invalid project name 'a/b'.*; fix --wandb_project \(a/b\) or the WANDB_\* "
        r'environment variables',
        str(error.value),
    )


def test_wandb_goes_offline_without_a_login(tmp_path, monkeypatch):
    assert wandb_mode() is None  # WANDB_MODE is set (by the offline fixture): W&B decides
    monkeypatch.delenv('WANDB_MODE')
    assert not logged_in() and wandb_mode() == 'offline'
    netrc = tmp_path / 'home' / '.netrc'
    netrc.parent.mkdir(exist_ok=True)
    netrc.write_text('machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n')
    assert logged_in() and wandb_mode() == 'online'
    netrc.unlink()
    monkeypatch.setenv('WANDB_API_KEY', '0123456789abcdef')
    assert wandb_mode() == 'online'


# --- all trackers ------------------------------------------------------------------------------


@pytest.mark.parametrize('name, module, package', [('wandb', 'wandb', 'wandb'), ('mlflow', 'mlflow', 'mlflow-skinny')])
def test_a_missing_package_names_the_install_command(tmp_path, monkeypatch, name, module, package):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(KilnError) as error:
        build_trackers(['csv', name], tmp_path / 'run', 'run', options=options(tmp_path))
    assert str(error.value) == f"--loggers {name} needs the {package} package: python3 -m pip install -e '.[trackers]'"


def test_build_trackers_checks_names_and_keeps_states_by_name(tmp_path):
    with pytest.raises(KilnError, match='unknown --loggers neptune'):
        build_trackers(['csv', 'neptune'], tmp_path / 'run', 'run')
    trackers = build_trackers(['csv', 'tensorboard', 'csv'], tmp_path / 'run', 'run')
    assert [t.name for t in trackers] == ['csv', 'tensorboard']
    assert trackers.state_dict() == {'csv': {}, 'tensorboard': {}}
    trackers.close()


def test_trackers_left_out_of_a_start_keep_their_saved_states(tmp_path):
    """A resume without --loggers wandb keeps the W&B run id (and the MLflow state) in its checkpoints,
    so that a later resume with it continues that run instead of starting a new one."""
    saved = {'csv': {}, 'wandb': {'run_id': 'abc123'}, 'mlflow': {'run_id': 'f' * 32, 'pending': [[5, {'a': 1.0}]]}}
    trackers = build_trackers(['csv', 'tensorboard'], tmp_path / 'run', 'run', resume_step=5, states=saved)
    assert trackers.state_dict() == {**saved, 'tensorboard': {}}
    trackers.close()


def test_a_checkpoint_s_tensorboard_points_are_on_disk_before_it(tmp_path, monkeypatch):
    """The event file was flushed, never fsynced: after a power cut a checkpoint could stand for points
    that its event file lost (the CSV file's are fsynced)."""
    import os

    from utils.trackers import tb_tracker

    synced = []
    monkeypatch.setattr(tb_tracker.os, 'fsync', lambda fd: synced.append(os.readlink(f'/proc/self/fd/{fd}')))
    trackers = build_trackers(['tensorboard'], str(tmp_path), 'run', ['val/acc'])
    assert trackers.state_dict() == {'tensorboard': {}} and synced == []  # nothing written yet
    trackers.log_metrics({'val/acc': 0.5}, 3, 0)
    trackers.state_dict()  # what the checkpointer asks right before it writes the checkpoint's file
    assert len(synced) == 1 and os.path.basename(synced[0]).startswith('events.out.tfevents.'), synced
    trackers.close()


def test_a_close_cut_short_runs_no_more_jobs_and_closes_no_tracker_under_the_running_one():
    """A second Ctrl-C while the last files were written closed the trackers under the job writing to them,
    and the writer thread went on with the jobs queued after it."""
    import signal
    import threading

    from utils.logger import Logger
    from utils.trackers import Tracker

    events, started, release = [], threading.Event(), threading.Event()

    class Slow(Tracker):
        name = 'slow'

        def log_metrics(self, metrics, step, epoch):
            events.append(f'write {step}')
            started.set()
            release.wait(10)
            events.append(f'wrote {step}')

        def close(self):
            events.append('closed')

    logger = Logger(Trackers([Slow()]))
    logger.log_metrics({'val/acc': 0.5}, 1, 0)
    logger.log_metrics({'val/acc': 0.6}, 2, 0)

    def interrupt(*_):
        raise KeyboardInterrupt

    assert started.wait(10)  # the first job is running: close waits for it
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(KeyboardInterrupt):
            logger.close({'final/val/acc': 0.6})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert logger.writer.busy() and events == ['write 1']
    release.set()
    deadline = time.monotonic() + 10  # (an interrupted join marks the thread stopped: join() waits no more)
    while logger.writer._jobs.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events == ['write 1', 'wrote 1'] and not logger.writer.busy()  # job 2 and finish: not run


def test_close_closes_every_tracker_even_when_one_fails():
    closed = []

    class Failing:
        def close(self):
            raise OSError('disk full')

    class Fine:
        def close(self):
            closed.append(True)

    with pytest.raises(OSError, match='disk full'):
        Trackers([Failing(), Fine()]).close()
    assert closed == [True]


def test_no_pictures_are_drawn_for_trackers_that_keep_none(tiny_shapes, tmp_path, monkeypatch):
    """With --loggers csv alone, every validation picture was drawn and PNG-encoded, then dropped."""
    from conftest import run_script, tiny_run_args
    from tasks.classify import ClassifyTask

    drawn = []
    original = ClassifyTask.pictures
    monkeypatch.setattr(ClassifyTask, 'pictures', lambda self, *args: drawn.append(1) or original(self, *args))
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--model_type', 'linear', '--image_interval', '0']
    assert run_script('train.py', *args, '--loggers', 'csv', '--save_prefix', 'csv').returncode == 0
    assert not drawn
    assert run_script('train.py', *args, '--loggers', 'csv', 'tensorboard', '--save_prefix', 'both').returncode == 0
    assert len(drawn) == 2  # one picture of each validation (--image_interval 0)


def test_the_options_know_which_trackers_keep_pictures():
    """options.py (torch-free) names them for the --log_images note; the trackers themselves decide."""
    from options import ACTS_ONLY_WITH
    from utils.trackers import TRACKER_NAMES, keeps_pictures

    assert set(ACTS_ONLY_WITH['log_images'][1]) == {name for name in TRACKER_NAMES if keeps_pictures([name])}
