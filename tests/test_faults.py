"""Faults injected on purpose: kills at chosen moments (KILN_KILL_AT), a full disk, a read-only file
system, corrupt files, racing runs, interrupted start-ups, dead parents. Each must end in one line
or a clean recovery, and nothing a user has may be lost."""

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, run_script, timeout, tiny_run_args
from utils.run_folder import FolderLock

EXPERIMENT = 'small_cnn_list_default'


def _folder(args):
    return os.path.join(args[args.index('--checkpoints_dir') + 1], EXPERIMENT)


def _load(path):
    return torch.load(path, weights_only=True, map_location='cpu')


def _one_error_line(result, *needles):
    shown = f'exit {result.returncode}\n{result.stdout}\n{result.stderr}'
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and 'Traceback' not in result.stderr, shown
    assert len(lines) == 1 and lines[0].startswith('error: '), shown
    assert all(str(needle) in lines[0] for needle in needles), shown
    return lines[0]


def _python(code, *args, seconds=120):
    """`python -c code args` from the repo: its CompletedProcess, output as text."""
    command = [sys.executable, '-c', code, *map(str, args)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout(seconds))


def _ok(result):
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _snapshot(folder):
    return {
        name: open(os.path.join(folder, name), 'rb').read()
        for name in sorted(os.listdir(folder))
        if os.path.isfile(os.path.join(folder, name))
    }


def _start(args, *extra, env=None):
    return subprocess.Popen(
        [sys.executable, 'train.py', *args, *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _wait_for(condition, process=None, seconds=300):
    deadline = time.time() + timeout(seconds)
    while not condition():
        assert process is None or process.poll() is None, process.communicate()
        assert time.time() < deadline, 'timed out'
        time.sleep(0.02)


# kills at chosen moments ------------------------------------------------------------------------------


def test_a_kill_between_the_checkpoint_and_last_pth_does_not_block_resume(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    killed = run_script('train.py', *args, env={'KILN_KILL_AT': 'checkpoint_written'})
    assert killed.returncode == -signal.SIGKILL
    assert sorted(n for n in os.listdir(_folder(args)) if n.endswith('.pth')) == ['epoch001_step0000006.pth']
    resumed = _ok(run_script('train.py', *args, '--resume'))
    assert 'resuming' in resumed.stdout and 'epoch001_step0000006.pth' in resumed.stdout
    assert _load(os.path.join(_folder(args), 'last.pth'))['position']['step'] == 12
    with open(os.path.join(_folder(args), 'checkpoints.json')) as f:
        record = json.load(f)
    assert record['last'] == 'epoch002_step0000012.pth' and set(record['files']) <= {
        'epoch001_step0000006.pth',
        'epoch002_step0000012.pth',
    }


def test_a_kill_before_a_new_best_is_linked_leaves_best_pth_on_the_best_after_resume(tiny_shapes, tmp_path):
    """Killed after the checkpoint of a new best was written, before best.pth was linked to it: the
    resumed run reported that best, while best.pth (and eval.py of the folder) stayed on the old one."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--monitor', 'train/loss', '--keep_last', '2']
    killed = run_script('train.py', *args, env={'KILN_KILL_AT': 'checkpoint_written:2'})
    assert killed.returncode == -signal.SIGKILL
    folder = _folder(args)
    first, second = (_load(os.path.join(folder, f'epoch00{e}_step00000{6 * e:02d}.pth')) for e in (1, 2))
    assert second['monitor_value'] < first['monitor_value'], 'the second epoch must improve for this test'
    assert os.path.samefile(os.path.join(folder, 'best.pth'), os.path.join(folder, 'epoch001_step0000006.pth'))
    _ok(run_script('train.py', *args, '--resume'))
    assert os.path.samefile(os.path.join(folder, 'best.pth'), os.path.join(folder, 'epoch002_step0000012.pth'))
    with open(os.path.join(folder, 'checkpoints.json')) as f:
        assert json.load(f)['best'] == 'epoch002_step0000012.pth'


def test_a_kill_between_the_record_and_the_pruning_leaves_no_file_behind(tiny_shapes, tmp_path):
    """Killed after the record dropped the older checkpoint, before its file was removed: the resume took it
    for one put there by hand, moved it to superseded/unrecorded/ (said so, wrongly) and kept it for good."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--monitor', 'train/loss']
    killed = run_script('train.py', *args, env={'KILN_KILL_AT': 'record_written:2'})
    assert killed.returncode == -signal.SIGKILL
    folder = _folder(args)
    assert os.path.exists(os.path.join(folder, 'epoch001_step0000006.pth'))  # dropped from the record only
    copy = tmp_path / 'copy'
    shutil.copytree(folder, copy)  # (as the kill left it)
    resumed = _ok(run_script('train.py', *args, '--resume', '--epochs', '3'))
    assert 'no record' not in resumed.stdout and not os.path.exists(os.path.join(folder, 'superseded'))
    assert sorted(n for n in os.listdir(folder) if n.startswith('epoch')) == ['epoch003_step0000018.pth']
    # resumed from that very file: the newer ones are set aside, and it is the folder's newest (it was removed
    # as pruned: a kill before the next save left no checkpoint)
    named = copy / 'epoch001_step0000006.pth'
    killed = run_script('train.py', '--resume', named, env={'KILN_KILL_AT': 'temporary_written'})
    assert killed.returncode == -signal.SIGKILL and named.is_file()


def test_a_run_killed_after_its_last_checkpoint_writes_its_end_when_resumed(tiny_shapes, tmp_path):
    """Killed between its last checkpoint and its end records (or a full disk as the record was written),
    a run resumed said "nothing left to train" and never wrote history.json, its final and best metrics,
    TensorBoard's HParams row or the checkpoint's record. Now the resume writes them, once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    killed = run_script('train.py', *args, env={'KILN_KILL_AT': 'links_made:2'})  # the last checkpoint's links
    assert killed.returncode == -signal.SIGKILL
    folder = _folder(args)
    assert not os.path.exists(os.path.join(folder, 'history.json'))
    resumed = _ok(run_script('train.py', *args, '--resume'))
    assert 'nothing left to train' in resumed.stdout, resumed.stdout
    uninterrupted = tiny_run_args(tiny_shapes, tmp_path / 'whole')
    _ok(run_script('train.py', *uninterrupted))
    for name in ('history.json', 'checkpoints.json'):
        with open(os.path.join(folder, name)) as f, open(os.path.join(_folder(uninterrupted), name)) as g:
            written, expected = json.load(f), json.load(g)
        for record in (written, expected) if name == 'checkpoints.json' else ():
            for entry in record['files'].values():
                entry.pop('sha256')  # (the files hold the run's args, which differ)
        assert written == expected, name
    events = EventAccumulator(folder, size_guidance={'scalars': 0})
    events.Reload()
    assert {'final/val/acc', 'best/val/acc'} <= set(events.Tags()['scalars']), events.Tags()['scalars']
    files = sorted(os.listdir(folder))
    again = _ok(run_script('train.py', *args, '--resume'))  # ended now: a resume writes nothing
    assert 'nothing left to train' in again.stdout and sorted(os.listdir(folder)) == files


def test_a_kill_inside_a_write_leaves_a_temporary_file_that_the_next_start_removes(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    killed = run_script('train.py', *args, env={'KILN_KILL_AT': 'temporary_written'})
    assert killed.returncode == -signal.SIGKILL
    left = [n for n in os.listdir(_folder(args)) if '.tmp' in n]
    assert left
    for yours in ('.notes.tmp', '.config.tmpl'):  # hidden files of yours with .tmp in the name: they went too
        with open(os.path.join(_folder(args), yours), 'w') as f:
            f.write('mine\n')
    _ok(run_script('train.py', *args, '--resume'))
    assert sorted(n for n in os.listdir(_folder(args)) if '.tmp' in n) == ['.config.tmpl', '.notes.tmp']
    assert os.path.isfile(os.path.join(_folder(args), 'last.pth'))


@pytest.fixture
def saved_often(tiny_shapes, tmp_path):
    """A finished 2-epoch run saving every 2 steps and keeping the newest 2: its args."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--save_interval', '2', '--keep_last', '2']
    _ok(run_script('train.py', *args))
    return args


def test_a_corrupt_checkpoint_record_is_rebuilt_and_pruning_goes_on(saved_often):
    folder = _folder(saved_often)
    with open(os.path.join(folder, 'checkpoints.json'), 'w') as f:
        f.write('{"last": ["epoch0')  # cut off mid-write by a full disk, say
    _ok(run_script('train.py', *saved_often, '--resume', '--epochs', '3'))
    with open(os.path.join(folder, 'checkpoints.json')) as f:
        record = json.load(f)
    kept = sorted(n for n in os.listdir(folder) if n.startswith('epoch'))
    assert record['last'] == 'epoch003_step0000018.pth' and kept == sorted(record['files'])
    assert len(kept) <= 3  # the newest 2 and the best: the old ones were pruned


def test_a_checkpoint_the_record_does_not_list_is_set_aside_not_pruned(saved_often):
    """A file named as a checkpoint that checkpoints.json does not list (one a kill left before its record,
    or one of yours copied in) was deleted by the next save's pruning."""
    folder = _folder(saved_often)
    shutil.copyfile(os.path.join(folder, 'last.pth'), os.path.join(folder, 'epoch000_step0000001.pth'))
    resumed = _ok(run_script('train.py', *saved_often, '--resume', '--epochs', '3'))
    assert 'epoch000_step0000001.pth is in no record of this run: moved to superseded/unrecorded/' in resumed.stdout
    assert not os.path.exists(os.path.join(folder, 'epoch000_step0000001.pth'))  # not kept among the newest
    assert os.listdir(os.path.join(folder, 'superseded', 'unrecorded')) == ['epoch000_step0000001.pth']


def test_flipped_bytes_in_a_checkpoint_are_detected(saved_often):
    folder = _folder(saved_often)
    newest = os.path.join(folder, 'epoch002_step0000012.pth')
    with open(newest, 'r+b') as f:  # last.pth is the same file (a hard link)
        f.seek(os.path.getsize(newest) // 2)
        f.write(bytes(16))
    evaluated = run_script(
        'eval.py', '--load_model_path', os.path.join(folder, 'last.pth'), '--no-progress_bar', '--cpu'
    )
    _one_error_line(evaluated, 'corrupt', 'last.pth')
    # the file named (the `train more:` line's last.pth) and fine-tuning from it: they trained on it, silently
    named = run_script('train.py', *saved_often, '--resume', os.path.join(folder, 'last.pth'), '--epochs', '3')
    _one_error_line(named, 'corrupt', 'last.pth')
    at = saved_often.index('--checkpoints_dir')
    other = [*saved_often[: at + 1], saved_often[at + 1] + '_tuned', *saved_often[at + 2 :]]
    tuned = run_script('train.py', *other, '--load_model_path', os.path.join(folder, 'last.pth'))
    _one_error_line(tuned, 'corrupt', 'last.pth')
    resumed = _ok(run_script('train.py', *saved_often, '--resume', '--epochs', '3'))
    assert 'skipping' in resumed.stdout and 'epoch002_step0000012.pth' in resumed.stdout
    assert 'resuming' in resumed.stdout and 'epoch001_step0000010.pth' in resumed.stdout
    assert _load(os.path.join(folder, 'last.pth'))['position']['step'] == 18


def test_a_folder_whose_checkpoints_are_all_corrupt_is_not_started_over(saved_often):
    """It said 'holds no checkpoint yet' and trained from step 0 in the folder, over the old run's files."""
    folder = _folder(saved_often)
    for name in os.listdir(folder):
        if name.endswith('.pth'):
            with open(os.path.join(folder, name), 'r+b') as f:
                f.truncate(100)
    before = {name: os.path.getmtime(os.path.join(folder, name)) for name in os.listdir(folder)}
    refused = run_script('train.py', *saved_often, '--resume', '--epochs', '3')
    _one_error_line(refused, 'none of its 3 checkpoints can be trusted', 'epoch002_step0000012.pth', 'move them out')
    assert {name: os.path.getmtime(os.path.join(folder, name)) for name in os.listdir(folder)} == before


def test_a_corrupt_newest_checkpoint_is_skipped_when_the_record_is_gone_too(saved_often):
    """The rebuilt record took the damaged file's checksum as it was, so it was trusted: the resume
    failed on it instead of going on from the one before."""
    folder = _folder(saved_often)
    os.remove(os.path.join(folder, 'checkpoints.json'))
    with open(os.path.join(folder, 'epoch002_step0000012.pth'), 'r+b') as f:
        f.truncate(1000)
    resumed = _ok(run_script('train.py', *saved_often, '--resume', '--epochs', '3'))
    assert 'skipping' in resumed.stdout and 'epoch002_step0000012.pth (unreadable)' in resumed.stdout
    assert 'resuming' in resumed.stdout and 'epoch001_step0000010.pth' in resumed.stdout
    assert _load(os.path.join(folder, 'last.pth'))['position']['step'] == 18


@pytest.mark.parametrize(
    'record',
    [
        '{"files": {"epoch002_step0000012.pth": {}}}',
        '{"files": {"epoch002_step0000012.pth": null}}',
        '{"files": {"epoch002_step0000012.pth": {"step": "x", "sha256": "0"}}, "best": 5}',
    ],
)
def test_a_record_of_the_wrong_shape_is_rebuilt(saved_often, record):
    """JSON that is no checkpoint record (an entry without its step, a step that is no number) gave a
    traceback (KeyError, TypeError); it is rebuilt from the files, as an unreadable one is."""
    folder = _folder(saved_often)
    with open(os.path.join(folder, 'checkpoints.json'), 'w') as f:
        f.write(record)
    resumed = _ok(run_script('train.py', *saved_often, '--resume', '--epochs', '3'))
    assert 'resuming' in resumed.stdout and 'epoch002_step0000012.pth' in resumed.stdout
    assert _load(os.path.join(folder, 'last.pth'))['position']['step'] == 18


def test_a_deleted_newest_checkpoint_is_restored_from_last_pth(saved_often):
    """last.pth held the only copy of the newest state: the resume went on from the one before and then
    moved last.pth on, losing it without a word."""
    folder = _folder(saved_often)
    newest = os.path.join(folder, 'epoch002_step0000012.pth')
    os.remove(newest)
    refused = run_script('train.py', *saved_often, '--resume', '--epochs', '3', '--batch_size', '64')
    assert refused.returncode == 2 and not os.path.exists(newest)  # a refused resume writes nothing
    resumed = _ok(run_script('train.py', *saved_often, '--resume', '--epochs', '3'))
    assert f'resuming {os.path.join(folder, "last.pth")}: epoch 2/3, step 12' in resumed.stdout, resumed.stdout
    assert 'restored epoch002_step0000012.pth from last.pth' in resumed.stdout  # (pruned later, as any other)
    assert _load(os.path.join(folder, 'last.pth'))['position']['step'] == 18


# resumes that must be refused ------------------------------------------------------------------------


@pytest.mark.parametrize(
    'change, needle',
    [
        (['--batch_size', '64'], '--batch_size 64 (the run has 16)'),
        (['--optimizer', 'sgd'], '--optimizer sgd (the run has adamw)'),
        (['--ema_decay', '0.9'], '--ema_decay 0.9 (the run has none)'),  # it said None, no value to give
    ],
)
def test_a_resume_that_would_change_the_run_is_refused_before_any_file_changes(saved_often, change, needle):
    folder = _folder(saved_often)
    before = _snapshot(folder)
    result = run_script(
        'train.py',
        *saved_often,
        '--resume',
        os.path.join(folder, 'epoch001_step0000010.pth'),
        *change,
        '--max_iteration',
        '12',
    )
    _one_error_line(result, needle, '--epochs')  # and it names what may change
    assert _snapshot(folder) == before


def test_a_resume_on_training_data_that_changed_since_is_refused_with_the_counts(tiny_shapes, tmp_path):
    """An image added to the training list: the message blamed --train_list and --seed, which had not changed."""
    lines = open(os.path.join(tiny_shapes, 'train.txt')).read().splitlines()
    listed = tmp_path / 'train.txt'
    listed.write_text(''.join(f'{os.path.join(tiny_shapes, line)}\n' for line in lines))
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    args[args.index('--train_list') + 1] = str(listed)
    _ok(run_script('train.py', *args, '--epochs', '1'))
    folder = _folder(args)
    before = _snapshot(folder)
    listed.write_text(listed.read_text() + f'{os.path.join(tiny_shapes, lines[0])}\n')
    result = run_script('train.py', '--resume', folder, '--epochs', '2')
    _one_error_line(
        result, 'the training data have 97 samples now, the checkpoint was trained on 96', '--load_model_path'
    )
    assert _snapshot(folder) == before
    # as many samples, other labels (or lines swapped): resumed silently, the check compared the counts only
    relabeled = [f'{os.path.join(tiny_shapes, line.rsplit(" ", 1)[0])} {(int(line[-1]) + 1) % 6}' for line in lines]
    listed.write_text('\n'.join(relabeled) + '\n')
    result = run_script('train.py', '--resume', folder, '--epochs', '2')
    _one_error_line(result, 'the training data differ from those the checkpoint was trained on', '--train_list')
    assert _snapshot(folder) == before
    # the same samples in another folder (the data moved): resumed
    moved = tmp_path / 'moved'
    shutil.copytree(tiny_shapes, moved)
    listed.write_text(''.join(f'{os.path.join(moved, line)}\n' for line in lines))
    assert 'resuming' in _ok(run_script('train.py', '--resume', folder, '--epochs', '2')).stdout


def test_resume_alone_names_a_run_left_in_the_working_folder_s_checkpoints(tiny_shapes, tmp_path):
    """The default --checkpoints_dir became the project's: `--resume` alone, in a folder whose checkpoints/
    holds the run (started when the default was the working folder's), started it anew in the project."""
    prefix = f'left_{os.getpid()}_{time.time_ns()}'
    args = [*tiny_run_args(tiny_shapes, 'checkpoints'), '--save_prefix', prefix, '--max_iteration', '2']
    train = os.path.join(REPO, 'train.py')
    _ok(run_script(train, *args, cwd=tmp_path))
    without_folder = [a for a in args if a not in ('--checkpoints_dir', 'checkpoints')]
    result = run_script(train, *without_folder, '--max_iteration', '4', '--resume', cwd=tmp_path)
    left = tmp_path / 'checkpoints' / f'small_cnn_list_{prefix}'
    _one_error_line(result, f'--resume: {left} holds this run', '--checkpoints_dir checkpoints')
    assert not os.path.exists(os.path.join(REPO, 'checkpoints', f'small_cnn_list_{prefix}'))
    assert 'resuming' in _ok(run_script(train, *args, '--max_iteration', '4', '--resume', cwd=tmp_path)).stdout


def test_two_runs_of_one_folder_are_refused(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--epochs', '500', '--save_interval', '2', '--resume']
    first = _start(args)
    _wait_for(lambda: os.path.exists(os.path.join(_folder(args), 'last.pth')), first)
    second = run_script('train.py', *args)
    _one_error_line(second, 'is in use by process', str(first.pid))
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=timeout(120))
    assert first.returncode == 128 + signal.SIGTERM
    assert len([n for n in os.listdir(_folder(args)) if n.startswith('events.')]) == 1


def test_a_resume_of_a_folder_in_use_says_so_before_reading_its_checkpoints(tiny_shapes, tmp_path, monkeypatch):
    """The running process prunes checkpoints: a second --resume that picked one before the lock check
    read a file already gone and said 'does not exist' (once in a CI run of the test above)."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--max_iteration', '2', '--save_interval', '1']
    assert run_script('train.py', *args).returncode == 0
    folder = _folder(args)
    pruned = os.path.join(folder, 'epoch000_step0000001.pth')
    assert not os.path.exists(pruned)  # --keep_last 1: gone, as if pruned right after a resume chose it
    import utils.run_folder

    monkeypatch.setattr(utils.run_folder, '_newest_checkpoint', lambda folder: pruned)  # in this process
    code = f'import sys, time; sys.path.insert(0, {REPO!r}); from utils.run_folder import FolderLock; '
    code += f'lock = FolderLock({folder!r}); print("held", flush=True); time.sleep(60)'
    holder = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'held'
        second = run_script('train.py', *args, '--resume')
        _one_error_line(second, 'is in use by process', str(holder.pid))
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_a_folder_on_a_file_system_without_locks_trains_with_a_note(tiny_shapes, tmp_path, monkeypatch):
    """On NFS mounted with nolock (lockf: ENOLCK) no run could start, told to free disk space."""
    import errno
    import fcntl

    def no_locks(*args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, 'lockf', no_locks)  # run_script runs train.py in this process
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--max_iteration', '2']
    trained = _ok(run_script('train.py', *args))
    assert 'cannot be locked (No locks available' in trained.stdout, trained.stdout
    resumed = _ok(run_script('train.py', *args, '--resume', '--max_iteration', '3'))
    assert 'resuming' in resumed.stdout and 'step 3' in resumed.stdout, resumed.stdout


def test_a_resume_started_while_a_new_run_makes_its_folder_finds_it_in_use(tiny_shapes, tmp_path, monkeypatch):
    """A new run took the folder's lock only after writing its options: a --resume arriving in that moment
    took the lock and removed the run's half-written args file; the run's failed start then removed the
    resume's lock file, and a third start trained in the same folder beside the second."""
    import utils.run_folder

    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--max_iteration', '2', '--resume']
    save_args, resumes = utils.run_folder.save_args, []

    def resume_meanwhile(options, folder):  # the same command again, while this one writes its options
        resumes.append(
            subprocess.run(
                [sys.executable, 'train.py', *args], cwd=REPO, capture_output=True, text=True, timeout=timeout(300)
            )
        )
        save_args(options, folder)

    monkeypatch.setattr(utils.run_folder, 'save_args', resume_meanwhile)
    first = run_script('train.py', *args)
    assert first.returncode == 0 and 'resuming' not in first.stdout, first.stderr
    (second,) = resumes
    _one_error_line(second, 'is in use by process', str(os.getpid()))
    assert sorted(name for name in os.listdir(_folder(args)) if name.startswith('epoch')) == [
        'epoch000_step0000002.pth'
    ]


def test_a_forked_child_of_a_dead_run_does_not_hold_its_folder(tmp_path):
    """DataLoader workers are forked from the run; when a SIGKILL ends the run first, they take a moment
    to notice, and a --resume in that moment must not be refused."""
    code = (
        f'import os, sys, time; sys.path.insert(0, {REPO!r}); from utils.run_folder import FolderLock; '
        f'lock = FolderLock({str(tmp_path)!r}); child = os.fork()\n'
        f'if child == 0: time.sleep(60); os._exit(0)\n'
        f'print(child, flush=True); os._exit(0)'
    )
    run = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True)
    child = int(run.stdout.readline())
    try:
        assert run.wait(timeout=timeout()) == 0 and _running(child)  # the run is gone, its child is not
        FolderLock(str(tmp_path)).release()
    finally:
        os.kill(child, signal.SIGKILL)
        run.stdout.close()


# full disks, read-only folders, interrupted start-ups -------------------------------------------------


def _file_size_limit(limit):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


# 0 bytes: the lock file's first write fails (it left the folder, which then blocked the same command)
@pytest.mark.parametrize('limit', [0, 100])
def test_a_full_disk_at_the_start_is_one_line_and_leaves_nothing(tiny_shapes, tmp_path, limit):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    result = subprocess.run(
        [sys.executable, 'train.py', *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(),
        preexec_fn=_file_size_limit(limit),
    )
    _one_error_line(result)
    assert f'{_folder(args)}{os.sep}' in result.stderr, result.stderr  # the file that could not be written
    assert not (tmp_path / 'ck').exists()  # no half-made folder blocks the same command later
    _ok(run_script('train.py', *args, '--epochs', '1'))


@contextlib.contextmanager
def _read_only_mount(folder):
    """`folder` as a small tmpfs that can be made read-only; skips where mounting is not allowed."""
    os.makedirs(folder)
    if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=64m', 'tmpfs', str(folder)], capture_output=True).returncode:
        pytest.skip('mounting a tmpfs is not allowed here')
    try:
        yield lambda: subprocess.run(['mount', '-o', 'remount,ro', str(folder)], check=True)
    finally:
        subprocess.run(['umount', '-l', str(folder)])


FAILING_PICTURES = """
import sys, time
sys.argv[0] = 'train.py'
import train
from utils.errors import run_to_exit
from utils.logger import Logger

def failing(*args):  # a picture that takes a moment, then finds the disk full
    time.sleep(0.5)
    raise OSError(28, 'No space left on device')

Logger._log_pictures = failing
run_to_exit(train.main)
"""


def test_a_write_that_fails_on_the_writer_thread_ends_the_run_with_one_line(tiny_shapes, tmp_path):
    """A picture that fails to be written cancels the checkpoint queued behind it; the next save, which
    waits for that checkpoint, ends the run with the picture's error rather than waiting for ever."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    extra = ['--max_iteration', '6', '--valid_interval', '2', '--save_interval', '1', '--image_interval', '0']
    result = _python(FAILING_PICTURES, *args, *extra)
    _one_error_line(result, 'No space left on device')


FOLDER_MOVED = """
import os, sys
sys.argv[0] = 'train.py'
import train
from utils.errors import run_to_exit


class MovedTrainer(train.Trainer):  # after its first save, the folder is renamed and another made at its path
    def save(self, metrics=None):
        super().save(metrics)
        if self.position.step == 2:
            self.logger.wait()
            folder = self.options.model_dir
            os.rename(folder, folder + '_moved')
            os.mkdir(folder)
            with open(os.path.join(folder, 'theirs.txt'), 'w') as f:
                f.write('another run')


run_to_exit(lambda argv: train.main(argv, trainer_type=MovedTrainer))
"""


def test_a_run_whose_folder_is_moved_writes_nothing_into_the_folder_now_at_its_path(tiny_shapes, tmp_path):
    """A run went on writing its checkpoints, last.pth, best.pth, checkpoints.json, history.json and
    metrics.csv by path, into whatever folder was there now: another run's, made at that path since."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    extra = ['--max_iteration', '6', '--valid_interval', '2', '--loggers', 'csv,tensorboard']
    result = _python(FOLDER_MOVED, *args, *extra)
    folder = tmp_path / 'ck' / 'small_cnn_list_default'
    _one_error_line(result, f'{folder} was moved or removed while this run wrote into it', '--resume')
    assert os.listdir(folder) == ['theirs.txt']  # the other run's folder: as it made it
    moved = tmp_path / 'ck' / 'small_cnn_list_default_moved'
    assert torch.load(moved / 'last.pth', weights_only=True, map_location='cpu')['position']['step'] == 2


def test_a_read_only_file_system_at_resume_is_one_line(tiny_shapes, tmp_path):
    with _read_only_mount(tmp_path / 'mnt') as make_read_only:
        args = tiny_run_args(tiny_shapes, tmp_path / 'mnt') + ['--epochs', '1']
        _ok(run_script('train.py', *args))
        before = _snapshot(_folder(args))
        make_read_only()
        _one_error_line(run_script('train.py', *args, '--resume', '--epochs', '2'), 'Read-only')
        assert _snapshot(_folder(args)) == before


# at moments while torch and numpy load (a Ctrl-C inside numpy's C initialization once surfaced as an ImportError)
@pytest.mark.parametrize('after', [0.25, 0.5, 1.0])
def test_ctrl_c_during_start_up_is_one_line(tiny_shapes, tmp_path, after):
    # as from a terminal: a shell's background jobs inherit an ignored SIGINT, which Python keeps
    process = subprocess.Popen(
        [sys.executable, 'train.py', *tiny_run_args(tiny_shapes, tmp_path / 'ck')],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(after)  # still importing torch
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=timeout(60))
    assert process.returncode == 130 and stderr.strip() == 'interrupted', stderr


SIGNAL_WHILE_BUILDING = """
import os, signal, sys, time
signum = getattr(signal, sys.argv.pop(1))
sys.argv[0] = 'train.py'
import train
from utils.errors import run_to_exit

def build(*args, **kwargs):  # the folder is made; a `kill` arrives while the data loads
    os.kill(os.getpid(), signum)
    time.sleep(30)

train.Trainer.build = build
run_to_exit(train.main)
"""

TERMINATED = 'terminated (SIGTERM)'


def _stopped_with(result_or_stderr, code, line, returncode=None):
    """Exit code `code`, and `line` as the one line on stderr (no traceback, no other line)."""
    stderr = getattr(result_or_stderr, 'stderr', result_or_stderr)
    returncode = getattr(result_or_stderr, 'returncode', returncode)
    lines = [text for text in stderr.splitlines() if text.strip()]
    assert returncode == code and 'Traceback' not in stderr, f'exit {returncode}\n{stderr}'
    assert lines[-1:] == [line], stderr


@pytest.mark.parametrize('name', ['SIGTERM', 'SIGUSR1'])
def test_stop_signal_during_start_up_is_one_line_and_leaves_no_folder(tiny_shapes, tmp_path, name):
    """SIGTERM's default action ended the process before the new folder was removed: the same command
    was then refused ('already exists'). Then it ended with no word at all. SIGUSR1 (SLURM's warning
    before a time limit, to `srun python train.py`) still did both."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    result = subprocess.run(
        [sys.executable, '-c', SIGNAL_WHILE_BUILDING, name, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(60),
    )
    _stopped_with(result, 128 + getattr(signal, name), f'terminated ({name})')
    assert result.stderr.strip() == f'terminated ({name})'
    assert not (tmp_path / 'ck').exists()


@pytest.fixture(scope='module')
def two_checkpoints(tiny_shapes, tmp_path_factory):
    """Two checkpoints of a 2-step run (saved at each step, both kept), for eval.py and predict.py."""
    checkpoints = tmp_path_factory.mktemp('two') / 'ck'
    args = tiny_run_args(tiny_shapes, checkpoints)
    args += ['--max_iteration', '2', '--save_interval', '1', '--keep_last', '2']
    _ok(run_script('train.py', *args))
    folder = _folder(args)
    return sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.startswith('epoch'))


@pytest.mark.parametrize('script', ['train.py', 'eval.py', 'predict.py'])
def test_sigterm_while_modules_load_is_one_line(two_checkpoints, tiny_shapes, tmp_path, script):
    """It ended with exit code 143 and nothing said (a Ctrl-C at the same moment says `interrupted`)."""
    args = {
        'train.py': tiny_run_args(tiny_shapes, tmp_path / 'ck'),
        'eval.py': ['--load_model_path', two_checkpoints[0], '--cpu'],
        'predict.py': ['--load_model_path', two_checkpoints[0], '--input', tiny_shapes, '--cpu'],
    }[script]
    process = subprocess.Popen(
        [sys.executable, script, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(0.5)  # still importing torch
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=timeout(60))
    _stopped_with(stderr, 128 + signal.SIGTERM, TERMINATED, process.returncode)
    assert stderr.strip() == TERMINATED


SIGTERM_AT = """
import os, signal, sys, time
script, target, calls = sys.argv[1], sys.argv[2].split('.'), int(sys.argv[3])
sys.argv = [script, *sys.argv[4:]]
module = __import__(script[:-3])
from utils.errors import run_to_exit

owner = module
for name in target[:-1]:
    owner = getattr(owner, name)
original, seen = getattr(owner, target[-1]), []

def patched(*args, **kwargs):  # the first `calls` calls run; the next one is where a `kill` arrives
    seen.append(1)
    if len(seen) <= calls:
        return original(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)

setattr(owner, target[-1], patched)
run_to_exit(module.main)
"""


@pytest.mark.parametrize(
    'script, target, calls',
    [
        ('eval.py', 'Evaluator.eval', 0),  # evaluating
        ('eval.py', 'Evaluator.write_results', 0),  # writing its files
        ('eval.py', 'evaluate_checkpoint', 1),  # the second checkpoint of a comparison
        ('eval.py', 'write_comparison', 0),  # the comparison's files
        ('predict.py', 'predict', 0),  # predicting and writing
    ],
)
def test_sigterm_to_eval_and_predict_is_one_line_and_leaves_no_folder(
    two_checkpoints, tiny_shapes, script, target, calls
):
    """eval.py and predict.py ended on a SIGTERM with exit code 143 and no word at all (a Ctrl-C said
    `interrupted`); the result folders they had made were removed, as they still must be."""
    folder = os.path.dirname(two_checkpoints[0])
    before = sorted(os.listdir(folder))
    checkpoints = two_checkpoints if target in ('evaluate_checkpoint', 'write_comparison') else two_checkpoints[:1]
    args = ['--load_model_path', *checkpoints, '--cpu', '--no-progress_bar']
    if script == 'predict.py':
        args += ['--input', os.path.join(tiny_shapes, 'val.txt')]
    result = _python(SIGTERM_AT, script, target, calls, *args, seconds=60)
    _stopped_with(result, 128 + signal.SIGTERM, TERMINATED)
    assert result.stderr.strip() == TERMINATED
    assert sorted(os.listdir(folder)) == before  # no eval/, predict/ or comparisons/ left


SECOND_SIGNAL_AT = """
import os, sys, time
sys.argv[0] = 'train.py'
import train
from utils.errors import run_to_exit

where = sys.argv.pop(1)
original = getattr(train.Trainer, where)

def slow(self, *args, **kwargs):  # a save, or the last files, that take a while after the first signal
    if self.stopper.signals.received:
        print('slow', flush=True)
        time.sleep(30)
    return original(self, *args, **kwargs)

setattr(train.Trainer, where, slow)
run_to_exit(train.main)
"""

SECOND_SIGTERM = 'stopped at once on a second SIGTERM; the newest checkpoint is whole: continue with --resume'


@pytest.mark.parametrize(
    'where, second, code, line',
    [
        ('save', signal.SIGTERM, 128 + signal.SIGTERM, SECOND_SIGTERM),  # the save for the stop, in the loop
        ('report', signal.SIGTERM, 128 + signal.SIGTERM, SECOND_SIGTERM),  # after the loop gave signals back
        ('save', signal.SIGINT, 130, 'interrupted'),  # a Ctrl-C after the SIGTERM
    ],
)
def test_a_second_sigterm_stops_at_once_with_143_and_says_so(tiny_shapes, tmp_path, where, second, code, line):
    """A second SIGTERM said `interrupted` and exited 130, the code of a Ctrl-C: job scripts and SLURM
    read 143 as a SIGTERM stop. A Ctrl-C stays `interrupted`, 130."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--epochs', '500', '--save_interval', '2']
    # from memory, so the first signal always comes between steps and the stop saves in the loop: from
    # disk it can come while the loop waits for a batch, and a step saved already is not saved again
    args[args.index('--data_type') + 1] = 'mem_list'
    folder = os.path.join(tmp_path, 'ck', EXPERIMENT.replace('_list_', '_mem_list_'))
    process = subprocess.Popen(
        [sys.executable, '-c', SECOND_SIGNAL_AT, where, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    try:
        _wait_for(lambda: os.path.exists(os.path.join(folder, 'last.pth')), process, seconds=120)
        process.send_signal(signal.SIGTERM)
        while process.stdout.readline().strip() != 'slow':  # the first one was taken up: the stop is under way
            assert process.poll() is None, process.communicate()
        process.send_signal(second)
        _, stderr = process.communicate(timeout=timeout(60))
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    _stopped_with(stderr, code, line, process.returncode)
    assert stderr.strip().splitlines()[0].startswith('SIGTERM received: finishing the current step and saving')
    assert len(stderr.strip().splitlines()) == 2, stderr
    _load(os.path.join(folder, 'last.pth'))  # whole: the save cut short, if any, is left out


SECOND_SIGNAL_BEFORE_SAVING = """
import os, signal, sys
sys.argv[0] = 'train.py'
import train
from utils.errors import run_to_exit

step, save = train.Trainer.train_step, train.Trainer.save

def first(self, *args, **kwargs):  # a SIGUSR1 in the first step
    if not self.stopper.signals.received:
        os.kill(os.getpid(), signal.SIGUSR1)
    return step(self, *args, **kwargs)

def second(self, *args, **kwargs):  # and another as the save it asks for begins
    os.kill(os.getpid(), signal.SIGUSR1)
    return save(self, *args, **kwargs)

train.Trainer.train_step, train.Trainer.save = first, second
run_to_exit(train.main)
"""


def test_a_second_signal_before_the_first_checkpoint_says_nothing_was_saved(tiny_shapes, tmp_path):
    """It said 'the newest checkpoint is whole: continue with --resume' where there was none, and the
    run's folder had been removed."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    result = _python(SECOND_SIGNAL_BEFORE_SAVING, *args, seconds=60)
    line = 'stopped at once on a second SIGUSR1, before the first checkpoint: nothing was saved'
    _stopped_with(result, 128 + signal.SIGUSR1, line)
    assert result.stderr.strip().splitlines()[0].startswith('SIGUSR1 received: finishing the current step and saving')
    assert not (tmp_path / 'ck').exists()


LAUNCHER_WITH_THREADS = """
import os, signal, subprocess, sys, threading, time
for _ in range(8):  # a launcher's threads: Linux sends the parent-death signal again as each one ends
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
worker = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])
print(worker.pid, flush=True)
time.sleep(600)
"""

COUNTING_WORKER = """
import os, signal, sys, time
sys.path.insert(0, os.getcwd())
from utils.distributed import LAUNCHER_GONE, _stop_with_launcher
heard = []
signal.signal(signal.SIGTERM, lambda signum, frame: heard.append(signum))
signal.signal(signal.SIGUSR2, lambda signum, frame: heard.append(signum))  # submitit's time-limit signal
launcher = os.getppid()
_stop_with_launcher(launcher)
os.kill(os.getpid(), LAUNCHER_GONE)  # while the launcher lives: not its death, nothing to take
os.kill(os.getpid(), signal.SIGUSR2)  # still the handler's it was: submitit saves and requeues on it
time.sleep(0.1)
assert heard == [signal.SIGUSR2], heard
heard.clear()
open(sys.argv[1] + '.ready', 'w').close()
deadline = time.time() + 60
while os.getppid() == launcher and time.time() < deadline:
    time.sleep(0.05)
time.sleep(1)  # every signal of the launcher's end has come by now
with open(sys.argv[1], 'w') as f:
    f.write(str(len(heard)))
"""


def test_a_killed_launcher_is_one_sigterm_to_its_workers(tmp_path):
    """Linux sent a worker the parent-death signal (SIGTERM) once per thread of the dying launcher; the
    second meant 'stop at once', and the worker stopped without saving."""
    heard = tmp_path / 'heard'
    launcher = subprocess.Popen(
        [sys.executable, '-c', LAUNCHER_WITH_THREADS, COUNTING_WORKER, str(heard)], cwd=REPO, stdout=subprocess.PIPE
    )
    _wait_for(lambda: os.path.exists(f'{heard}.ready'), launcher, seconds=60)
    launcher.kill()
    launcher.wait()
    _wait_for(lambda: os.path.exists(heard), seconds=60)
    assert heard.read_text() == '1'


def test_ctrl_c_to_utils_torchrun_while_it_starts_is_one_line(tiny_shapes, tmp_path):
    """A Ctrl-C while torch loaded in the launcher, or while its rendezvous waited, was a traceback."""
    process = subprocess.Popen(
        [*TORCHRUN, 'train.py', *tiny_run_args(tiny_shapes, tmp_path / 'ck')],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(0.5)  # still importing torch
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=timeout(60))
    assert process.returncode == 130 and stderr.strip() == 'interrupted', stderr


def test_checks_before_training(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    _one_error_line(run_script('train.py', *args, '--monitor', 'val/nope'), '--monitor val/nope', 'val/acc')
    _one_error_line(run_script('train.py', *args, '--img_size', '1'), '--img_size')
    _one_error_line(run_script('train.py', *args, '--lr', 'inf'), '--lr')
    assert not (tmp_path / 'ck').exists()


def test_a_nonfinite_loss_before_any_save_names_no_missing_file(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    line = _one_error_line(
        run_script('train.py', *args, '--optimizer', 'sgd', '--lr', '1e30', '--print_freq', '1'),
        'non-finite loss at step',
    )
    assert 'nothing was saved' in line and 'last.pth' not in line


def test_a_refused_prediction_leaves_no_folder(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--epochs', '1']
    _ok(run_script('train.py', *args))
    result = run_script(
        'predict.py', '--load_model_path', _folder(args), '--input', str(tmp_path / 'nothing'), '--cpu'
    )  # an experiment folder means its best.pth, as in eval.py and train.py
    _one_error_line(result, 'nothing')
    assert not os.path.exists(os.path.join(_folder(args), 'predict'))
    # the run's folder, or the folder of runs, given as the images: its own pictures were predicted
    for runs in (_folder(args), tmp_path / 'ck'):
        result = run_script('predict.py', '--load_model_path', _folder(args), '--input', runs, '--cpu')
        _one_error_line(result, f'--input {runs} holds Kiln runs or results, not only images')
    assert not os.path.exists(os.path.join(_folder(args), 'predict'))


def test_validating_on_the_training_list_is_said(tiny_shapes, tmp_path):
    """The same list as --train_list and --val_list trained without a word, val/* measuring training data."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--max_iteration', '1']
    args[args.index('--val_list') + 1] = args[args.index('--train_list') + 1]
    result = _ok(run_script('train.py', *args))
    assert 'note: --val_list is the --train_list: val/* measure the data the run trains on' in result.stdout


# processes that lose their parent --------------------------------------------------------------------


def _children(pid):
    return [
        int(p)
        for p in subprocess.run(['ps', '-o', 'pid=', '--ppid', str(pid)], capture_output=True, text=True).stdout.split()
    ]


def _running(pid):
    """Whether process `pid` exists and is not a zombie waiting to be reaped."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


def test_dataloader_workers_exit_when_the_main_process_is_killed(tiny_shapes, tmp_path):
    args = [a for a in tiny_run_args(tiny_shapes, tmp_path / 'ck') if a != '0'] + ['--epochs', '500']
    args[args.index('--num_workers') + 1 : args.index('--num_workers') + 1] = ['2']
    process = _start(args)
    _wait_for(lambda: len(_children(process.pid)) >= 2, process)
    workers = _children(process.pid)
    process.kill()
    process.wait()
    # within a second: PR_SET_PDEATHSIG makes it immediate; under 5 s, when the DataLoader's own check
    # (MP_STATUS_CHECK_INTERVAL) would end them without it
    deadline = time.time() + min(timeout(1.5), 4)
    while time.time() < deadline and any(_running(pid) for pid in workers):
        time.sleep(0.05)
    assert not any(_running(pid) for pid in workers)


TORCHRUN = [sys.executable, '-m', 'utils.torchrun', '--standalone', '--nproc-per-node=2']
LINEAR = ['--model_type', 'linear', '--optimizer', 'sgd', '--lr', '0.05', '--batch_size', '8']


def _torchrun(args, *extra):
    return subprocess.Popen(
        [*TORCHRUN, 'train.py', *args, *LINEAR, *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, 'OMP_NUM_THREADS': '1'},
        start_new_session=True,
    )


def test_sigterm_to_torchrun_is_agreed_within_a_step_and_ends_with_143(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    launcher = _torchrun(args, '--epochs', '500', '--print_freq', '100000', '--save_interval', '30')
    folder = os.path.join(tmp_path / 'ck', 'linear_list_default')
    _wait_for(lambda: os.path.exists(os.path.join(folder, 'last.pth')), launcher)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=timeout(120))
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert 'Traceback' not in stderr
    assert stderr.strip().splitlines()[-1] == 'torchrun: stopped by SIGTERM'
    # saved for the signal, at the step the workers agreed on and said (rank 0 does)
    assert _stopped_at('SIGTERM', stdout) == _load(os.path.join(folder, 'last.pth'))['position']['step']


def _stopped_at(signame, stdout):
    """The step of the `stopped by <signame> after ...s at step N` line(s) in `stdout`: the same in each."""
    steps = {int(step) for step in re.findall(rf'stopped by {signame} after \d+s at step (\d+)', stdout)}
    assert len(steps) == 1, stdout
    return steps.pop()


# a launcher that dies while its worker starts: the worker then joins a group whose rank 0 never comes
ORPHANED_LAUNCHER = """
import os, socket, subprocess, sys
with socket.socket() as free:
    free.bind(('127.0.0.1', 0))
    port = free.getsockname()[1]
worker = (
    "import time; time.sleep(1)\\n"  # the launcher is gone by then
    "from utils.distributed import init_distributed\\n"
    "init_distributed(cpu=True)\\n"
    "print('joined')\\n"
)
env = {**os.environ, 'KILN_LAUNCHER_PID': str(os.getpid()), 'WORLD_SIZE': '2', 'RANK': '1', 'LOCAL_RANK': '1',
       'LOCAL_WORLD_SIZE': '2', 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(port)}
quiet = {'stdout': subprocess.DEVNULL, 'stderr': subprocess.DEVNULL}  # not the pipes this launcher's reader waits on
print(subprocess.Popen([sys.executable, '-c', worker], env=env, start_new_session=True, **quiet).pid, flush=True)
os._exit(0)
"""


def test_a_worker_whose_launcher_died_while_it_started_exits(tmp_path):
    """torchrun SIGKILLed while its workers imported: they waited in the rendezvous for a rank 0 that never
    came (10 minutes; SIGTERM did not reach them there), orphans with nothing to save."""
    launched = subprocess.run(
        [sys.executable, '-c', ORPHANED_LAUNCHER],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, 'PYTHONPATH': REPO},
        timeout=timeout(60),
    )
    worker = int(launched.stdout)
    try:
        _wait_for(lambda: not _running(worker), seconds=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


def test_workers_stop_and_save_when_torchrun_is_killed(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    launcher = _torchrun(args, '--epochs', '500', '--save_interval', '30')
    folder = os.path.join(tmp_path / 'ck', 'linear_list_default')
    _wait_for(lambda: os.path.exists(os.path.join(folder, 'last.pth')), launcher)
    workers = _children(launcher.pid)
    launcher.kill()  # SIGKILL: torchrun cannot pass anything on
    launcher.wait()
    _wait_for(lambda: not any(_running(pid) for pid in workers), seconds=60)
    stdout, _ = launcher.communicate(timeout=timeout(60))  # the workers wrote into torchrun's pipes
    # they saved when they noticed (as for a SIGTERM), and ended: no orphans training on
    assert _stopped_at('SIGTERM', stdout) == _load(os.path.join(folder, 'last.pth'))['position']['step']


def test_last_pth_replaced_while_it_is_checked_is_not_called_corrupt(tmp_path, monkeypatch):
    """eval.py checks last.pth against the record while a run saves beside it: a save between finding which
    checkpoint last.pth is and reading its bytes made a whole checkpoint 'corrupt' (1 in 850 checks)."""
    import utils.checkpoint_keeper as keeping
    from utils.checkpoint_keeper import CheckpointKeeper, verify
    from utils.errors import KilnError

    keeper = CheckpointKeeper(str(tmp_path), keep_last=1)
    keeper.save({'weights': torch.zeros(3)}, 0, 1)
    checksum, saves = keeping.checksum, []

    def saved_meanwhile(path):  # the run saves (last.pth to step 2, step 1 pruned) just before the read
        if not saves:
            saves.append(keeper.save({'weights': torch.ones(3)}, 0, 2))
        return checksum(path)

    monkeypatch.setattr(keeping, 'checksum', saved_meanwhile)
    verify(str(tmp_path / 'last.pth'))
    last = torch.load(tmp_path / 'last.pth', weights_only=True, map_location='cpu')
    assert saves and torch.equal(last['weights'], torch.ones(3))
    with open(tmp_path / 'last.pth', 'r+b') as f:  # a checkpoint really damaged is still said to be
        f.seek(-8, os.SEEK_END)
        f.write(b'\0' * 8)
    with pytest.raises(KilnError, match='last.pth is corrupt'):
        verify(str(tmp_path / 'last.pth'))


def test_a_new_run_that_fails_before_its_first_checkpoint_takes_its_w_b_files_with_it(tmp_path):
    """W&B's wandb/ (made as the trackers open) stayed in the folder of a run stopped while it started: the
    same command was then refused ('already exists ... add --resume'), with no run to continue."""
    from utils.run_folder import discard_folder_if_setup_fails

    folder = tmp_path / 'ck' / 'run'
    (folder / 'wandb' / 'offline-run-1').mkdir(parents=True)
    (folder / 'wandb' / 'offline-run-1' / 'run-1.wandb').write_bytes(b':W&B')
    (folder / 'args.yaml').write_text('lr: 0.1\n')
    with pytest.raises(RuntimeError), discard_folder_if_setup_fails(str(folder), [str(tmp_path / 'ck')]):
        raise RuntimeError('stopped while starting')
    assert not (tmp_path / 'ck').exists()
    mine = tmp_path / 'mine'  # a folder of the user's, linked as wandb: neither followed nor removed
    mine.mkdir()
    (mine / 'keep.txt').write_text('keep')
    folder.mkdir(parents=True)
    (folder / 'wandb').symlink_to(mine)
    with pytest.raises(RuntimeError), discard_folder_if_setup_fails(str(folder)):
        raise RuntimeError('stopped while starting')
    assert (mine / 'keep.txt').read_text() == 'keep' and os.listdir(folder) == ['wandb']
