"""A long fault-injection run, outside the test suite: `python bench/torture.py --trials 50 [--device cuda]`.

Each trial picks a mode (epochs with 2 DataLoader workers, iteration mode with mid-run validation,
gradient accumulation, in-memory data), starts a run that saves every step, SIGKILLs it right after
a random step (at once, or a random fraction of a step later, inside the next save or step), sometimes
SIGKILLs the resume too, and resumes until it finishes; the final weights, history
and TensorBoard-free records must equal an uninterrupted run's, bit for bit. Some trials instead try
to resume with another --batch_size, which must be refused with one line and no file touched.
Prints the counts at the end; exits non-zero if any trial failed.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODES = {
    'epochs': ['--epochs', '3', '--num_workers', '2'],
    'iterations': ['--max_iteration', '30', '--valid_interval', '7', '--scheduler', 'plateau', '--lr_patience', '0'],
    'accumulation': ['--epochs', '3', '--grad_accum_steps', '2'],
    'memory': ['--epochs', '3', '--data_type', 'mem_list'],
}


def base_args(data, folder, device='cpu'):
    """train.py's options of every trial and reference run: tiny, saving every step, deterministic."""
    return [
        '--data_type',
        'list',
        '--train_list',
        os.path.join(data, 'train.txt'),
        '--val_list',
        os.path.join(data, 'val.txt'),
        '--checkpoints_dir',
        folder,
        '--batch_size',
        '8',
        '--no-progress_bar',
        '--num_workers',
        '0',
        *(['--cpu'] if device == 'cpu' else []),
        '--deterministic',
        '--save_interval',
        '1',
        '--loggers',
        'csv',
    ]


def experiment(folder):
    (name,) = os.listdir(folder)
    return os.path.join(folder, name)


def saved_step(folder):
    """The step of the newest checkpoint on record in the run folder under `folder`, or -1."""
    try:
        with open(os.path.join(experiment(folder), 'checkpoints.json')) as f:
            return int(json.load(f)['last'].split('step')[1].split('.')[0])
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return -1


def train(args, kill_at=None, delay=0.0):
    """Run train.py; with `kill_at`, SIGKILL it `delay` seconds after its checkpoint of step `kill_at`
    is on record (if it gets there). Returns the exit code; a run that fails on its own prints its last
    error lines."""
    process = subprocess.Popen(
        [sys.executable, 'train.py', *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, 'OMP_NUM_THREADS': '1'},
    )
    if kill_at is not None:
        folder = args[args.index('--checkpoints_dir') + 1]
        while process.poll() is None and saved_step(folder) < kill_at:
            time.sleep(0.005)
        time.sleep(delay)
        process.kill()
    _, errors = process.communicate()
    if process.returncode not in (0, -signal.SIGKILL):
        print('\n'.join(errors.decode(errors='replace').strip().splitlines()[-8:]), flush=True)
    return process.returncode


def final_state(folder):
    state = torch.load(os.path.join(experiment(folder), 'last.pth'), weights_only=True, map_location='cpu')
    return state['model'], state['history'], state['position']


def same(a, b):
    return all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1] == b[1] and a[2] == b[2]


def snapshot(folder):
    folder = experiment(folder)
    return {
        n: open(os.path.join(folder, n), 'rb').read()
        for n in os.listdir(folder)
        if os.path.isfile(os.path.join(folder, n))
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--trials', type=int, default=50)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--device', choices=['cpu', 'cuda'], default='cpu', help='where the runs train')
    options = parser.parse_args()
    chooser = random.Random(options.seed)
    counts = dict(
        trials=0, kills=0, resume_kills=0, resumes=0, bitwise_equal=0, refusals=0, correct_refusals=0, failures=0
    )
    with tempfile.TemporaryDirectory() as scratch:
        from data.shapes import generate_shapes

        data = generate_shapes(os.path.join(scratch, 'data'), train_size=96, val_size=48)
        references, steps = {}, {}
        for mode, extra in MODES.items():
            folder = os.path.join(scratch, f'reference_{mode}')
            assert train(base_args(data, folder, options.device) + extra) == 0, mode
            references[mode] = final_state(folder)
            steps[mode] = references[mode][2]['step']
        for trial in range(options.trials):
            counts['trials'] += 1
            mode = chooser.choice(list(MODES))
            args = base_args(data, os.path.join(scratch, f'trial{trial}'), options.device) + MODES[mode]
            killed = train(args, kill_at=chooser.randrange(1, steps[mode]), delay=chooser.choice([0, 0, 0.05, 0.2]))
            counts['kills'] += killed == -signal.SIGKILL
            folder = args[args.index('--checkpoints_dir') + 1]
            saved = (
                os.path.isdir(folder)
                and os.listdir(folder)
                and os.path.exists(os.path.join(experiment(folder), 'last.pth'))
            )
            if chooser.random() < 0.2 and saved:
                counts['refusals'] += 1
                before = snapshot(folder)
                refused = subprocess.run(
                    [sys.executable, 'train.py', *args, '--resume', '--batch_size', '16'],
                    cwd=REPO,
                    capture_output=True,
                    text=True,
                )
                lines = refused.stderr.strip().splitlines()
                good = (
                    refused.returncode == 2
                    and len(lines) == 1
                    and '--batch_size 16' in lines[0]
                    and snapshot(folder) == before
                )
                counts['correct_refusals'] += good
                counts['failures'] += not good
                if not good:
                    print(f'trial {trial}: the batch-size change was not refused cleanly: {refused.stderr[-500:]}')
            code = None
            for attempt in range(5):  # resume until done; the first resumes may be killed too
                kill = chooser.randrange(1, steps[mode]) if attempt < 2 and chooser.random() < 0.3 else None
                code = train(args + ['--resume'], kill_at=kill, delay=chooser.choice([0, 0.05]))
                counts['resumes'] += 1
                counts['resume_kills'] += code == -signal.SIGKILL
                if code == 0:
                    break
            if code == 0 and same(final_state(folder), references[mode]):
                counts['bitwise_equal'] += 1
            else:
                counts['failures'] += 1
                print(f'trial {trial} ({mode}): exit {code} or different weights/history')
            print(
                f'trial {trial + 1}/{options.trials} {mode}: ' + ' '.join(f'{k} {v}' for k, v in counts.items()),
                flush=True,
            )
    print('torture: ' + ', '.join(f'{k} {v}' for k, v in counts.items()))
    sys.exit(1 if counts['failures'] else 0)


if __name__ == '__main__':
    main()
