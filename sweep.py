"""Hyper-parameter sweeps: train.py once per combination of option values, then one comparison table.

    python sweep.py --grid lr=1e-3,3e-3 batch_size=64,128 -- [train.py options]
    python sweep.py --sampler random --trials 8 --seed 0 --grid lr=1e-4:1e-2 batch_size=64,128 -- ...
    python sweep.py --config sweep.yaml -- ...

sweep.yaml: `grid: {lr: [1e-3, 3e-3], batch_size: [64, 128]}` or `random: {lr: {log_uniform: [1e-4, 1e-2]},
weight_decay: {uniform: [0, 1e-3]}, batch_size: {choice: [64, 128]}}` with `trials: 8`, `seed: 0`, `name:`
(flags override the file). Names are train.py options, checked with its parser before anything runs;
switches take true/false. Random ranges A:B are log-uniform when 0 < A and B > 10 A (more than a decade),
else uniform; integer bounds give integers, other values 3 significant digits; --seed fixes the trials.

Each combination is its own experiment, --save_prefix <name>_lr0.001_bs64 (numbers in shortest form;
bs, wd, opt, ... abbreviate), trained by `train.py ... --resume` one after another: a second sweep
continues interrupted runs and skips finished ones, whose newest checkpoint (checkpoints.json) exists,
reached run_config.json's max_num_train_steps under the --epochs/--max_iteration asked now and had its
end written (checkpoints.json's ended_at: not a run killed between its last checkpoint and its end), or
where train.py exited 0 for this same command (early stopping; <checkpoints_dir>/sweeps/<name>/finished.json).
A failed run is reported and the rest go on (exit code 1). Ctrl-C or SIGTERM goes to the running
train.py, which saves; the sweep stops. Then eval.py compares the finished runs' best.pth in
<checkpoints_dir>/comparisons/val_<name>/comparison.txt (val_<name>_2, ... after later training).

--slurm writes <checkpoints_dir>/sweeps/<name>/sweep.sbatch, a --requeue job array with one task per
line of combinations.txt (line $SLURM_ARRAY_TASK_ID + 1, run with --resume) and submits it with sbatch;
--sbatch='--gpus=1 --time=4:00:00' adds sbatch options. The array's tasks read that file as they start:
a sweep of other runs under the same --name is refused (submitted.txt holds the job ids of the arrays
that read its files). --dry_run prints the commands, writes nothing.
"""

import argparse
import contextlib
import csv
import difflib
import functools
import hashlib
import importlib.util
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile

import yaml

from options import (
    KilnArgumentParser,
    UniqueKeyLoader,
    changed_options,
    choice_read_as,
    experiment_folder,
    parse_args,
    parse_train_args,
    resolve,
    user_path,
)
from utils.errors import KilnError, run_cli

REPO = os.path.dirname(os.path.abspath(__file__))
TRAIN, EVAL = os.path.join(REPO, 'train.py'), os.path.join(REPO, 'eval.py')
SHORT = {
    'batch_size': 'bs',
    'weight_decay': 'wd',
    'optimizer': 'opt',
    'scheduler': 'sched',
    'momentum': 'mom',
    'epochs': 'ep',
    'warmup_steps': 'warmup',
    'grad_accum_steps': 'accum',
    'max_iteration': 'iters',
}
NOT_SWEPT = ('save_prefix', 'resume', 'config', 'help', 'fast_dev_run')  # set by the sweep, or no run at all
NUMBER = r'\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*'
CHILD, STOP = [None], []  # the running train.py or eval.py; the signals received


def sweep_args(argv):
    """The sweep's own options (those before `--`)."""
    parser = KilnArgumentParser(
        prog='sweep.py',
        usage='sweep.py [options] -- [train.py options]',
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        '--grid',
        nargs='+',
        default=[],
        metavar='NAME=VALUES',
        help='an option and its values, lr=1e-3,3e-3 (random search: also ranges, lr=1e-4:1e-2)',
    )
    parser.add_argument('--config', metavar='FILE', type=user_path, help='a YAML sweep file (see above)')
    parser.add_argument('--sampler', choices=['grid', 'random'], help='all combinations (default), or --trials random')
    parser.add_argument('--trials', type=int, help='random search: how many combinations (default 10)')
    parser.add_argument('--seed', type=int, help='random search: seed of the sampling (default 0)')
    parser.add_argument('--name', help="names the runs, the comparison and the sweep's folder (default 'sweep')")
    parser.add_argument('--slurm', action='store_true', help='submit a SLURM job array instead of running here')
    parser.add_argument('--sbatch', default='', metavar='OPTIONS', help='with --slurm: more sbatch options')
    parser.add_argument('--dry_run', action='store_true', help='print the commands; run and write nothing')
    parser.add_argument(
        '--compare',
        action=argparse.BooleanOptionalAction,
        default=True,
        help='evaluate the finished runs into one comparison table',
    )
    parser.add_argument('--debug', action='store_true', help='show full tracebacks on errors')
    args, unknown = parser.parse_known_args(argv)
    flags = {flag for action in train_actions().values() for flag in action.option_strings}
    if any(token.split('=')[0] in flags for token in unknown):
        raise KilnError(
            f'{shlex.join(unknown)}: train.py options go after `--`: sweep.py [options] -- [train.py options]'
        )
    return parser.parse_args(argv)  # anything else unknown: the parser's own error


@functools.cache
def train_actions():
    """train.py's options: {name: argparse action}."""
    return {action.dest: action for action in parse_train_args(KilnArgumentParser())._actions if action.option_strings}


def load_specs(args):
    """({option: ('choice', [values]) or (rule, low, high, integer)}, sampler, trials, seed, name)."""
    config = {}
    if args.config:
        try:
            with open(args.config, encoding='utf-8-sig') as f:
                config = yaml.load(f, UniqueKeyLoader) or {}  # as train.py's --config: numbers as written
        except (OSError, ValueError, yaml.YAMLError) as error:  # (ValueError: not UTF-8 text)
            raise KilnError(f'--config {args.config}: cannot read it ({str(error).splitlines()[0]})') from None
        if (
            not isinstance(config, dict)
            or set(config) - {'grid', 'random', 'trials', 'seed', 'name'}
            or not isinstance(config.get('grid', config.get('random')), dict)
            or {'grid', 'random'} <= set(config)
        ):
            raise KilnError(
                f'--config {args.config}: expected grid: {{option: [values]}} or random: {{option: '
                f'{{log_uniform|uniform|choice: [...]}}}}, and trials:, seed:, name:'
            )
    entries = dict(config.get('grid', config.get('random', {})))
    for key in entries:
        if not isinstance(key, str):
            raise KilnError(f'--config {args.config}: {key!r} is not a train.py option name; write e.g. lr: [1e-3]')
    given = set()
    for item in args.grid:  # lr=1e-3,3e-3 is a list, lr=1e-4:1e-2 a range
        name, _, values = item.partition('=')
        bounds = values.split(':')
        if not (name and values):
            raise KilnError(f'--grid {item}: expected NAME=VALUES, e.g. lr=1e-3,3e-3 or lr=1e-4:1e-2')
        if name in given:
            raise KilnError(f'--grid {name}= is given twice: give its values once, {name}=a,b')
        given.add(name)
        entries[name] = (
            {'range': bounds}
            if len(bounds) == 2 and all(re.fullmatch(NUMBER, b) for b in bounds)
            else [v.strip() for v in values.split(',') if v.strip()]
        )
    sampler = args.sampler or ('random' if 'random' in config else 'grid')
    if sampler == 'grid' and (args.trials is not None or 'trials' in config):
        raise KilnError('--trials is for random search: add --sampler random')
    trials = setting(args, config, 'trials', 10, lambda v: is_integer(v) and v > 0, 'a positive integer')
    seed = setting(args, config, 'seed', 0, is_integer, 'an integer')
    name = setting(
        args,
        config,
        'name',
        'sweep',
        lambda v: isinstance(v, str) and re.fullmatch(r'[A-Za-z0-9][A-Za-z0-9._-]*', v),
        'text of ASCII letters, digits, ".", "_" and "-"',
    )
    if not entries:
        raise KilnError('nothing to sweep: give --grid NAME=VALUES ... or --config FILE')
    specs = {option: parse_spec(option, value) for option, value in entries.items()}
    return specs, sampler, trials, seed, name


def is_integer(value):
    """Whether `value` is an int (YAML's true is no number)."""
    return isinstance(value, int) and not isinstance(value, bool)


def setting(args, config, key, default, valid, requirement):
    """--<key> if given, else the sweep file's <key>: (default without one), refused unless `valid`."""
    value, where = getattr(args, key), f'--{key}'
    if value is None:
        value, where = config.get(key, default), f'--config {args.config}: {key}:'
        if hasattr(value, 'written'):  # a number, read as its flag reads it (trials: 010 is 10; name: 010 is '010')
            with contextlib.suppress(ValueError):
                value = value.written if isinstance(default, str) else int(value.written)
    if not valid(value):
        text = 'the text ' if isinstance(value, str) else ''  # trials: "8" is no number
        raise KilnError(f'{where} must be {requirement}, got {text}{value!r}')
    return value


def parse_spec(name, value):
    """An entry as ('choice', [texts]) or (rule, low, high, integer): [values], {choice: [values]}, or a range
    {uniform|log_uniform|range: [low, high]}; `range` is log-uniform when positive and over a decade wide."""

    def text(v):  # as on a command line (a number as it was written: 010 is 010, not YAML's 8)
        if isinstance(v, bool):
            return str(v).lower()
        return ' '.join(map(text, v)) if isinstance(v, list) else getattr(v, 'written', str(v))

    rule, values = next(iter(value.items())) if isinstance(value, dict) and len(value) == 1 else ('choice', value)
    if rule == 'choice' and isinstance(values, list):
        return 'choice', [text(v) for v in values]
    with contextlib.suppress(ValueError, TypeError):
        low, high = map(text, values) if rule in ('uniform', 'log_uniform', 'range') else None
        lo, hi = float(low), float(high)
        rule = rule if rule != 'range' else 'log_uniform' if 0 < lo and hi > 10 * lo else 'uniform'
        if lo < hi and (rule == 'uniform' or lo > 0):
            return rule, lo, hi, all(re.fullmatch(r'\s*[-+]?\d+\s*', bound) for bound in (low, high))
    raise KilnError(
        f'{name}: expected [values], {{choice: [values]}} or {{uniform|log_uniform: [low, high]}} '
        f'with low < high (and 0 < low for log_uniform), got {value!r}'
    )


def sample(rng, spec):
    """One value of `spec`, as text."""
    if spec[0] == 'choice':
        return rng.choice(spec[1])
    rule, lo, hi, integer = spec
    value = math.exp(rng.uniform(math.log(lo), math.log(hi))) if rule == 'log_uniform' else rng.uniform(lo, hi)
    if integer:
        return str(min(max(round(value), int(lo)), int(hi)))
    rounded = float(f'{value:.3g}')
    return repr(rounded if lo <= rounded <= hi else value)


def combinations(specs, sampler, trials, seed):
    """Every combination (grid) or `trials` random ones (seeded), each a list of (option, value)."""
    if sampler == 'random':
        rng = random.Random(seed)
        return [[(name, sample(rng, spec)) for name, spec in specs.items()] for _ in range(trials)]
    ranged = [name for name, spec in specs.items() if spec[0] != 'choice']
    if ranged:
        raise KilnError(f'{ranged[0]} is a range: ranges need --sampler random (or list values: {ranged[0]}=a,b)')
    return [list(zip(specs, values)) for values in itertools.product(*(spec[1] for spec in specs.values()))]


def check_names(specs, actions, train_argv):
    """One line for a swept name that is no train.py option or has no values, and for --save_prefix,
    --resume or --fast_dev_run after `--` (swept values simply override the same options there: the last
    flag wins)."""
    given = {token.split('=')[0] for token in train_argv if token.startswith('--')}
    for name, spec in specs.items():
        if name in NOT_SWEPT:
            raise KilnError(f'--{name} cannot be swept: the sweep names and resumes every run itself')
        if name not in actions:
            close = difflib.get_close_matches(name, [n for n in actions if n not in NOT_SWEPT], 1)
            raise KilnError(
                f'{name!r} is not a train.py option; '
                + (f'did you mean {close[0]}?' if close else 'see python train.py --help')
            )
        if spec[0] == 'choice' and not spec[1]:
            raise KilnError(f'{name}: no values to sweep')
    if {'--save_prefix', '--resume'} & given:
        raise KilnError('the sweep sets --save_prefix and --resume for every run: leave them out after --')
    if '--fast_dev_run' in given:
        raise KilnError('--fast_dev_run trains no run to sweep: leave it out after -- (or try train.py --fast_dev_run)')


def as_written(action, value):
    """The text `value` of `action`'s option as the user wrote it: YAML reads an unquoted off (on, ...) as
    false, so `amp: [off, bf16]` is --amp off (and names its run amp-off, as --grid amp=off,bf16 does)."""
    if action.nargs != 0 and value in ('true', 'false'):
        return choice_read_as(action, value == 'true') or value
    return value


def tokens(action, value):
    """Command-line tokens that give `action`'s option the text `value` (a switch takes true or false)."""
    flag, on = action.option_strings[0], value.lower() in ('true', 'yes', 'on', '1')
    if action.nargs != 0:
        return [flag, value] if action.nargs in (None, '?') else [flag, *value.split()]  # +, *, 2: several
    if not on and value.lower() not in ('false', 'no', 'off', '0'):
        raise KilnError(f'{flag} is a switch: sweep it over true,false, not {value!r}')
    return [flag] if on else [f'--no-{flag[2:]}'] if isinstance(action, argparse.BooleanOptionalAction) else []


def shortest(number):
    """`number` in 6 significant digits (`g`) where that is the number, else in as many as it takes."""
    text = format(number, 'g')
    if float(text) == number:
        return text
    text = repr(number)
    return text[:-2] if text.endswith('.0') else text


def run_name(name, combo):
    """`<name>_lr0.001_bs64`: short, filesystem-safe, the same for the same values however they are written."""
    parts = [name]
    for option, value in combo:
        try:
            parts.append(SHORT.get(option, option) + re.sub(r'e\+?(-?)0*(\d)', r'e\1\2', shortest(float(value))))
        except ValueError:
            parts.append(f'{SHORT.get(option, option)}-{re.sub(r"[^A-Za-z0-9.+-]+", "-", value).strip("-") or "x"}')
    prefix = '_'.join(parts)
    return prefix if len(prefix) <= 100 else f'{prefix[:90]}_{hashlib.sha1(prefix.encode()).hexdigest()[:8]}'


def plan(combos, name, train_argv, actions):
    """The runs (prefix, argv, options), every argv checked; identical random trials run once."""
    runs = {}
    for combo in combos:
        combo = [(option, as_written(actions[option], value)) for option, value in combo]
        prefix = run_name(name, combo)
        argv = [
            *train_argv,
            *(token for option, value in combo for token in tokens(actions[option], value)),
            '--save_prefix',
            prefix,
            '--resume',
        ]
        if prefix in runs and runs[prefix].argv != argv:
            raise KilnError(f'two combinations are both named {prefix}: give distinct values')
        if prefix not in runs:  # train.py's parser checks the values: one `error:` line, exit code 2
            runs[prefix] = argparse.Namespace(prefix=prefix, argv=argv, options=parse_args(parse_train_args, argv))
    return list(runs.values())


def read_run_file(folder, name):
    """The contents of a run's JSON or YAML file `name`, or None when it is missing or unreadable."""
    with contextlib.suppress(OSError, ValueError, yaml.YAMLError), open(os.path.join(folder, name)) as f:
        return yaml.safe_load(f)  # JSON is YAML too
    return None


def finished(run, done):
    """Why `run` counts as finished (see the module docstring), or None."""
    record, config, saved = (
        read_run_file(run.folder, name) for name in ('checkpoints.json', 'run_config.json', 'args.yaml')
    )
    step = newest_step(run.folder, record)
    with contextlib.suppress(KeyError, TypeError, AttributeError):
        if step >= 0 and done.get(run.prefix) == ended_entry(run):
            return f'train.py ended at step {step}'
        if (
            all(saved[k] == getattr(run.options, k) for k in ('epochs', 'max_iteration'))
            and step >= config['max_num_train_steps']
            and record.get('ended_at', step) == step  # (a record of an earlier Kiln does not say)
            and not changed_options(saved, run.options)  # else the sweep is refused (check_earlier_runs)
        ):
            return f'step {step}/{config["max_num_train_steps"]}'
    return None


def ended_entry(run):
    """What finished.json keeps of a run that train.py ended (exit code 0): its command, and how long that
    asked it to train (a --config file's epochs changed: the same command, a longer run)."""
    return {'argv': run.argv, 'epochs': run.options.epochs, 'max_iteration': run.options.max_iteration}


def newest_step(folder, record=None):
    """The step of the run's newest checkpoint (its checkpoints.json `record`), or -1 without one."""
    record = read_run_file(folder, 'checkpoints.json') if record is None else record
    with contextlib.suppress(KeyError, TypeError, AttributeError):
        last = record['last']
        return record['files'][last]['step'] if os.path.isfile(os.path.join(folder, last)) else -1
    return -1


def check_earlier_runs(runs, name):
    """A KilnError when a run of this sweep was trained with other options than a resume may change (the
    sweep run again after a change after --): each of its runs would be refused, with advice the sweep
    cannot take; a sweep of other options is a new sweep. A run that saved no checkpoint yet starts
    anew with the options given now."""
    from utils.checkpoint_keeper import step_of  # loads torch: not for --help

    for run in runs:
        names = os.listdir(run.folder) if os.path.isdir(run.folder) else []
        if not any(step_of(name) is not None for name in names):
            continue
        saved = read_run_file(run.folder, 'args.yaml')
        if not isinstance(saved, dict):
            continue
        options = resolve(run.options)  # the whole command says what the run is: an option dropped is a change
        changed = changed_options(saved, options, unset_matches=False)
        if changed:
            given = {option: getattr(run.options, option) for option in changed}  # as given; else as resolved
            shown = ', '.join(
                f'--{option} {next((v for v in (given[option], getattr(options, option)) if v is not None), "none")} '
                f'(it has {saved.get(option)})'
                for option in changed
            )
            raise KilnError(
                f'{shown}: sweep {name} trained {run.prefix} with other options, which a resumed run keeps; '
                f'give this sweep its own --name (or go back to the options it was run with)'
            )


def forward(signum, frame):
    """Ctrl-C or SIGTERM: the running train.py gets it (and saves); the sweep stops after it."""
    STOP.append(signum)
    if CHILD[0] is not None and CHILD[0].poll() is None:
        CHILD[0].send_signal(signum)


def launch(command):
    """Run `command` in its own process group (signals reach it through `forward` only), its stderr
    shown as it comes; return (exit code, last line of its stderr)."""
    print('$ ' + shlex.join(command))
    child = CHILD[0] = subprocess.Popen(command, stderr=subprocess.PIPE, process_group=0)
    tail = b''
    with child.stderr:
        while chunk := os.read(child.stderr.fileno(), 65536):
            sys.stderr.buffer.write(chunk)
            sys.stderr.buffer.flush()
            tail = (tail + chunk)[-8192:]
    code, CHILD[0] = child.wait(), None
    lines = [line.strip() for line in re.split(r'[\r\n]', tail.decode(errors='replace')) if line.strip()]
    return code, lines[-1] if lines else ''


def run_all(runs, name, base, compare):
    """Train the runs one after another, skipping finished ones, then compare them; return the exit code."""
    done_path = os.path.join(base.checkpoints_dir, 'sweeps', name, 'finished.json')
    for folder in (base.checkpoints_dir, os.path.dirname(done_path)):  # said once now, not by each train.py
        while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)  # (the runs make it: a sweep whose runs all fail leaves nothing)
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as error:
            raise KilnError(
                f'cannot write into {folder} ({error.strerror}): a sweep writes its runs under --checkpoints_dir; '
                f'give one you can write to'
            ) from None
    done, failed, trained = {}, [], 0
    with contextlib.suppress(OSError, ValueError), open(done_path) as f:
        done = json.load(f)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    for index, run in enumerate(runs, 1):
        if STOP:
            break
        reason = finished(run, done)
        if reason:
            print(f'[{index}/{len(runs)}] {run.prefix}: finished ({reason}), skipped')
            continue
        print(f'[{index}/{len(runs)}] {run.prefix}')
        step = newest_step(run.folder)
        code, last = launch([sys.executable, TRAIN, *run.argv])
        if code == 0:  # not trained: resumed with nothing left to train, still at the same checkpoint
            trained, done[run.prefix] = trained + (step < 0 or newest_step(run.folder) != step), ended_entry(run)
            os.makedirs(os.path.dirname(done_path), exist_ok=True)
            with open(done_path + '.tmp', 'w') as f:
                json.dump(done, f, indent=1)
            os.replace(done_path + '.tmp', done_path)
        elif not STOP:
            failed.append(f'{run.prefix}: exit code {code}: {last}')
    table = (
        compare_runs([run for run in runs if finished(run, done)], name, base, trained)
        if compare and not STOP
        else None
    )
    if STOP:
        print(f'{name}: stopped by signal {STOP[0]} (the running train.py saved): run it again to go on')
        return 128 + STOP[0]
    print(
        f'{name}: {len(runs) - len(failed)} of {len(runs)} runs finished, {trained} trained now'
        + (f'; comparison: {table}' if table else '')
        + ''.join(f'\n  failed: {line}' for line in failed)
    )
    return 1 if failed or table is False else 0


def compares(table, folders):
    """Whether the comparison in the folder `table` is of the best.pth of exactly `folders`, each as it is
    now (none written after the table: a run trained further since by hand is compared again)."""
    try:
        with open(os.path.join(table, 'comparison.csv'), newline='', errors='surrogateescape') as f:
            compared = {os.path.dirname(os.path.realpath(row['checkpoint'])) for row in csv.DictReader(f)}
        written = os.path.getmtime(os.path.join(table, 'comparison.txt'))
        newest = max(os.path.getmtime(os.path.join(folder, 'best.pth')) for folder in folders)
    except (OSError, KeyError, csv.Error):
        return False
    return compared == {os.path.realpath(folder) for folder in folders} and newest <= written


def compare_runs(runs, name, base, trained):
    """eval.py on the runs' best.pth into one table: its path, None without one, False if eval.py failed."""
    folders = [run.folder for run in runs if os.path.isfile(os.path.join(run.folder, 'best.pth'))]
    if len(folders) < 2:
        print('fewer than 2 finished runs: no comparison')
        return None
    prefixes = (name if k == 1 else f'{name}_{k}' for k in itertools.count(1))
    tables = os.path.join(base.checkpoints_dir, 'comparisons', 'val_{}')
    newest, prefix = None, next(prefixes)
    while os.path.exists(tables.format(prefix)) or any(
        os.path.exists(os.path.join(f, 'eval', f'best_val_{prefix}')) for f in folders
    ):
        newest, prefix = tables.format(prefix), next(prefixes)
    if not trained and newest and compares(newest, folders):
        return os.path.join(newest, 'comparison.txt')  # nothing new to compare
    quiet = ['--no-progress_bar'] if base.progress_bar is False else []  # as training
    device = (['--cpu'] if base.cpu else []) + quiet
    device += (['--gpus', *map(str, base.gpus)] if base.gpus else []) + (
        [] if base.num_workers is None else ['--num_workers', str(base.num_workers)]
    )
    code, last = launch(
        [
            sys.executable,
            EVAL,
            '--load_model_path',
            *folders,
            '--save_prefix',
            prefix,
            '--checkpoints_dir',
            base.checkpoints_dir,
            '--data_root',
            base.data_root,
            *device,
        ]
    )
    if code:
        print(f'eval.py failed (exit code {code}): {last}')
    return False if code else os.path.join(tables.format(prefix), 'comparison.txt')


SBATCH = """#!/usr/bin/env bash
# Kiln sweep {name}: one array task per line of {combos} (train.py options), written by sweep.py.
# SIGTERM (pre-emption, or B: two minutes before the time limit to this shell, which execs train.py) makes
# train.py save and stop; a requeued task resumes the run (every line has --resume).
#SBATCH --job-name={job_name}
#SBATCH --array=0-{last}
#SBATCH --requeue
#SBATCH --signal=B:TERM@120
#SBATCH --output={output}
#SBATCH --chdir={cwd}
set -euo pipefail
# an array submitted by hand (sbatch was missing where sweep.py ran) is recorded too, once a task starts
JOB=${{SLURM_ARRAY_JOB_ID:-?}}
grep -qx "$JOB" {submitted} 2>/dev/null || echo "$JOB" >> {submitted}
PYTHON=${{PYTHON:-{python}}}
COMBOS={combos}
LINE=$((SLURM_ARRAY_TASK_ID + 1))
OPTIONS=$(sed -n "${{LINE}}p" "$COMBOS") || true
if [ -z "$OPTIONS" ]; then
    echo "error: no line $LINE in $COMBOS (removed or changed since submission): run sweep.py --slurm again" >&2
    exit 1
fi
eval "set -- $OPTIONS"
exec "$PYTHON" {train} "$@"
"""


def submit(runs, name, base, sbatch_options, dry_run):
    """Write the job-array script and its combinations, and submit it with sbatch (print them with dry_run)."""
    folder = os.path.abspath(os.path.join(base.checkpoints_dir, 'sweeps', name))
    combos, path = os.path.join(folder, 'combinations.txt'), os.path.join(folder, 'sweep.sbatch')
    submitted = os.path.join(folder, 'submitted.txt')  # job ids of the arrays sbatch took: they read the files
    script = SBATCH.format(
        name=name,
        job_name=shlex.quote(name),
        combos=shlex.quote(combos),
        submitted=shlex.quote(submitted),
        last=len(runs) - 1,
        output=shlex.quote(
            os.path.join(folder, 'slurm-%A_%a.out')
        ),  # sbatch reads #SBATCH lines' quotes as a shell does
        cwd=shlex.quote(os.getcwd()),
        python=shlex.quote(sys.executable),
        train=shlex.quote(TRAIN),
    )
    lines = ''.join(shlex.join(run.argv) + '\n' for run in runs)
    command = ['sbatch', '--parsable', *shlex.split(sbatch_options), path]
    if dry_run:
        print(f'{path}:\n{script}\n{combos}:\n{lines}\n$ {shlex.join(command)}')
        return 0
    files = {combos: lines, path: script}
    jobs = list(dict.fromkeys(read_lines(submitted)))  # (tasks starting together may record a job twice)
    for file, content in files.items():  # an array submitted earlier reads them as its tasks start or requeue
        with contextlib.suppress(FileNotFoundError), open(file) as f:
            if f.read() == content:
                continue
            # never replaced: an array may read them, also one submitted by hand and not yet started
            when = (
                f'submitted before (job {", ".join(jobs)})'
                if jobs
                else 'written before (sbatch may not have taken it; an array submitted by hand reads them too)'
            )
            raise KilnError(
                f'sweep {name} was {when} with other runs or settings ({file} differs): give this sweep its own '
                f'--name (or, once no job array uses them, delete {combos} and {path})'
            )
    new = [file for file in files if not os.path.exists(file)]
    os.makedirs(folder, exist_ok=True)
    for file, content in files.items():
        with open(file, 'w') as f:
            f.write(content)
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError:
        raise KilnError(f'sbatch not found: submit {path} from a SLURM login node') from None
    if result.returncode:  # no job array reads the files written for it
        for file in new:
            os.remove(file)
        error = (result.stderr.strip() or '?').splitlines()[-1]
        raise KilnError(f'sbatch failed (exit code {result.returncode}): {error}')
    job = result.stdout.strip().split(';')[0]
    with open(submitted, 'a') as f:
        f.write(f'{job}\n')
    print(f'submitted job array {job}: {len(runs)} tasks of {path}; logs in {folder}/slurm-{job}_<task>.out')
    return 0


def read_lines(path):
    """The non-empty lines of the text file `path`, [] where there is none."""
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        return [line.strip() for line in f if line.strip()]
    return []


def main(argv):
    """Check every run's options, then train them here, print them (--dry_run) or submit them (--slurm)."""
    if sys.stdout is not None:  # (None: started with its output closed)
        sys.stdout.reconfigure(line_buffering=True)  # in order with the runs' own output
    split = argv.index('--') if '--' in argv else len(argv)
    args, train_argv = sweep_args(argv[:split]), argv[split + 1 :]
    specs, sampler, trials, seed, name = load_specs(args)
    actions = train_actions()
    check_names(specs, actions, train_argv)
    base = parse_args(parse_train_args, train_argv)
    runs = plan(combinations(specs, sampler, trials, seed), name, train_argv, actions)
    print(f'{name}: {len(runs)} runs ({sampler} over {", ".join(specs)})')
    if args.slurm and not args.dry_run and importlib.util.find_spec('torch') is None:  # a login node without it
        print('note: no torch here to check the runs trained before: each task refuses a changed option as it starts')
    elif not args.dry_run:  # a dry run looks at nothing on disk
        for run in runs:
            run.folder = experiment_folder(resolve(run.options))  # loads torch only for a task's default
        check_earlier_runs(runs, name)
    if args.slurm:
        return submit(runs, name, base, args.sbatch, args.dry_run)
    if args.dry_run:
        for index, run in enumerate(runs, 1):
            print(f'[{index}/{len(runs)}] {run.prefix}\n$ {shlex.join([sys.executable, TRAIN, *run.argv])}')
        return 0
    return run_all(runs, name, base, args.compare)


if __name__ == '__main__':
    sys.exit(run_cli(main))
