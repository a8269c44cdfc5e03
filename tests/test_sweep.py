"""sweep.py: grid and random sweeps of real train.py runs on tiny data; finished runs skipped, interrupted
ones resumed, failures reported, mistakes refused before any run, SLURM job arrays, the comparison table."""

import argparse
import csv
import json
import os
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from conftest import run_script, timeout, tiny_run_args
from options import experiment_folder, parse_args, parse_train_args, resolve
from utils.errors import KilnError

# one epoch, a checkpoint every 2 steps and the newest 2 kept, so a run can be cut back to an earlier one;
# the model named, so that the sweep finds the folders without loading torch for the task's default
FAST = ['--model_type', 'linear', '--epochs', '1', '--save_interval', '2', '--keep_last', '2', '--no-log_images']
GRID = ['--grid', 'lr=1e-3,3e-3', 'batch_size=16,32']
RUNS = {
    'sweep_lr0.001_bs16': (0.001, 16),
    'sweep_lr0.001_bs32': (0.001, 32),
    'sweep_lr0.003_bs16': (0.003, 16),
    'sweep_lr0.003_bs32': (0.003, 32),
}


def _sweep(*args, code=0, env=None):
    result = run_script('sweep.py', *args, env=env)
    assert result.returncode == code, result.stdout + result.stderr
    assert 'Traceback' not in result.stderr
    return result


def _json(path):
    with open(path) as f:
        return json.load(f)


def _folder(checkpoints, prefix):
    return os.path.join(checkpoints, f'linear_list_{prefix}')


def _last_step(folder):
    record = _json(os.path.join(folder, 'checkpoints.json'))
    return record['files'][record['last']]['step']


def _starts(folder):
    """How many times train.py started (or resumed) in `folder`: one reproduce.json entry each."""
    return len(_json(os.path.join(folder, 'reproduce.json')))


def _fake_sbatch(tmp_path, answer='echo 4242'):
    """The environment of a sweep whose `sbatch` records its arguments and answers like `sbatch --parsable`;
    and a stand-in python in the same folder, printing its arguments, for the job script's tasks."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir(exist_ok=True)
    for name, text in (
        ('sbatch', f'printf "%s\\n" "$@" > "$SBATCH_ARGS"\n{answer}'),
        ('echo_python', 'printf "%s\\n" "$@"'),
    ):
        (bin_dir / name).write_text(f'#!/bin/sh\n{text}\n')
        (bin_dir / name).chmod(0o755)
    return {'PATH': f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', 'SBATCH_ARGS': str(tmp_path / 'sbatch_args')}


def _task(script, task_id, tmp_path, job_id='4242'):
    """Array task `task_id` of the job `script`, its python the stand-in of _fake_sbatch."""
    return subprocess.run(
        ['bash', str(script)],
        capture_output=True,
        text=True,
        timeout=timeout(60),
        env={
            **os.environ,
            'SLURM_ARRAY_JOB_ID': job_id,
            'SLURM_ARRAY_TASK_ID': str(task_id),
            'PYTHON': str(tmp_path / 'bin' / 'echo_python'),
        },
    )


@pytest.fixture(scope='module')
def grid(tiny_shapes, tmp_path_factory):
    """A 2x2 grid sweep, run once for the tests below: (checkpoints dir, train options, its output)."""
    checkpoints = str(tmp_path_factory.mktemp('sweep') / 'ck')
    train = [*tiny_run_args(tiny_shapes, checkpoints), *FAST]
    return checkpoints, train, _sweep(*GRID, '--', *train).stdout


def test_grid_runs_every_combination_and_compares_them(grid):
    checkpoints, _, output = grid
    for prefix, (lr, batch_size) in RUNS.items():
        folder = _folder(checkpoints, prefix)
        with open(os.path.join(folder, 'args.yaml')) as f:
            args = yaml.safe_load(f)
        assert (args['lr'], args['batch_size'], args['save_prefix'], args['epochs']) == (lr, batch_size, prefix, 1)
        planned = _json(os.path.join(folder, 'run_config.json'))['max_num_train_steps']
        assert _last_step(folder) == planned == 96 // batch_size
    table = os.path.join(checkpoints, 'comparisons', 'val_sweep')
    with open(os.path.join(table, 'comparison.csv')) as f:
        rows = list(csv.reader(f))
    assert rows[0][:2] == ['checkpoint', 'loss'] and len(rows) == 1 + len(RUNS)
    assert sorted(row[0] for row in rows[1:]) == sorted(os.path.join(_folder(checkpoints, p), 'best.pth') for p in RUNS)
    assert f'comparison: {table}/comparison.txt' in output


def test_rerun_skips_finished_runs(grid):
    checkpoints, train, _ = grid
    starts = {prefix: _starts(_folder(checkpoints, prefix)) for prefix in RUNS}
    # a run the sweep has no record of (e.g. trained by the SLURM array) is judged by its folder alone
    record = os.path.join(checkpoints, 'sweeps', 'sweep', 'finished.json')
    done = _json(record)
    del done['sweep_lr0.001_bs32']
    with open(record, 'w') as f:
        json.dump(done, f)
    # a run that stopped before its planned steps (early stopping) counts as finished when train.py said so
    plan = os.path.join(_folder(checkpoints, 'sweep_lr0.003_bs32'), 'run_config.json')
    with open(plan) as f:
        original = f.read()
    with open(plan, 'w') as f:
        json.dump({**json.loads(original), 'max_num_train_steps': 100}, f)
    try:
        output = _sweep(*GRID, '--', *train).stdout
    finally:
        with open(plan, 'w') as f:
            f.write(original)
    assert output.count('), skipped') == len(RUNS) and 'train.py --' not in output, output
    assert '[2/4] sweep_lr0.001_bs32: finished (step 3/3), skipped' in output
    assert '[4/4] sweep_lr0.003_bs32: finished (train.py ended at step 3), skipped' in output
    assert {prefix: _starts(_folder(checkpoints, prefix)) for prefix in RUNS} == starts  # no train.py started
    assert f'comparison: {checkpoints}/comparisons/val_sweep/comparison.txt' in output  # nothing new to compare
    # asked to go longer (--epochs 2), a finished run is not finished any more: the sweep resumes it
    import sweep

    # nor is one trained with other options than the sweep now asks for (it was skipped, its old
    # results compared as if new): train.py --resume then refuses, naming the changed option
    for epochs, other, expected in (('1', [], 'step 3/3'), ('2', [], None), ('1', ['--optimizer', 'sgd'], None)):
        argv = [
            *train,
            '--lr',
            '1e-3',
            '--batch_size',
            '32',
            '--epochs',
            epochs,
            *other,
            '--save_prefix',
            'sweep_lr0.001_bs32',
        ]
        run = argparse.Namespace(
            prefix='sweep_lr0.001_bs32',
            argv=argv,
            options=parse_args(parse_train_args, argv),
            folder=_folder(checkpoints, 'sweep_lr0.001_bs32'),
        )
        assert sweep.finished(run, {}) == expected


@pytest.mark.parametrize('slurm', [[], ['--slurm']])
def test_a_rerun_with_other_fixed_options_is_refused_in_one_line_naming_a_new_name(grid, tmp_path, slurm):
    """After a change after --, every run failed: train.py refused each resume and advised --save_prefix,
    which the sweep sets itself; --slurm submitted such a sweep, and every array task failed so."""
    checkpoints, train, _ = grid
    starts = {prefix: _starts(_folder(checkpoints, prefix)) for prefix in RUNS}
    env = _fake_sbatch(tmp_path)
    result = _sweep(*GRID, *slurm, '--', *train, '--weight_decay', '0.1', code=2, env=env)
    assert result.stderr.count('\n') == 1 and result.stderr.startswith('error: --weight_decay 0.1 (it has 0.0005)')
    assert 'give this sweep its own --name' in result.stderr and 'train.py --' not in result.stdout
    assert {prefix: _starts(_folder(checkpoints, prefix)) for prefix in RUNS} == starts
    assert not os.path.exists(env['SBATCH_ARGS']) and 'sweep.sbatch' not in os.listdir(f'{checkpoints}/sweeps/sweep')


def test_failed_run_is_reported_and_the_others_resume_and_run(grid):
    checkpoints, train, _ = grid
    interrupted = _folder(checkpoints, 'sweep_lr0.001_bs16')
    # as if killed after the save at step 4 (best.pth too: a link to step 6's bytes would be resumed from)
    for name in ('epoch001_step0000006.pth', 'last.pth', 'best.pth'):
        os.remove(os.path.join(interrupted, name))
    # lr 1e30 makes the loss non-finite at step 2: train.py stops with exit code 2; it runs first, the other after it
    result = _sweep('--grid', 'lr=1e30,1e-3', 'batch_size=16', '--', *train, code=1)
    assert 'failed: sweep_lr1e30_bs16: exit code 2: error: non-finite' in result.stdout
    assert f'resuming {interrupted}/epoch000_step0000004.pth' in result.stdout
    assert _last_step(interrupted) == 6 and _starts(interrupted) == 2
    assert result.stdout.index('[1/2] sweep_lr1e30_bs16') < result.stdout.index('[2/2] sweep_lr0.001_bs16')


@pytest.mark.parametrize(
    'grid_args, message',
    [
        (['lrr=1e-3,3e-3'], "'lrr' is not a train.py option; did you mean lr?"),
        (['lr=1e-3,-1'], 'argument --lr: must be a positive number, got -1'),
        (['lr=1e-3', 'optimizer=sgd,adamx'], "argument --optimizer: invalid choice: 'adamx'"),
        (['save_prefix=a,b'], '--save_prefix cannot be swept'),
        (['lr=1e-4:1e-2'], 'lr is a range: ranges need --sampler random'),
        (['deterministic=true,maybe'], '--deterministic is a switch'),
    ],
)
def test_mistakes_are_refused_in_one_line_before_any_run(tiny_shapes, tmp_path, grid_args, message):
    checkpoints = tmp_path / 'ck'
    result = _sweep('--grid', *grid_args, '--', *tiny_run_args(tiny_shapes, checkpoints), code=2)
    assert result.stderr.startswith('error: ') and result.stderr.count('\n') == 1 and message in result.stderr
    assert result.stdout == '' and not checkpoints.exists()


def _trials(output):
    """{save prefix: {option: value}} from a dry run's printed train.py commands (the last flag wins)."""
    trials = {}
    for line in output.splitlines():
        if line.startswith('$ '):
            words = shlex.split(line[2:])
            options = dict(zip(words[2::2], words[3::2]))
            trials[options['--save_prefix']] = options
    return trials


def test_random_search_is_reproducible_and_stays_in_its_ranges(tiny_shapes, tmp_path):
    train = ['--', *tiny_run_args(tiny_shapes, tmp_path / 'ck')]
    ranges = ['--grid', 'lr=1e-4:1e-2', 'weight_decay=0:1e-3', 'batch_size=16,32', 'warmup_steps=0:5']
    first = _sweep('--sampler', 'random', '--trials', '6', '--seed', '3', *ranges, '--dry_run', *train).stdout
    assert first == _sweep('--sampler', 'random', '--trials', '6', '--seed', '3', *ranges, '--dry_run', *train).stdout
    config = tmp_path / 'sweep.yaml'
    config.write_text(
        'random: {lr: {log_uniform: [1e-4, 1e-2]}, weight_decay: {uniform: [0, 1e-3]}, '
        'batch_size: {choice: [16, 32]}, warmup_steps: {uniform: [0, 5]}}\ntrials: 6\nseed: 3\n'
    )
    assert _sweep('--config', str(config), '--dry_run', *train).stdout == first  # the same rules, spelled in YAML
    trials = _trials(first)
    assert len(trials) == 6 and not (tmp_path / 'ck').exists()
    for prefix, options in trials.items():
        lr, decay, warmup = float(options['--lr']), float(options['--weight_decay']), options['--warmup_steps']
        assert 1e-4 <= lr <= 1e-2 and 0 <= decay <= 1e-3 and options['--batch_size'] in ('16', '32')
        assert warmup.isdigit() and 0 <= int(warmup) <= 5
        assert prefix.startswith(f'sweep_lr{lr:g}_wd') and prefix.endswith(
            f'_bs{options["--batch_size"]}_warmup{warmup}'
        )
    other = _trials(_sweep('--sampler', 'random', '--trials', '6', '--seed', '4', *ranges, '--dry_run', *train).stdout)
    assert other.keys() != trials.keys()


def test_slurm_writes_a_job_array_and_submits_it(tiny_shapes, tmp_path):
    checkpoints, env = tmp_path / 'ck', _fake_sbatch(tmp_path)
    config = tmp_path / 'grid.yaml'
    config.write_text('grid: {lr: [1e-3, 3e-3], batch_size: [16, 32]}\n')
    train = tiny_run_args(tiny_shapes, checkpoints)
    result = _sweep('--config', str(config), '--slurm', '--sbatch=--time=1:00:00', '--', *train, env=env)
    script = checkpoints / 'sweeps' / 'sweep' / 'sweep.sbatch'
    assert 'submitted job array 4242' in result.stdout
    assert (tmp_path / 'sbatch_args').read_text().split() == ['--parsable', '--time=1:00:00', str(script)]
    text = script.read_text()
    assert '#SBATCH --array=0-3\n' in text and '#SBATCH --requeue\n' in text
    assert sorted(os.listdir(checkpoints)) == ['sweeps']  # nothing ran here
    # array task 2 runs train.py with the third combination, resumable (a stand-in python prints its arguments)
    task = _task(script, 2, tmp_path)
    assert task.returncode == 0, task.stderr
    argv = task.stdout.splitlines()
    assert argv[0].endswith('train.py') and argv[1:] == [
        *train,
        '--lr',
        '3e-3',
        '--batch_size',
        '16',
        '--save_prefix',
        'sweep_lr0.003_bs16',
        '--resume',
    ]
    dry = _sweep('--config', str(config), '--slurm', '--dry_run', '--name', 'other', '--', *train, env=env)
    assert '#SBATCH --array=0-3' in dry.stdout and not (checkpoints / 'sweeps' / 'other').exists()
    # the time-limit signal goes to the batch shell (B:), which is train.py itself: with no job step, a
    # signal without B: reached no process (train.py never saved before the kill)
    assert '#SBATCH --signal=B:TERM@120\n' in text
    (tmp_path / 'bin' / 'echo_python').write_text('#!/bin/sh\necho $$\n')
    shell = subprocess.Popen(
        ['bash', str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, 'SLURM_ARRAY_TASK_ID': '0', 'PYTHON': str(tmp_path / 'bin' / 'echo_python')},
    )
    assert shell.communicate(timeout=timeout(60))[0].strip() == str(shell.pid)  # exec: the same process


def test_slurm_script_quotes_its_paths_as_sbatch_reads_them(tiny_shapes, tmp_path, monkeypatch):
    """#SBATCH --output and --chdir were written unquoted: sbatch splits an #SBATCH line at spaces (as a
    shell does, quotes kept together) and takes an unquoted # for a comment."""
    import shlex

    import sweep

    here = tmp_path / 'my project #2'
    here.mkdir()
    monkeypatch.chdir(here)
    checkpoints = tmp_path / "check points#1's"  # (a # after a space or not: sbatch reads a comment from there)
    train = tiny_run_args(tiny_shapes, checkpoints)
    path = os.environ['PATH']
    monkeypatch.setenv('PATH', str(tmp_path))  # no sbatch: the script is written, then the submission refused
    with pytest.raises(KilnError, match='^sbatch not found'):
        sweep.main(['--grid', 'lr=1e-3,3e-3', '--slurm', '--name', 'try', '--', *train])
    text = (checkpoints / 'sweeps' / 'try' / 'sweep.sbatch').read_text()
    lines = [line[len('#SBATCH') :] for line in text.splitlines() if line.startswith('#SBATCH -')]
    words = [shlex.split(line, comments=True) for line in lines]
    options = dict(word.split('=', 1) for (word,) in words if '=' in word)  # each line one word, whole
    assert options['--output'] == f'{checkpoints}/sweeps/try/slurm-%A_%a.out'
    assert options['--chdir'] == str(here) and options['--job-name'] == 'try'
    # the quoted path inside the error message's double quotes left a quote open: every task failed
    monkeypatch.setenv('PATH', path)
    missing = _task(checkpoints / 'sweeps' / 'try' / 'sweep.sbatch', 5, tmp_path)
    assert missing.returncode == 1 and f'no line 6 in {checkpoints}/sweeps/try/combinations.txt' in missing.stderr, (
        missing.stderr
    )


def test_random_ranges_are_log_uniform_over_a_decade_else_uniform():
    import sweep

    specs = sweep.load_specs(sweep.sweep_args(['--grid', 'lr=1e-4:1e-2', 'weight_decay=0:1e-3', 'epochs=1:3']))[0]
    trials = [dict(trial) for trial in sweep.combinations(specs, 'random', 2000, 0)]
    assert 0.45 < sum(float(t['lr']) < 1e-3 for t in trials) / len(trials) < 0.55  # uniform would give 0.09
    assert 0.45 < sum(float(t['weight_decay']) < 5e-4 for t in trials) / len(trials) < 0.55  # 0 to 1e-3: uniform
    assert {t['epochs'] for t in trials} == {'1', '2', '3'}  # integer bounds give integers


def test_folder_names_follow_the_task_defaults(tmp_path):
    options = parse_args(parse_train_args, ['--checkpoints_dir', str(tmp_path), '--save_prefix', 'sweep_lr0.1'])
    assert experiment_folder(resolve(options)) == os.path.join(tmp_path, 'small_cnn_shapes_sweep_lr0.1')
    options = parse_args(
        parse_train_args,
        ['--checkpoints_dir', str(tmp_path), '--save_prefix', 'x', '--task', 'segment', '--val_list', 'v.txt'],
    )
    assert experiment_folder(resolve(options)) == os.path.join(tmp_path, 'seg_net_seg_list_x')


def test_a_sweep_whose_runs_failed_to_start_runs_again_after_the_fix(tiny_shapes, tmp_path):
    """Every run of a sweep failed while it was built (--resume had made its folder and left it); the
    fixed sweep was then refused: it 'trained' those runs with other options."""
    train = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), *FAST, '--max_iteration', '2']
    grid = ['--name', 'fixed', '--grid', 'lr=1e-3']
    failed = _sweep(*grid, '--', *train, '--freeze_to', '10', code=1)
    assert 'failed: fixed_lr0.001: exit code 2: error: --freeze_to 10' in failed.stdout
    assert not (tmp_path / 'ck').exists()  # nothing trained, nothing left
    _sweep(*grid, '--', *train)  # without the mistake
    assert _last_step(_folder(tmp_path / 'ck', 'fixed_lr0.001')) == 2
    # a run's folder left with its options but no checkpoint (a kill while it was built) starts anew too
    left = _folder(tmp_path / 'ck', 'left_lr0.001')
    os.makedirs(left)
    shutil.copy(os.path.join(_folder(tmp_path / 'ck', 'fixed_lr0.001'), 'args.yaml'), left)
    _sweep('--name', 'left', '--grid', 'lr=1e-3', '--', *train, '--weight_decay', '0.1')
    assert _json(os.path.join(left, 'reproduce.json'))[0]['args']['weight_decay'] == 0.1


def test_a_second_submission_under_the_same_name_leaves_the_first_arrays_files(tiny_shapes, tmp_path):
    """Array tasks read combinations.txt as they start or requeue: a sweep submitted again under the same
    --name with other runs rewrote it, and the first array's tasks trained the second's runs, or train.py
    with no options at all (into the project's checkpoints/) where a line was missing."""
    env, train = _fake_sbatch(tmp_path), [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--model_type', 'linear']
    folder = tmp_path / 'ck' / 'sweeps' / 'sweep'
    _sweep(*GRID, '--slurm', '--', *train, env=env)
    files = {name: (folder / name).read_text() for name in ('combinations.txt', 'sweep.sbatch')}
    assert 'submitted job array 4242' in _sweep(*GRID, '--slurm', '--', *train, env=env).stdout  # the same again
    refused = _sweep('--grid', 'lr=1e-4', '--slurm', '--', *train, code=2, env=env)
    assert refused.stderr.count('\n') == 1 and 'give this sweep its own --name' in refused.stderr
    assert {name: (folder / name).read_text() for name in files} == files
    # a task whose line is gone says so and fails
    (folder / 'combinations.txt').write_text(files['combinations.txt'].splitlines()[0] + '\n')
    task = _task(folder / 'sweep.sbatch', 2, tmp_path)
    assert task.returncode == 1 and task.stdout == '' and f'error: no line 3 in {folder}' in task.stderr
    # an array sbatch did not take leaves no files behind, which would refuse the sweep corrected
    failing = _fake_sbatch(tmp_path, answer='echo "sbatch: error: invalid partition" >&2; exit 1')
    result = _sweep('--name', 'other', *GRID, '--slurm', '--', *train, code=2, env=failing)
    assert result.stderr == 'error: sbatch failed (exit code 1): sbatch: error: invalid partition\n'
    assert os.listdir(tmp_path / 'ck' / 'sweeps' / 'other') == []


def test_a_sweeps_files_are_never_replaced_and_the_refusal_says_what_uses_them(tiny_shapes, tmp_path):
    """--slurm where sbatch is missing keeps its files (to submit by hand); the same sweep with other runs
    was then refused as 'submitted before', though nothing had been. It is refused (an array submitted
    by hand reads those files), saying so; one sbatch took, or whose first task started, names its job."""
    env, train = _fake_sbatch(tmp_path), [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--model_type', 'linear']
    no_sbatch = {'PATH': str(tmp_path / 'empty')}  # no sbatch (nor anything else) on the PATH
    folder = tmp_path / 'ck' / 'sweeps' / 'sweep'
    missing = _sweep('--grid', 'lr=1e-3', '--slurm', '--', *train, code=2, env=no_sbatch)
    assert missing.stderr.startswith('error: sbatch not found') and (folder / 'sweep.sbatch').exists()
    assert not (folder / 'submitted.txt').exists()
    kept = {name: (folder / name).read_text() for name in ('combinations.txt', 'sweep.sbatch')}
    refused = _sweep('--grid', 'lr=1e-2', '--slurm', '--', *train, code=2, env=env)
    assert 'sweep sweep was written before (sbatch may not have taken it' in refused.stderr
    assert refused.stderr.count('\n') == 1 and 'submitted before' not in refused.stderr
    assert {name: (folder / name).read_text() for name in kept} == kept
    submitted = _sweep('--grid', 'lr=1e-3', '--slurm', '--', *train, env=env)  # the same sweep: submitted now
    assert 'submitted job array 4242' in submitted.stdout and (folder / 'submitted.txt').read_text() == '4242\n'
    refused = _sweep('--grid', 'lr=1e-2', '--slurm', '--', *train, code=2, env=env)
    assert 'sweep sweep was submitted before (job 4242)' in refused.stderr and refused.stderr.count('\n') == 1
    # an array submitted by hand records itself as its first task starts; later ones leave the record alone
    hand = tmp_path / 'ck' / 'sweeps' / 'hand'
    _sweep('--name', 'hand', '--grid', 'lr=1e-3', '--slurm', '--', *train, code=2, env=no_sbatch)
    for _ in range(2):
        assert _task(hand / 'sweep.sbatch', 0, tmp_path, job_id='77').returncode == 0
    assert (hand / 'submitted.txt').read_text() == '77\n'
    refused = _sweep('--name', 'hand', '--grid', 'lr=1e-2', '--slurm', '--', *train, code=2, env=env)
    assert 'sweep hand was submitted before (job 77)' in refused.stderr


def test_a_sweep_file_takes_an_unquoted_off_as_the_choice_off(tiny_shapes, tmp_path):
    """YAML reads `amp: [off, bf16]` as [false, bf16]: it gave --amp false, an invalid choice; then named the
    run amp-false, where --grid amp=off,bf16 names it amp-off (moved to a file, a sweep retrained its runs)."""
    train = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    config = tmp_path / 'sweep.yaml'
    config.write_text('grid: {amp: [off, bf16]}\n')
    printed = _sweep('--config', str(config), '--dry_run', '--', *train).stdout
    assert '--amp off --save_prefix sweep_amp-off ' in printed and '--amp bf16 --save_prefix' in printed, printed
    assert _sweep('--grid', 'amp=off,bf16', '--dry_run', '--', *train).stdout == printed


def test_options_of_two_values_are_swept(tiny_shapes, tmp_path):
    train = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    flags = _sweep('--grid', 'crop_scale=0.08 1,0.5 1', '--dry_run', '--', *train).stdout
    config = tmp_path / 'sweep.yaml'
    config.write_text('grid: {crop_scale: [[0.08, 1], [0.5, 1]]}\n')
    assert _sweep('--config', str(config), '--dry_run', '--', *train).stdout == flags
    assert '--crop_scale 0.08 1 --save_prefix sweep_crop_scale-0.08-1 --resume' in flags
    assert '--crop_scale 0.5 1 --save_prefix sweep_crop_scale-0.5-1 --resume' in flags


@pytest.mark.parametrize(
    'sweep_args, message',
    [
        (['--config', 'grid: {1: [2]}'], '1 is not a train.py option name'),
        (['--config', 'grid: {lr: [0.001]}\n# caf\xe9'], "cannot read it ('utf-8' codec can't decode byte 0xe9"),
        (['--config', 'grid: {null: [2]}'], 'None is not a train.py option name'),
        (['--config', 'random: {lr: [1]}\nseed: [1]'], 'seed: must be an integer, got [1]'),
        (['--config', 'random: {lr: [1]}\nseed: abc'], "seed: must be an integer, got the text 'abc'"),
        (['--config', 'random: {lr: [1]}\nseed: 1.5'], 'seed: must be an integer, got 1.5'),
        (['--config', 'random: {lr: [1]}\ntrials: true'], 'trials: must be a positive integer, got True'),
        (['--config', 'random: {lr: [1]}\ntrials: "8"'], "trials: must be a positive integer, got the text '8'"),
        (['--config', 'grid: {lr: [1]}\nname: null'], 'name: must be text of ASCII letters, digits'),
        (
            ['--grid', 'lr=1', '--name', ''],
            'and "-", got the text \'\'',
        ),
        (['--grid', 'lr=1e-3', 'lr=2e-3'], '--grid lr= is given twice: give its values once, lr=a,b'),
        (['--grid', 'lr=1e-3', '--epochs', '1'], '--epochs 1: train.py options go after `--`'),
    ],
)
def test_sweep_settings_of_the_wrong_kind_are_refused(tmp_path, sweep_args, message):
    """They gave tracebacks (a key not text, a seed not a number), or ran: a sweep named None."""
    import sweep

    if sweep_args[0] == '--config':
        (tmp_path / 'sweep.yaml').write_bytes(sweep_args[1].encode('latin-1'))  # (not UTF-8 where it has é)
        sweep_args = ['--config', str(tmp_path / 'sweep.yaml')]
    with pytest.raises(KilnError, match=re.escape(message)):
        sweep.load_specs(sweep.sweep_args(sweep_args))


def test_fast_dev_run_after_the_separator_is_refused(tiny_shapes, tmp_path):
    """Every run failed: train.py's --fast_dev_run refuses the --resume the sweep adds."""
    result = _sweep('--grid', 'lr=1e-3', '--', *tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--fast_dev_run', code=2)
    assert result.stderr.startswith('error: --fast_dev_run') and result.stderr.count('\n') == 1
    assert result.stdout == '' and not (tmp_path / 'ck').exists()


def test_a_run_whose_end_was_not_written_is_not_finished(tmp_path):
    """A run killed between its last checkpoint and its end records counted as finished: the sweep skipped
    it, and its history.json, final metrics and HParams row were never written (a resume writes them)."""
    from sweep import finished

    argv = ['--epochs', '1']
    run = argparse.Namespace(folder=str(tmp_path), prefix='a', argv=argv, options=parse_args(parse_train_args, argv))
    (tmp_path / 'epoch001_step0000005.pth').write_bytes(b'')
    (tmp_path / 'run_config.json').write_text(json.dumps({'max_num_train_steps': 5}))
    (tmp_path / 'args.yaml').write_text(yaml.safe_dump({k: v for k, v in vars(run.options).items()}))
    entry = {'epoch001_step0000005.pth': {'step': 5, 'sha256': '0' * 64, 'metric': None}}
    for ended_at, expected in ((None, None), (5, 'step 5/5')):
        record = {'last': 'epoch001_step0000005.pth', 'best': None, 'ended_at': ended_at, 'files': entry}
        (tmp_path / 'checkpoints.json').write_text(json.dumps(record))
        assert finished(run, {}) == expected, ended_at


def _trained_run(folder, argv):
    """A sweep run (as sweep.plan makes it) whose folder holds a checkpoint and the args.yaml of `argv`, as a
    resumed start writes it: with what the run took from its data (an identical sweep run again after two
    interruptions was refused: '--num_classes none (it has 6)')."""
    import sweep

    run = argparse.Namespace(folder=str(folder), prefix='a', argv=argv, options=parse_args(parse_train_args, argv))
    (folder / 'epoch001_step0000002.pth').write_bytes(b'')
    saved = resolve(run.options).replace(num_classes=6, resize='squash')
    (folder / 'args.yaml').write_text(yaml.safe_dump(vars(saved)))
    entry = {'epoch001_step0000002.pth': {'step': 2, 'sha256': '0' * 64, 'metric': None}}
    record = {'last': 'epoch001_step0000002.pth', 'best': None, 'ended_at': 2, 'files': entry}
    (folder / 'checkpoints.json').write_text(json.dumps(record))
    return run, {'a': sweep.ended_entry(run)}


def test_a_run_ended_by_train_py_is_not_finished_once_its_config_asks_for_more(tmp_path):
    """finished.json kept the command train.py ended with: after the --config file it names was changed to
    more steps, the same command counted as finished, and the sweep trained nothing."""
    from sweep import finished

    config = tmp_path / 'train.yaml'
    config.write_text('max_iteration: 2\n')
    run, done = _trained_run(tmp_path, ['--config', str(config)])
    assert finished(run, done) == 'train.py ended at step 2'
    config.write_text('max_iteration: 6\n')
    longer = argparse.Namespace(**{**vars(run), 'options': parse_args(parse_train_args, run.argv)})
    assert finished(longer, done) is None


def test_an_option_dropped_from_a_sweep_s_command_is_a_change(tmp_path):
    """A sweep run again without an option its runs were trained with (--ema_decay 0.5) said they were
    finished, or resumed them with it: the command no longer said what they were. It is refused, as an
    option added or changed is."""
    from sweep import check_earlier_runs

    run, _ = _trained_run(tmp_path, ['--ema_decay', '0.5', '--max_iteration', '2'])
    check_earlier_runs([run], 'sweep')  # the same command
    run.options = parse_args(parse_train_args, ['--max_iteration', '2'])
    with pytest.raises(KilnError, match=r'^--ema_decay none \(it has 0.5\): sweep sweep trained a with other'):
        check_earlier_runs([run], 'sweep')


def test_runs_with_nothing_left_to_train_count_as_finished(tiny_shapes, tmp_path):
    """A finished sweep run again with fewer steps said every run was "trained now" and compared them all
    again (a comparison val_<name>_2 the same as the first), though each train.py had nothing to train."""
    train = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), *FAST]
    grid = ['--name', 'again', '--grid', 'lr=1e-3,3e-3']
    _sweep(*grid, '--', *train, '--max_iteration', '2')
    output = _sweep(*grid, '--', *train, '--max_iteration', '1').stdout
    table = tmp_path / 'ck' / 'comparisons' / 'val_again' / 'comparison.txt'
    assert f'again: 2 of 2 runs finished, 0 trained now; comparison: {table}' in output
    assert os.listdir(tmp_path / 'ck' / 'comparisons') == ['val_again']


def test_list_files_given_relative_are_the_options_a_run_saved(tmp_path, monkeypatch):
    """A sweep run again (or with --slurm) with --train_list given relative was refused: '--train_list
    lists/train.txt (it has /.../lists/train.txt)', though train.py saves list files as absolute paths."""
    import types

    import sweep

    run = tmp_path / 'ck' / 'small_cnn_list_sweep_lr0.001'
    run.mkdir(parents=True)
    (run / 'epoch001_step0000006.pth').write_bytes(b'')
    (run / 'args.yaml').write_text(f'train_list: {tmp_path}/lists/train.txt\nlr: 0.001\n')
    monkeypatch.chdir(tmp_path)
    options = parse_args(parse_train_args, ['--train_list', 'lists/train.txt', '--val_list', 'lists/val.txt'])
    (run / 'args.yaml').write_text(yaml.safe_dump(vars(resolve(options))))  # as train.py saves them: absolute
    same = types.SimpleNamespace(folder=str(run), prefix='sweep_lr0.001', options=options)
    sweep.check_earlier_runs([same], 'sweep')
    other = types.SimpleNamespace(folder=str(run), prefix='sweep_lr0.001')
    other.options = parse_args(parse_train_args, ['--train_list', 'lists/other.txt', '--val_list', 'lists/val.txt'])
    with pytest.raises(KilnError, match=r'^--train_list lists/other.txt \(it has .*/lists/train.txt\): sweep sweep'):
        sweep.check_earlier_runs([other], 'sweep')


def test_a_sweep_named_by_a_number_in_its_file_keeps_the_name_as_written(tmp_path):
    """YAML reads `name: 2024_01` as the number 202401: it was refused, 'must be letters, digits ... got
    2024', which it is; then told to quote it. A number is now read as written, quoted or not."""
    import sweep

    for written in ('2024_01', '"2024_01"'):
        (tmp_path / 'sweep.yaml').write_text(f'grid: {{lr: [1e-3]}}\nname: {written}\n')
        assert sweep.load_specs(sweep.sweep_args(['--config', str(tmp_path / 'sweep.yaml')]))[4] == '2024_01'
    (tmp_path / 'sweep.yaml').write_text('grid: {lr: [1e-3]}\nname: [a]\n')
    with pytest.raises(KilnError, match=r'name: must be text of ASCII letters'):
        sweep.load_specs(sweep.sweep_args(['--config', str(tmp_path / 'sweep.yaml')]))


def test_a_slurm_sweep_submits_from_a_login_node_without_torch(monkeypatch, capsys):
    """Checking the runs trained before needs torch: --slurm then refused to submit where it is missing."""
    import importlib.util

    import sweep

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'torch' else real(name, *a))
    monkeypatch.setattr(sweep, 'check_earlier_runs', lambda *a: pytest.fail('needs torch'))
    monkeypatch.setattr(sweep, 'submit', lambda runs, *a: len(runs))
    assert sweep.main(['--slurm', '--grid', 'lr=1e-3,3e-3', '--', '--model_type', 'small_cnn']) == 2
    assert 'note: no torch here to check the runs trained before' in capsys.readouterr().out


def test_a_checkpoints_dir_that_cannot_be_written_is_said_once_before_any_run(tmp_path, monkeypatch):
    """A read-only --checkpoints_dir was found by each run's train.py in turn (100 runs: 100 start-ups, and
    the same error 200 times), then "0 of 100 runs finished"."""
    import types

    import sweep

    launched = []
    monkeypatch.setattr(sweep, 'launch', lambda command: launched.append(command) or (0, ''))
    monkeypatch.setattr(sweep.tempfile, 'TemporaryFile', lambda dir: (_ for _ in ()).throw(OSError(30, 'Read-only')))
    run = types.SimpleNamespace(prefix='s_lr0.1', folder=str(tmp_path / 'ck' / 'run'), argv=['--lr', '0.1'])
    base = argparse.Namespace(checkpoints_dir=str(tmp_path / 'ck'))
    (tmp_path / 'ck').mkdir()
    with pytest.raises(KilnError, match=r'^cannot write into .*/ck \(Read-only\): a sweep writes its runs under'):
        sweep.run_all([run], 's', base, compare=False)
    assert launched == []


def test_a_run_leaves_no_open_pipe_and_help_works_with_the_output_closed(capfd):
    """Each run's stderr pipe was left open (a ResourceWarning per run under -X dev), and `sweep.py
    --help >&-` was a traceback: sys.stdout is None there."""
    import gc
    import sys
    import warnings

    import sweep

    gc.collect()  # (what earlier tests in this process left is not this test's)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        code, last = sweep.launch([sys.executable, '-c', 'import sys; sys.stderr.write("one\\ntwo\\n")'])
        gc.collect()
    assert (code, last) == (0, 'two')
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    closed = subprocess.run(
        [sys.executable, 'sweep.py', '--help'],
        cwd=os.path.dirname(sweep.__file__),
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout(60),
        preexec_fn=lambda: os.close(1),
    )
    assert closed.returncode == 0 and 'Traceback' not in closed.stderr, closed.stderr


def test_an_old_comparison_is_given_again_only_for_the_same_runs_as_they_are(tmp_path):
    """A rerun with nothing to train gave the newest comparison of that name: after a smaller sweep under
    the same name, a table with a run not in it; after a run was trained further by hand, its old numbers."""
    import sweep

    folders = [str(tmp_path / name) for name in ('a', 'b', 'c')]
    for folder in folders:
        os.makedirs(folder)
        (tmp_path / folder / 'best.pth').write_text('')
    table = tmp_path / 'comparisons' / 'val_sweep'
    table.mkdir(parents=True)
    rows = ''.join(f'{folder}/best.pth,0.5\n' for folder in folders)
    (table / 'comparison.csv').write_text('checkpoint,acc\n' + rows)
    (table / 'comparison.txt').write_text('')
    past = os.path.getmtime(table / 'comparison.txt') - 10
    for folder in folders:
        os.utime(os.path.join(folder, 'best.pth'), (past, past))
    assert sweep.compares(str(table), folders)
    assert not sweep.compares(str(table), folders[:2])  # a smaller sweep: its own table
    os.utime(os.path.join(folders[0], 'best.pth'))  # trained further since
    os.utime(table / 'comparison.txt', (past - 5, past - 5))
    assert not sweep.compares(str(table), folders)


def test_values_that_differ_past_six_digits_name_runs_of_their_own():
    """1000000 and 1000001 were both `iters1e6` (6 significant digits), and the sweep refused them as
    one; values 6 digits tell apart keep the names they had, however they are written."""
    import sweep

    named = {value: sweep.run_name('s', [('lr', value)]) for value in ('1e-3', '0.001', '3e-4', '1000000', '64')}
    assert named == {
        '1e-3': 's_lr0.001',
        '0.001': 's_lr0.001',
        '3e-4': 's_lr0.0003',
        '1000000': 's_lr1e6',
        '64': 's_lr64',
    }
    pairs = (('1000000', '1000001'), ('0.001234561', '0.001234562'))
    for a, b in pairs:
        assert sweep.run_name('s', [('lr', a)]) != sweep.run_name('s', [('lr', b)]), (a, b)


def test_a_sweep_file_reads_numbers_as_written_as_train_py_does(tmp_path):
    """grid: {seed: [010, 011]} ran --seed 8 and --seed 9 (YAML's octal), where train.py's --config reads
    010 as 10; and a key given twice was taken without a word."""
    import sweep

    config = tmp_path / 'sweep.yaml'
    config.write_text('grid: {seed: [010, 011], lr: [1e-3, 2_0]}\n')
    specs = sweep.load_specs(sweep.sweep_args(['--config', str(config)]))[0]
    assert specs == {'seed': ('choice', ['010', '011']), 'lr': ('choice', ['1e-3', '2_0'])}
    config.write_text('random: {lr: {log_uniform: [1e-4, 1e-2]}}\ntrials: 010\nseed: 010\nname: 010\n')
    assert sweep.load_specs(sweep.sweep_args(['--config', str(config)]))[2:] == (10, 10, '010')
    config.write_text('grid: {seed: [1]}\nname: a\nname: b\n')
    with pytest.raises(KilnError, match="the key 'name' is given twice"):
        sweep.load_specs(sweep.sweep_args(['--config', str(config)]))
