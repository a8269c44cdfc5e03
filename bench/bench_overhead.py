"""How much does the Trainer cost over a hand-written loop? `python bench/bench_overhead.py`.

Both train the same model, from the same initial weights, on the same in-memory data (the
Trainer's own DataLoaders over the default shapes dataset) for the same number of epochs,
validating after each epoch. It also times one save of the full training state. The Trainer runs as users run it: progress bar, TensorBoard
curves and images, printed lines, `last.pth`/`best.pth` written every epoch. The two alternate
--repeats times in one process, so machine noise hits both alike; the median ratio is printed.
"""
import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model.model_entry import select_model  # noqa: E402
from options import parse_args, parse_train_args  # noqa: E402
from train import Trainer  # noqa: E402


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


def main():
    """Alternate Trainer and hand-written runs; print each pair and the median overhead."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--model_type', default='small_cnn')
    options = parser.parse_args()
    argv = ['--epochs', str(options.epochs), '--model_type', options.model_type, '--num_workers', '0']
    ratios = []
    with tempfile.TemporaryDirectory() as scratch, open(os.devnull, 'w') as quiet:
        for repeat in range(options.repeats):
            trainer = make_trainer(argv, os.path.join(scratch, f'run{repeat}'))
            if repeat % 2:  # alternate which goes first, so warm-up and drift do not favour one
                hand = timed(lambda: hand_written_loop(trainer, options.epochs))
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                kiln = timed(trainer.train)
            if not repeat % 2:
                hand = timed(lambda: hand_written_loop(trainer, options.epochs))
            ratios.append(kiln / hand)
            print(f'repeat {repeat + 1}: Trainer {kiln:.2f}s  hand-written {hand:.2f}s  ratio {kiln / hand:.3f}',
                  flush=True)
        saves = [timed(trainer.save_checkpoint) for _ in range(5)]  # the full state, as after each epoch
    overhead = statistics.median(ratios) - 1
    print(f'median Trainer overhead over a hand-written loop: {overhead * 100:+.1f}% '
          f'({options.repeats} alternating runs of {options.epochs} epochs, {options.model_type}, '
          f'progress bar + TensorBoard + checkpoints on)')
    epoch_seconds = kiln / options.epochs
    print(f'saving a checkpoint: median {statistics.median(saves) * 1000:.0f} ms, '
          f'{statistics.median(saves) / epoch_seconds * 100:.1f}% of one epoch ({epoch_seconds:.1f}s)')


if __name__ == '__main__':
    main()
