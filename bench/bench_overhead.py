"""How much does Kiln cost over hand-written code? `python bench/bench_overhead.py [--device cuda]`.

1. Training: Kiln's loop (train.py, as users run it: progress bar, TensorBoard curves and pictures,
   printed lines, a full checkpoint every epoch) against a minimal hand-written loop over the same
   data path (the same device-resident uint8 batches and batched augmentation, data/loader.py), the
   same model, optimizer and schedule, for the same epochs. The two alternate --repeats times in one
   process, so machine noise hits both alike; images/s and the median ratio are printed, and the ratio
   per epoch, from runs --more_epochs longer (what a run pays once, its records and final flush, left out),
   in wall time and in CPU time of the training thread (steadier on a busy machine).
2. Saving one checkpoint (the full training state): how long it holds up training, and how long until
   its file is written on the writer thread, relative to one epoch.
3. Time from starting `python train.py` to its first optimizer step, beside `python -c "import torch"`
   and beside the shortest hand-written script that makes one optimizer step of the same model.
4. Evaluation: eval.py's loop (every result file and picture) against a bare forward loop.
"""

import argparse
import contextlib
import functools
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import eval as evaluation
import train
from model.model_entry import select_model
from utils.seeding import set_seed
from utils.trackers import Trackers


def hand_written_parts(trainer, epochs):
    """The model, optimizer and schedule of the hand-written loop, made before it is timed (as Kiln's are,
    by train.start): the same as the Trainer's."""
    o, device = trainer.options, trainer.device
    set_seed(o.seed)
    model = select_model(o).to(device, memory_format=torch.channels_last if o.channels_last else torch.preserve_format)
    if o.compile:
        model = torch.compile(model, mode=o.compile_mode)
    optimizer = torch.optim.AdamW(model.parameters(), o.lr, weight_decay=o.weight_decay)
    return model, optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * len(trainer.train_data))


def hand_written_loop(trainer, epochs, parts):
    """The loop a user would write on the same batches: same model, optimizer, schedule and validation."""
    o, device = trainer.options, trainer.device
    model, optimizer, scheduler = parts
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(o.amp)
    for epoch in range(epochs):
        model.train()
        for batch in trainer.train_data.epoch(epoch):
            with torch.autocast(device.type, dtype, enabled=dtype is not None):
                loss = torch.nn.functional.cross_entropy(model(batch['image']), batch['label'])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        model.eval()
        correct = torch.zeros((), device=device)
        with torch.no_grad(), torch.autocast(device.type, dtype, enabled=dtype is not None):
            for batch in trainer.val_data.epoch(0):
                correct += (model(batch['image']).argmax(1) == batch['label']).sum()
        accuracy = correct.item() / len(trainer.val_data.dataset)
    return accuracy


def timed(function):
    """Seconds `function()` takes (waiting for the GPU at the end)."""
    start = time.perf_counter()
    function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


DEFAULTS = 'the defaults: progress bar, TensorBoard curves and pictures, a checkpoint every epoch'


def bench_training(options, scratch, quiet):
    """Print each repeat's images/s and the median Kiln/hand-written time ratio of runs of --epochs, and
    the ratio per epoch: the difference between runs of --epochs and --epochs + --more_epochs, which
    leaves out what a run pays once (its records, the final flush); return the last Trainer and the
    seconds of one of its epochs."""
    argv = [
        '--model_type',
        options.model_type,
        '--print_freq',
        '20',
        '--progress_bar',  # drawn (into /dev/null), as in a terminal: its cost is part of the defaults'
        *(['--cpu'] if options.device == 'cpu' else []),
        *options.extra,
    ]
    runs = {}  # (epochs, 'kiln' or 'hand') -> seconds of each repeat
    cpu = {}  # the same in CPU seconds of the training thread: steadier than wall time on a busy machine
    faults = {}  # the same in page faults of the process (memory the system hands out anew)

    def measure(key, function):
        start, faulted = time.thread_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        runs.setdefault(key, []).append(timed(function))
        cpu.setdefault(key, []).append(time.thread_time() - start)
        faults.setdefault(key, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)

    lengths = (options.epochs, options.epochs + options.more_epochs) if options.more_epochs else (options.epochs,)
    for repeat in range(options.repeats):
        for epochs in lengths:
            folder = os.path.join(scratch, f'run{repeat}_{epochs}')
            trainer = train.start(argv + ['--epochs', str(epochs), '--checkpoints_dir', folder])
            if repeat % 2:  # alternate which goes first, so warm-up and drift do not favour one
                parts = hand_written_parts(trainer, epochs)
                measure((epochs, 'hand'), lambda: hand_written_loop(trainer, epochs, parts))
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                measure((epochs, 'kiln'), trainer.run)
            if not repeat % 2:
                parts = hand_written_parts(trainer, epochs)
                measure((epochs, 'hand'), lambda: hand_written_loop(trainer, epochs, parts))
        kiln, hand = runs[options.epochs, 'kiln'][-1], runs[options.epochs, 'hand'][-1]
        images = options.epochs * len(trainer.train_data) * trainer.options.batch_size
        print(
            f'  repeat {repeat + 1}: {options.epochs} epochs: Kiln {kiln:.2f}s ({images / kiln:.0f} img/s)  '
            f'hand-written {hand:.2f}s ({images / hand:.0f} img/s)  ratio {kiln / hand:.3f}',
            flush=True,
        )
    median = {key: statistics.median(values) for key, values in runs.items()}
    ratios = [k / h for k, h in zip(runs[options.epochs, 'kiln'], runs[options.epochs, 'hand'])]
    images = options.epochs * len(trainer.train_data) * trainer.options.batch_size
    print(
        f'training: Kiln {images / median[options.epochs, "kiln"]:.0f} img/s, hand-written '
        f'{images / median[options.epochs, "hand"]:.0f} img/s; median ratio {statistics.median(ratios):.3f} '
        f'({options.repeats} alternating runs of {options.epochs} epochs, {options.model_type} on {trainer.device}, '
        f'{" ".join(options.extra) or DEFAULTS})'
    )
    if options.more_epochs:
        long = options.epochs + options.more_epochs

        def per_epoch(measured):
            """(Kiln, hand-written) per epoch: the median of the long runs less that of the short ones."""
            return [
                (statistics.median(measured[long, who]) - statistics.median(measured[options.epochs, who]))
                / options.more_epochs
                for who in ('kiln', 'hand')
            ]

        kiln, hand = per_epoch(runs)
        print(
            f'per epoch (runs of {long} less runs of {options.epochs} epochs, medians): Kiln {kiln * 1000:.1f} ms, '
            f'hand-written {hand * 1000:.1f} ms: ratio {kiln / hand:.3f}'
        )
        kiln, hand = per_epoch(cpu)
        print(
            f'  CPU time of the training thread per epoch: Kiln {kiln * 1000:.1f} ms, hand-written '
            f"{hand * 1000:.1f} ms: ratio {kiln / hand:.3f} (not counting Kiln's writer thread; with several torch "
            f'threads it counts their spinning while they wait for each other)'
        )
        kiln, hand = per_epoch(faults)
        print(f'  page faults per epoch: Kiln {kiln:.0f}, hand-written {hand:.0f} (see utils/allocator.py)')
    return trainer, median[options.epochs, 'kiln'] / options.epochs


def bench_checkpoint(trainer, epoch_seconds):
    """Print the median time a save holds up the training thread, the time until its file is written,
    and their shares of one epoch."""
    trainer.logger.trackers, trainer.checkpointer.late_parts = Trackers(), {}  # closed at the end of the run
    blocked, written = [], []
    for _ in range(5):
        start = time.perf_counter()
        trainer.save()
        blocked.append(time.perf_counter() - start)
        trainer.logger.wait()
        written.append(time.perf_counter() - start)
    block, write = statistics.median(blocked), statistics.median(written)
    print(
        f'checkpoint: a save holds up training for {block * 1000:.1f} ms ({block / epoch_seconds * 100:.1f}% of one '
        f'epoch of {epoch_seconds:.2f}s); its file is written {write * 1000:.0f} ms after it starts, on the '
        f'writer thread (medians of 5)'
    )


# The shortest script to one optimizer step of the same model on one batch, timed the way train.py
# times itself: from the script's first line. torch.optim imports torch._dynamo on its first call
# (torch._disable_dynamo), so any script that trains with a torch optimizer pays for that import.
HAND_WRITTEN_FIRST_STEP = """
import sys, time
started = time.perf_counter()
import argparse, torch
from model.model_entry import select_model
device, model_type, (size, classes, batch) = torch.device(sys.argv[1]), sys.argv[2], map(int, sys.argv[3:])
model = select_model(argparse.Namespace(model_type=model_type, num_classes=classes, img_size=size)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), 3e-3)
images = torch.randn(batch, 3, size, size, device=device)
labels = torch.randint(0, classes, (batch,), device=device)
torch.nn.functional.cross_entropy(model(images), labels).backward()
optimizer.step()
print(time.perf_counter() - started)
"""


FIRST_STEP = re.compile(r'first step ([0-9.]+)s after train.py started')  # in the line train.py ends with


def bench_first_step(options, trained, scratch):
    """Print how long `python train.py` takes to its first optimizer step, beside `python -c "import torch"`
    and a hand-written script's first step of the same model on batches of the same shape (`trained`: the
    resolved options of the training runs)."""
    firsts, imports, hands = [], [], []
    device = ['--cpu'] if options.device == 'cpu' else []
    shape = [str(trained.img_size), str(trained.num_classes), str(trained.batch_size)]

    def hand_written():
        command = [sys.executable, '-c', HAND_WRITTEN_FIRST_STEP, options.device, options.model_type, *shape]
        hands.append(float(subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout))

    def kiln(repeat):
        command = [sys.executable, 'train.py', '--model_type', options.model_type, *options.extra, '--max_iteration']
        command += ['1', '--no-progress_bar', *device, '--checkpoints_dir', os.path.join(scratch, f'first{repeat}')]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
        firsts.append(float(FIRST_STEP.search(result.stdout).group(1)))

    def importing():  # (with the interpreter's own start, which the other two leave out)
        imports.append(timed(lambda: subprocess.run([sys.executable, '-c', 'import torch'], check=True)))

    for repeat in range(3):
        runs = [importing, hand_written, functools.partial(kiln, repeat)]
        for run in runs[repeat:] + runs[:repeat]:  # each first in one round: no order favoured
            run()
    first, imported, hand = statistics.median(firsts), statistics.median(imports), statistics.median(hands)
    print(
        f'time to first step: median {first:.2f}s from the start of train.py; python -c "import torch" takes '
        f'{imported:.2f}s: {first / imported:.2f}x; a hand-written script reaches its first step in {hand:.2f}s: '
        f'{first / hand:.2f}x (3 alternating runs)'
    )


def bench_eval(trainer, scratch, repeats):
    """Print eval.py's throughput against a bare forward loop over the same validation batches."""
    checkpoint = os.path.join(trainer.options.model_dir, 'last.pth')
    ratios, speeds = [], []
    for repeat in range(repeats):
        argv = [
            '--load_model_path',
            checkpoint,
            '--no-progress_bar',
            '--save_prefix',
            f'bench{repeat}',
            *(['--cpu'] if trainer.device.type == 'cpu' else []),
        ]
        model = trainer.setup.wrapped

        def bare():
            model.eval()
            with torch.no_grad():
                for batch in trainer.val_data.epoch(0):
                    model(batch['image']).argmax(1)

        if repeat % 2:
            hand = timed(bare)
        with contextlib.redirect_stdout(open(os.devnull, 'w')):
            kiln = timed(lambda: evaluation.main(argv))
        if not repeat % 2:
            hand = timed(bare)
        ratios.append(kiln / hand)
        speeds.append(len(trainer.val_data.dataset) / kiln)
    print(
        f'evaluation: median {statistics.median(speeds):.0f} images/s with every result file, median ratio '
        f"{statistics.median(ratios):.3f} over a bare forward loop ({repeats} alternating runs; eval.py's time "
        f'includes loading the checkpoint and the data)'
    )


def main():
    """Run the four measurements and print their figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', choices=['cpu', 'cuda'], default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument(
        '--more_epochs', type=int, default=6, help='a second, longer run for the per-epoch ratio (0: none)'
    )
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--model_type', default='small_cnn')
    parser.add_argument('extra', nargs='*', help='more train.py options after --, e.g. -- --amp bf16 --compile')
    options = parser.parse_args()
    print(
        f'machine: {os.cpu_count()} CPUs, torch {torch.__version__}, '
        f'{torch.cuda.get_device_name() if options.device == "cuda" else "no GPU used"}'
    )
    with tempfile.TemporaryDirectory() as scratch, open(os.devnull, 'w') as quiet:
        trainer, epoch_seconds = bench_training(options, scratch, quiet)
        bench_checkpoint(trainer, epoch_seconds)
        bench_first_step(options, trainer.options, scratch)
        bench_eval(trainer, scratch, options.repeats)


if __name__ == '__main__':
    main()
