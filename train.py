"""Train a model: `python train.py --help`.

The Trainer is a plain class: adapt it to a new task by overriding `step`, `compute_loss`,
`compute_metrics` and `gen_imgs_to_write` (or any other method) in a subclass.
"""
from options import parse_args, parse_train_args

if __name__ == '__main__':
    parse_args(parse_train_args)  # answer --help and option mistakes before the slow torch import

import contextlib
import math
import os
import signal
import sys
import time

import torch
from tqdm import tqdm

from data.augment import denormalize
from data.data_entry import select_eval_loader, select_train_loader
from loss import select_loss
from metrics import classification_metrics
from model.model_entry import equip_multi_gpu, select_model
from options import NOT_SAVED, discard_folder_if_setup_fails, prepare_train_args
from utils.checkpoint import load_checkpoint
from utils.errors import KilnError, run_cli
from utils.logger import Logger, progress
from utils.run_history import InMemoryRunHistory
from utils.run_record import TrainerRunConfig, append_reproducibility_record
from utils.stop_signals import StopSignals
from utils.torch_utils import (load_weights, rng_states, select_device, set_deterministic, set_rng_states, set_seed,
                               unwrap_model)
from utils.viz import labeled_grid

OPTIMIZERS = {
    'sgd': lambda params, args: torch.optim.SGD(params, args.lr, momentum=args.momentum,
                                                weight_decay=args.weight_decay),
    'adam': lambda params, args: torch.optim.Adam(params, args.lr, weight_decay=args.weight_decay),
    'adamw': lambda params, args: torch.optim.AdamW(params, args.lr, weight_decay=args.weight_decay),
}


def _warmup_cosine(optimizer, args, total_steps, steps_per_epoch):
    def factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        done = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# name -> builder(optimizer, args, total optimizer steps, optimizer steps per epoch)
SCHEDULERS = {
    'none': lambda optimizer, args, total, per_epoch: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    'cosine': _warmup_cosine,
    'step': lambda optimizer, args, total, per_epoch: torch.optim.lr_scheduler.StepLR(
        optimizer, args.lr_step_epochs * per_epoch, args.lr_gamma),
    'plateau': lambda optimizer, args, total, per_epoch: torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode=args.monitor_mode, factor=args.lr_gamma, patience=args.lr_patience),
}


class Trainer:
    """Trains `--model_type` on `--data_type`, validating and checkpointing on schedule.

    Everything a run needs to continue exactly after a kill lives in `state_dict()`; the loop
    itself is `train` -> `train_per_epoch` -> `step`/`compute_loss`, then `after_update`.
    """

    def __init__(self, args):
        self.args = args
        set_seed(args.seed)
        set_deterministic(args.deterministic)
        self.device = select_device(args)
        self.train_loader = select_train_loader(args)
        args.num_classes = args.num_classes or self.train_loader.dataset.num_classes
        self.val_loader = select_eval_loader(args)
        self.class_names = self.train_loader.dataset.class_names
        model = select_model(args)
        if args.load_model_path:
            load_weights(model, args.load_model_path, strict=not args.load_not_strict)
        self.model = equip_multi_gpu(model.to(self.device), args)
        self.criterion = select_loss(args.loss)
        self.updates_per_epoch = len(self.train_loader)
        self.max_steps = args.max_iteration or args.epochs * self.updates_per_epoch
        self.optimizer = self.make_optimizer()
        self.scheduler = self.make_scheduler()
        self.epoch = 0  # epochs completed
        self.batch_in_epoch = 0  # batches of the current epoch already trained on
        self.global_step = 0  # optimizer updates made
        self.best_metric = None  # best --monitor value so far
        self.early_stop = {'best': None, 'waited': 0}  # by --early_stop_min_delta
        self.history = InMemoryRunHistory()
        # the first step whose loss was not finite, -1 if none: kept on the device, read at check points
        self.nonfinite_step = torch.full((), -1, dtype=torch.long, device=self.device)
        self.device_step = torch.zeros((), dtype=torch.long, device=self.device)
        self.stop_reason = None
        self.signals = StopSignals()
        checkpoint = load_checkpoint(args.resume_from) if args.resume_from else None
        if checkpoint is not None:
            self.load_state_dict(checkpoint)
        self.logger = Logger(args.model_dir, args.keep_last, args.keep_best, args.monitor_mode,
                             purge_step=self.global_step + 1 if checkpoint is not None else None)
        if checkpoint is not None:
            self.logger.recorder.load_state_dict(checkpoint['recorder'])

    def make_optimizer(self):
        """The optimizer named by --optimizer over all trainable parameters."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return OPTIMIZERS[self.args.optimizer](params, self.args)

    def make_scheduler(self):
        """The learning-rate schedule named by --scheduler (see SCHEDULERS)."""
        return SCHEDULERS[self.args.scheduler](self.optimizer, self.args, self.max_steps, self.updates_per_epoch)

    def step(self, batch):
        """Move one batch to the device and run the model; return (inputs, outputs, targets)."""
        inputs, targets = batch
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        return inputs, self.model(inputs), targets

    def compute_loss(self, outputs, targets):
        """The training loss of one batch."""
        return self.criterion(outputs, targets)

    def compute_metrics(self, outputs, targets):
        """Metrics of one batch as {name: device tensor}; logged as train/<name> and val/<name>."""
        return classification_metrics(outputs, targets, self.args.topk)

    def gen_imgs_to_write(self, inputs, outputs, targets, split):
        """Pictures of one batch for TensorBoard as {tag: HxWx3 uint8 array}."""
        count = min(32, len(inputs))
        grid = labeled_grid(denormalize(inputs[:count]), outputs[:count].argmax(1).tolist(),
                            targets[:count].tolist(), self.class_names)
        return {f'{split}/predictions': grid}

    def train(self):
        """Train until --epochs (or --max_iteration) are done, or a stop; return the stop reason or None."""
        self.write_run_records()
        start = time.perf_counter()
        with self.signals:
            try:
                while self.stop_reason is None and self.global_step < self.max_steps:
                    self.train_per_epoch(self.epoch)
            finally:
                self.logger.close()
        self.report(time.perf_counter() - start)
        return self.stop_reason

    def train_per_epoch(self, epoch):
        """Train on epoch `epoch` (from where a resumed checkpoint left it), validating and saving on schedule.

        Returns at the end of the epoch, or early when the run has to stop.
        """
        self.model.train()
        self.train_loader.batch_sampler.set_epoch(epoch, start=self.batch_in_epoch)
        bar = progress(self.train_loader, self.args.progress_bar, f'epoch {epoch + 1}')
        start, seen = time.perf_counter(), 0
        for batch in bar:
            inputs, outputs, targets = self.step(batch)
            loss = self.compute_loss(outputs, targets)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            if self.args.scheduler != 'plateau':
                self.scheduler.step()
            self.global_step += 1
            self.batch_in_epoch += 1
            self.watch_loss(loss)

            count = len(targets)
            seen += count
            self.logger.record_scalar('train/loss', loss, count)
            for name, value in self.compute_metrics(outputs.detach(), targets).items():
                self.logger.record_scalar(f'train/{name}', value, count)
            if self.global_step % self.args.print_freq == 0:  # the only host syncs between validations
                self.check_loss_finite()
                self.print_progress(seen / (time.perf_counter() - start))
            if self.batch_in_epoch == self.updates_per_epoch:  # so a checkpoint saved now records a whole epoch
                self.epoch, self.batch_in_epoch = epoch + 1, 0
                self.history.end_epoch()
            self.after_update()
            if self.stop_reason or self.global_step >= self.max_steps:
                break
        bar.close()

    def watch_loss(self, loss):
        """Note, on the device and without waiting for it, the first step whose loss is not finite."""
        self.device_step += 1
        bad = ~torch.isfinite(loss.detach())
        self.nonfinite_step = torch.where(bad & (self.nonfinite_step < 0), self.device_step, self.nonfinite_step)

    def check_loss_finite(self):
        """Read the non-finite flag (a host sync); on a bad loss set the stop reason and return False."""
        step = int(self.nonfinite_step)
        if step >= 0 and not self.stop_reason:
            self.stop_reason = f'non-finite loss at step {step}'
        return step < 0

    def position(self):
        """Where the run is, for printed lines: `epoch 3/12 step 5/46`, `epoch 3/12`, or `step 40/100`."""
        if self.args.max_iteration:
            return f'step {self.global_step}/{self.max_steps}'
        if self.batch_in_epoch == 0:
            return f'epoch {self.epoch}/{self.args.epochs}'
        return f'epoch {self.epoch + 1}/{self.args.epochs} step {self.batch_in_epoch}/{self.updates_per_epoch}'

    def print_progress(self, images_per_second):
        """One line of running train metrics, learning rate and throughput."""
        running = ' '.join(f'{k} {v:.4f}' for k, v in self.logger.recorder.means().items())
        tqdm.write(f'{self.position()} {running} lr {self.optimizer.param_groups[0]["lr"]:.2e} '
                   f'{images_per_second:.0f} img/s')

    def after_update(self):
        """Validate, save and decide whether to stop, as --valid_interval/--save_interval and signals say."""
        args, step = self.args, self.global_step
        if self.signals.received:
            self.stop_reason = f'stopped by {self.signals.received}'
        finished = step >= self.max_steps
        epoch_ended = self.batch_in_epoch == 0
        due = (step % args.valid_interval == 0) if args.valid_interval else epoch_ended
        metrics = None
        if (due or finished) and not self.stop_reason:
            metrics = self.validate()
        due_save = args.save_interval is not None and step % args.save_interval == 0
        if metrics is not None or due_save or finished or self.stop_reason:
            self.save_checkpoint(metrics)

    def validate(self):
        """Close the train/* means, run validation, update history, best metric and early stopping."""
        self.logger.record_scalar('train/lr', self.optimizer.param_groups[0]['lr'])
        metrics = self.logger.save_curves(self.global_step)
        metrics.update(self.val_per_epoch(self.epoch))
        for name, value in metrics.items():
            self.history.update_metric(name, value)
        if self.args.monitor not in metrics:
            raise KilnError(f'--monitor {self.args.monitor} is not a logged metric; '
                            f'choose one of: {", ".join(sorted(metrics))}')
        value = metrics[self.args.monitor]
        if self.args.scheduler == 'plateau':
            self.scheduler.step(value)
        improved = math.isfinite(value) and (self.best_metric is None or self.is_better(value, self.best_metric))
        if improved:
            self.best_metric = value
        self.update_early_stop(value)
        shown = ' '.join(f'{k} {v:.4f}' for k, v in metrics.items() if k != 'train/lr')
        print(f'{self.position()} {shown}{" (best)" if improved else ""}', flush=True)
        return metrics

    def is_better(self, value, than, margin=0.0):
        """Whether --monitor value `value` beats `than` by more than `margin`."""
        return value > than + margin if self.args.monitor_mode == 'max' else value < than - margin

    def update_early_stop(self, value):
        """Count validations without an improvement of more than --early_stop_min_delta; stop after the patience."""
        state, patience = self.early_stop, self.args.early_stop_patience
        if state['best'] is None or (math.isfinite(value)
                                     and self.is_better(value, state['best'], self.args.early_stop_min_delta)):
            state['best'], state['waited'] = value, 0
        else:
            state['waited'] += 1
        if patience and state['waited'] >= patience and not self.stop_reason:
            self.stop_reason = f'early stop: {self.args.monitor} did not improve for {patience} validations'

    @torch.no_grad()
    def val_per_epoch(self, epoch):
        """One pass over the validation data in eval mode; returns the mean val/* metrics."""
        self.model.eval()
        for i, batch in enumerate(progress(self.val_loader, self.args.progress_bar, f'val {epoch}')):
            inputs, outputs, targets = self.step(batch)
            count = len(targets)
            self.logger.record_scalar('val/loss', self.compute_loss(outputs, targets), count)
            for name, value in self.compute_metrics(outputs, targets).items():
                self.logger.record_scalar(f'val/{name}', value, count)
            if i == 0 and self.args.log_images:
                self.logger.save_imgs(self.gen_imgs_to_write(inputs, outputs, targets, 'val'), self.global_step)
        self.model.train()
        return self.logger.save_curves(self.global_step)

    def save_checkpoint(self, metrics=None):
        """Save the full state (never one reached through a non-finite loss); best.pth when --monitor improved."""
        if not self.check_loss_finite():
            return
        value = metrics.get(self.args.monitor) if metrics else None
        name = f'epoch{self.epoch:03d}_step{self.global_step:07d}.pth'
        self.logger.save_check_point(self.state_dict(), name, value if value is not None and math.isfinite(value)
                                     else None)
        self.history.save_json(os.path.join(self.args.model_dir, 'history.json'))

    def state_dict(self):
        """Everything needed to continue this run exactly: weights, optimizer, scheduler, position
        in the data, random states, metrics so far, early-stopping state, and the args."""
        return {
            'model': unwrap_model(self.model).state_dict(),
            'optimizer': self.optimizer.state_dict(),
            'scheduler': self.scheduler.state_dict(),
            'epoch': self.epoch,
            'batch_in_epoch': self.batch_in_epoch,
            'global_step': self.global_step,
            'data_order': torch.tensor(self.train_loader.batch_sampler.order(self.epoch), dtype=torch.int32),
            'rng': rng_states(),
            'best_metric': self.best_metric,
            'early_stop': dict(self.early_stop),
            'history': self.history.state_dict(),
            'recorder': self.logger.recorder.state_dict(),
            'class_names': self.class_names,
            'args': {k: v for k, v in vars(self.args).items() if k not in NOT_SAVED},
        }

    def load_state_dict(self, checkpoint):
        """Continue from a checkpoint written by `state_dict` (the recorder is restored by __init__)."""
        path = self.args.resume_from
        try:
            unwrap_model(self.model).load_state_dict(checkpoint['model'])
            self.optimizer.load_state_dict(checkpoint['optimizer'])
            self.scheduler.load_state_dict(checkpoint['scheduler'])
            self.epoch, self.batch_in_epoch = checkpoint['epoch'], checkpoint['batch_in_epoch']
            self.global_step = checkpoint['global_step']
            order = checkpoint['data_order']
            rng = checkpoint['rng']
            self.best_metric, self.early_stop = checkpoint['best_metric'], dict(checkpoint['early_stop'])
            self.history.load_state_dict(checkpoint['history'])
        except KeyError as error:
            raise KilnError(f'{path} is not a full training checkpoint (it has no {error}); to start a new run '
                            f'from its weights use --load_model_path instead of --resume') from None
        except (ValueError, RuntimeError) as error:
            raise KilnError(f'{path} does not fit the current options ({str(error).splitlines()[0]}); '
                            f'resume with the options it was trained with') from None
        if order.tolist() != self.train_loader.batch_sampler.order(self.epoch):
            raise KilnError(f'the training data or --seed differ from those of {path}; resume with the same '
                            f'--train_list and --seed')
        self.device_step.fill_(self.global_step)
        set_rng_states(rng)
        print(f'resuming {path}: epoch {self.epoch + 1}, batch {self.batch_in_epoch}, step {self.global_step}')

    def write_run_records(self):
        """Write run_config.json and add this start to reproduce.json in the experiment folder."""
        args = self.args
        TrainerRunConfig(
            num_epochs=math.ceil(self.max_steps / self.updates_per_epoch), per_device_batch_size=args.batch_size,
            total_batch_size=args.batch_size, gradient_accumulation_steps=1, gradient_clip_value=None,
            num_update_steps_per_epoch=self.updates_per_epoch, max_num_train_steps=self.max_steps, world_size=1,
            is_local_process_zero=True, is_world_process_zero=True, is_distributed=False, mixed_precision='off',
        ).save(args.model_dir)
        append_reproducibility_record(args.model_dir, args)

    def report(self, seconds):
        """Say how the run ended and where its files are."""
        folder, monitor = self.args.model_dir, self.args.monitor
        best = 'none' if self.best_metric is None else f'{self.best_metric:.4f}'
        ending = self.stop_reason or 'done'
        print(f'{ending} after {seconds:.0f}s at step {self.global_step}; best {monitor} {best}\n'
              f'  checkpoints: {folder}/best.pth, {folder}/last.pth\n'
              f'  TensorBoard: tensorboard --logdir {self.args.checkpoints_dir}\n'
              f'  evaluate:    python eval.py --load_model_path {folder}/best.pth\n'
              f'  continue:    python train.py --resume {folder}/last.pth', flush=True)


def main(argv=None):
    """Parse the options, make (or reopen, with --resume) the experiment folder and train."""
    args = prepare_train_args(argv)
    # a failed setup removes a folder it just made, never one that --resume reopened
    guard = contextlib.nullcontext() if args.resume else discard_folder_if_setup_fails(args.model_dir)
    with guard:
        trainer = Trainer(args)
    trainer.train()
    if trainer.stop_reason and trainer.stop_reason.startswith('non-finite'):
        raise KilnError(f'{trainer.stop_reason}; nothing after it was saved. Lower --lr (or clip gradients) and '
                        f'continue from the last good checkpoint with --resume {args.model_dir}/last.pth')
    if trainer.signals.received:
        sys.exit(128 + signal.Signals[trainer.signals.received].value)


if __name__ == '__main__':
    run_cli(main)
