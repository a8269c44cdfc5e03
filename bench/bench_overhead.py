"""How much does Kiln cost over hand-written code? `python bench/bench_overhead.py`.

1. Training: the Trainer and a minimal hand-written loop train the same model, from the same
   initial weights, on the same in-memory data (the Trainer's own DataLoaders over the default
   shapes dataset) for the same number of epochs, validating after each epoch. The Trainer runs
   as users run it: progress bar, TensorBoard curves and images, printed lines, a full
   checkpoint every epoch. The two alternate --repeats times in one process, so machine noise
   hits both alike; the median ratio is printed.
2. Saving one checkpoint (the full training state), relative to one epoch.
3. Time to the first training step of `python train.py`, beside the time to import torch.
4. Evaluation: the Evaluator (with result files and pictures) against a bare forward loop over
   the validation split, alternating; images per second and the median ratio.
"""
import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval import Evaluator, load_evaluated_checkpoint  # noqa: E402
from model.model_entry import select_model  # noqa: E402
from options import parse_args, parse_test_args, parse_train_args  # noqa: E402
from train import Trainer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hand_written_loop(trainer, epochs):
    """The minimal loop a user would write: same model, data, optimizer and schedule."""
    torch.manual_seed(trainer.args.seed)
    model = select_model(trainer.args).to(trainer.device)
    optimizer = torch.optim.AdamW(model.parameters(), trainer.args.lr, weight_decay=trainer.args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * len(trainer.train_loader))
    criterion = torch.nn.CrossEntropyLoss()
    for _ in range(epochs):
        model.train()
        for inputs, targets in trainer.train_loader:
            loss = criterion(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for inputs, targets in trainer.val_loader:
                correct += (model(inputs).argmax(1) == targets).sum()
        accuracy = correct.item() / len(trainer.val_loader.dataset)
    return accuracy


def make_trainer(argv, folder):
    """A Trainer writing into `folder`, set up as train.py would set it up."""
    args = parse_args(parse_train_args, argv + ['--cpu'])
    args.model_dir, args.resume_from = folder, None
    os.makedirs(folder)
    return Trainer(args)


def timed(function):
    """Seconds `function()` takes."""
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def bench_training(options, scratch, quiet):
    """Print the Trainer/hand-written ratio of each repeat and the median; return the last Trainer
    and the seconds of its epochs."""
    argv = ['--epochs', str(options.epochs), '--model_type', options.model_type, '--num_workers', '0']
    ratios = []
    for repeat in range(options.repeats):
        trainer = make_trainer(argv, os.path.join(scratch, f'run{repeat}'))
        if repeat % 2:  # alternate which goes first, so warm-up and drift do not favour one
            hand = timed(lambda: hand_written_loop(trainer, options.epochs))
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            kiln = timed(trainer.train)
        if not repeat % 2:
            hand = timed(lambda: hand_written_loop(trainer, options.epochs))
        ratios.append(kiln / hand)
        print(f'  repeat {repeat + 1}: Trainer {kiln:.2f}s  hand-written {hand:.2f}s  ratio {kiln / hand:.3f}',
              flush=True)
    print(f'training: median Trainer overhead over a hand-written loop {(statistics.median(ratios) - 1) * 100:+.1f}% '
          f'({options.repeats} alternating runs of {options.epochs} epochs, {options.model_type}, '
          f'progress bar + TensorBoard + checkpoint every epoch on)')
    return trainer, kiln / options.epochs


def bench_checkpoint(trainer, epoch_seconds):
    """Print the median time of saving the full training state, and its share of one epoch."""
    with contextlib.redirect_stdout(open(os.devnull, 'w')):
        saves = [timed(trainer.save_checkpoint) for _ in range(5)]
    print(f'checkpoint: saving the full state takes {statistics.median(saves) * 1000:.0f} ms (median of 5), '
          f'{statistics.median(saves) / epoch_seconds * 100:.1f}% of one epoch ({epoch_seconds:.1f}s)')


def bench_first_step(scratch):
    """Print how long `python train.py` takes to make its first optimizer step, beside `import torch`."""
    firsts, imports = [], []
    for repeat in range(3):
        result = subprocess.run([sys.executable, 'train.py', '--max_iteration', '1', '--no-progress_bar',
                                 '--checkpoints_dir', os.path.join(scratch, f'first{repeat}')],
                                cwd=REPO, capture_output=True, text=True, check=True)
        firsts.append(float(re.search(r'first step ([0-9.]+)s after start', result.stdout).group(1)))
        imports.append(timed(lambda: subprocess.run([sys.executable, '-c', 'import torch, torchvision'], check=True)))
    print(f'time to first step: median {statistics.median(firsts):.1f}s from the start of train.py '
          f'(importing torch and torchvision alone: {statistics.median(imports):.1f}s)')


def bench_eval(trainer, scratch, repeats):
    """Print the Evaluator's throughput against a bare forward loop over the same validation data."""
    checkpoint = os.path.join(trainer.args.model_dir, 'last.pth')
    ratios, speeds = [], []
    for repeat in range(repeats):
        args = parse_args(parse_test_args, ['--load_model_path', checkpoint, '--cpu', '--no-progress_bar'])
        args.load_model_path, args.result_dir = checkpoint, os.path.join(scratch, f'eval{repeat}')
        os.makedirs(args.result_dir)
        evaluator = Evaluator(args, load_evaluated_checkpoint(args))

        def bare():
            evaluator.model.eval()
            with torch.no_grad():
                for inputs, _ in evaluator.loader:
                    evaluator.model(inputs).argmax(1)
        if repeat % 2:
            hand = timed(bare)
        kiln = timed(evaluator.eval)
        if not repeat % 2:
            hand = timed(bare)
        ratios.append(kiln / hand)
        speeds.append(len(evaluator.dataset) / kiln)
    print(f'evaluation: median {statistics.median(speeds):.0f} images/s with all result files, '
          f'{(statistics.median(ratios) - 1) * 100:+.1f}% over a bare forward loop ({repeats} alternating runs)')


def main():
    """Run the four measurements and print their figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--model_type', default='small_cnn')
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, open(os.devnull, 'w') as quiet:
        trainer, epoch_seconds = bench_training(options, scratch, quiet)
        bench_checkpoint(trainer, epoch_seconds)
        bench_first_step(scratch)
        bench_eval(trainer, scratch, options.repeats)


if __name__ == '__main__':
    main()
