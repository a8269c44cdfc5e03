"""Train a model: `python train.py --help`.

The Trainer is a plain class: adapt it to a new task by overriding `step`, `compute_loss`,
`compute_metrics` and `gen_imgs_to_write` (or any other method) in a subclass.
"""
import time

STARTED = time.perf_counter()  # for the time-to-first-step figure

from options import parse_args, parse_train_args  # noqa: E402

if __name__ == '__main__':
    parse_args(parse_train_args)  # answer --help and option mistakes before the slow torch import

import contextlib
import math
import os
import signal
import sys

import torch
from tqdm import tqdm

from data.augment import denormalize
from data.data_entry import DATASETS, select_eval_loader, select_train_loader
from loss import select_loss
from metrics import classification_metrics, segmentation_metrics
from model.model_entry import equip_multi_gpu, select_model
from options import NOT_SAVED, discard_folder_if_setup_fails, prefix_map, prepare_train_args
from utils.checkpoint import atomic_write_json, load_checkpoint
from utils.distributed import (all_gather_objects, all_reduce_max, barrier, cleanup_distributed, collective_device,
                               init_distributed, is_distributed, is_main_process, local_rank, rank,
                               run_on_main_process, world_size)
from utils.errors import KilnError, run_cli
from utils.freezer import ModelFreezer
from utils.logger import Logger, progress
from utils.run_history import InMemoryRunHistory
from utils.run_record import TrainerRunConfig, append_reproducibility_record
from utils.stop_signals import StopSignals
from utils.torch_utils import (autocast_for, load_weights, place_model, rng_states, select_device, set_deterministic,
                               set_rng_states, set_seed, to_device, unwrap_model)
from utils.viz import labeled_grid, segmentation_grid

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


def _add_group_to_scheduler(scheduler, base_lr, lr):
    """Give a scheduler made for fewer param groups the per-group state of one more."""
    for name, value in (('base_lrs', base_lr), ('_last_lr', lr)):
        if isinstance(getattr(scheduler, name, None), list):
            getattr(scheduler, name).append(value)
    for name in ('lr_lambdas', 'min_lrs'):  # LambdaLR, ReduceLROnPlateau: the same as the first group
        if isinstance(getattr(scheduler, name, None), list):
            getattr(scheduler, name).append(getattr(scheduler, name)[0])


class Trainer:
    """Trains `--model_type` on `--data_type`, validating and checkpointing on schedule.

    Everything a run needs to continue exactly after a kill lives in `state_dict()`. The loop is
    `train` -> `train_per_epoch`, which runs `step`/`compute_loss` on each batch and, every
    --grad_accum_steps batches, `optimizer_step` and `after_update`. Under torchrun the same code
    runs in every process; rank 0 alone writes files and prints.
    """

    default_monitor = 'val/acc'  # --monitor when not given

    def __init__(self, args):
        self.args = args
        args.monitor = args.monitor or self.default_monitor
        set_seed(args.seed)
        set_deterministic(args.deterministic)
        self.device = select_device(args)
        self.train_loader = select_train_loader(args)
        args.num_classes = args.num_classes or self.train_loader.dataset.num_classes
        self.val_loader = select_eval_loader(args)
        self.class_names = self.train_loader.dataset.class_names
        model = select_model(args)
        self.load_report = None
        if args.load_model_path:
            self.load_report = load_weights(model, args.load_model_path, strict=not args.load_not_strict,
                                            prefix_map=prefix_map(args))
        self.freezer = ModelFreezer(model, args.freeze_batch_norms)
        if args.freeze_to is not None:
            try:
                self.freezer.freeze(0, args.freeze_to, set_modules_as_eval=args.freeze_batch_norms)
            except IndexError as error:
                raise KilnError(f'--freeze_to {args.freeze_to}: {error}') from None
        self.compiled = place_model(model, args, self.device)
        self.model = equip_multi_gpu(self.compiled, args)
        self.criterion = select_loss(args.loss)
        self.batches_per_epoch = len(self.train_loader)
        self.updates_per_epoch = math.ceil(self.batches_per_epoch / args.grad_accum_steps)
        self.max_steps = args.max_iteration or args.epochs * self.updates_per_epoch
        self.optimizer = self.make_optimizer()
        self.scheduler = self.make_scheduler()
        self.autocast = autocast_for(self.device, args.amp)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=args.amp == 'fp16')
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
        self.stop_signal = None  # the signal that stopped the run
        self.signals = StopSignals()
        self.first_step_seconds = None
        checkpoint = load_checkpoint(args.resume_from) if args.resume_from else None
        if checkpoint is not None:
            self.load_state_dict(checkpoint)
        self.logger = Logger(args.model_dir, args.keep_last, args.keep_best, args.monitor_mode,
                             purge_step=self.global_step + 1 if checkpoint is not None else None,
                             tensorboard=args.tensorboard)
        if checkpoint is not None and is_main_process():  # the saved sums are those of all ranks
            self.logger.recorder.load_state_dict(checkpoint['recorder'])
        if self.load_report is not None and is_main_process():
            atomic_write_json({'source': args.load_model_path, **self.load_report.to_dict()},
                              os.path.join(args.model_dir, 'load_report.json'))

    def make_optimizer(self):
        """The optimizer named by --optimizer over the trainable parameters: the last layer group
        (the head) at --head_lr, the others at --backbone_lr (both default to --lr)."""
        args = self.args
        head = {id(p) for p in self.freezer.get_layer_groups()[-1].parameters()}
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{'params': params, 'lr': lr, 'base_lr': lr} for params, lr in (
            ([p for p in trainable if id(p) not in head], args.backbone_lr or args.lr),
            ([p for p in trainable if id(p) in head], args.head_lr or args.lr)) if params]
        return OPTIMIZERS[args.optimizer](groups, args)

    def unfreeze(self):
        """Unfreeze every layer group (--unfreeze_at_epoch): its parameters join the live optimizer as
        new param groups at --unfrozen_lr_scale x --backbone_lr, following the schedule from here on."""
        args, first = self.args, self.optimizer.param_groups[0]
        progress_factor = first['lr'] / first['base_lr']  # how far the schedule has moved the learning rate
        for group in self.freezer.unfreeze(-1, 0):
            base = (args.backbone_lr or args.lr) * args.unfrozen_lr_scale
            group.update(lr=base * progress_factor, base_lr=base, initial_lr=base)
            self.optimizer.add_param_group(group)
            _add_group_to_scheduler(self.scheduler, base, base * progress_factor)
        if is_distributed():  # DDP syncs only the parameters that were trainable when it wrapped the model
            self.model = equip_multi_gpu(self.compiled, args)
        self.set_train_mode()

    def is_unfrozen(self):
        """Whether --unfreeze_at_epoch has taken effect at the current position."""
        when = self.args.unfreeze_at_epoch
        return when is not None and (self.epoch + 1 > when or (self.epoch + 1 == when and self.batch_in_epoch > 0))

    def set_train_mode(self):
        """Training mode, except for modules frozen in eval mode (--freeze_batch_norms)."""
        self.model.train()
        self.freezer.keep_eval_modes()

    def make_scheduler(self):
        """The learning-rate schedule named by --scheduler (see SCHEDULERS), in optimizer steps."""
        return SCHEDULERS[self.args.scheduler](self.optimizer, self.args, self.max_steps, self.updates_per_epoch)

    def step(self, batch):
        """Move one batch to the device and run the model; return (inputs, outputs, targets)."""
        inputs, targets = to_device(batch, self.device, self.args.channels_last)
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
        if is_main_process():
            self.write_run_records()
            shown = {k: v for k, v in sorted(vars(self.args).items()) if k not in NOT_SAVED}
            self.logger.save_text('args', '\n'.join(f'    {k}: {v}' for k, v in shown.items()), self.global_step)
        start = time.perf_counter()
        with self.signals:
            try:
                while self.stop_reason is None and self.global_step < self.max_steps:
                    self.train_per_epoch(self.epoch)
            finally:
                if self.history.get_metric_names():
                    self.logger.save_hparams(self.hparams(), self.final_metrics())
                self.logger.close()
        if is_main_process():
            self.report(time.perf_counter() - start)
        return self.stop_reason

    def hparams(self):
        """The options shown in TensorBoard's HParams tab (numbers, strings and booleans only)."""
        names = ('task', 'model_type', 'data_type', 'optimizer', 'lr', 'batch_size', 'grad_accum_steps', 'epochs',
                 'max_iteration', 'scheduler', 'weight_decay', 'amp', 'seed', 'load_model_path', 'freeze_to')
        return {name: getattr(self.args, name) if isinstance(getattr(self.args, name), (int, float, str, bool))
                else str(getattr(self.args, name)) for name in names}

    def final_metrics(self):
        """The last value of every metric and the best --monitor value, for the HParams tab."""
        metrics = {f'final/{name}': self.history.get_latest_metric(name) for name in sorted(self.history.get_metric_names())}
        if self.best_metric is not None:
            metrics[f'best/{self.args.monitor}'] = self.best_metric
        return metrics

    def train_per_epoch(self, epoch):
        """Train on epoch `epoch` (from where a resumed checkpoint left it), validating and saving on schedule.

        Returns at the end of the epoch, or early when the run has to stop.
        """
        if self.args.unfreeze_at_epoch == epoch + 1 and self.batch_in_epoch == 0:
            self.unfreeze()
        self.set_train_mode()
        self.train_loader.batch_sampler.set_epoch(epoch, start=self.batch_in_epoch)
        bar = progress(self.train_loader, self.args.progress_bar and is_main_process(), f'epoch {epoch + 1}')
        accumulate, start, seen = self.args.grad_accum_steps, time.perf_counter(), 0
        for batch in bar:
            # the batches of one update: --grad_accum_steps of them, fewer at the end of the epoch
            group_start = self.batch_in_epoch // accumulate * accumulate
            group_size = min(accumulate, self.batches_per_epoch - group_start)
            self.batch_in_epoch += 1
            update = self.batch_in_epoch == group_start + group_size
            with self.gradient_sync(update):
                with self.autocast():
                    inputs, outputs, targets = self.step(batch)
                    loss = self.compute_loss(outputs, targets)
                self.scaler.scale(loss / group_size).backward()
            self.watch_loss(loss)
            count = len(targets)
            seen += count
            self.logger.record_scalar('train/loss', loss, count)
            for name, value in self.compute_metrics(outputs.detach(), targets).items():
                self.logger.record_scalar(f'train/{name}', value, count)
            if not update:
                continue

            self.optimizer_step()
            if self.global_step % self.args.print_freq == 0:  # the only host syncs between validations
                self.agree_on_stop()
                self.print_progress(seen / (time.perf_counter() - start))
            if self.batch_in_epoch == self.batches_per_epoch:  # so a checkpoint saved now records a whole epoch
                self.epoch, self.batch_in_epoch = epoch + 1, 0
                self.history.end_epoch()
            self.after_update()
            if self.stop_reason or self.global_step >= self.max_steps:
                break
        bar.close()

    def gradient_sync(self, update):
        """DistributedDataParallel averages gradients only on the batch that ends an update."""
        if update or not isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def optimizer_step(self):
        """Unscale and clip the accumulated gradients, step the optimizer and the schedule."""
        args = self.args
        if args.clip_grad_norm or args.clip_grad_value:
            self.scaler.unscale_(self.optimizer)
            params = [p for group in self.optimizer.param_groups for p in group['params']]
            if args.clip_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, args.clip_grad_norm)
            if args.clip_grad_value:
                torch.nn.utils.clip_grad_value_(params, args.clip_grad_value)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if args.scheduler != 'plateau':
            self.scheduler.step()
        self.global_step += 1
        self.device_step += 1
        if self.first_step_seconds is None:
            self.first_step_seconds = time.perf_counter() - STARTED

    def watch_loss(self, loss):
        """Note, on the device and without waiting for it, the first step whose loss is not finite."""
        bad = ~torch.isfinite(loss.detach())
        self.nonfinite_step = torch.where(bad & (self.nonfinite_step < 0), self.device_step + 1, self.nonfinite_step)

    def agree_on_stop(self):
        """Read the stop flags, a non-finite loss or a signal (a host sync; under torchrun all ranks
        take the same decision). Sets the stop reason; returns False after a non-finite loss."""
        flags = torch.stack([self.nonfinite_step, torch.tensor(self.signals.received or 0, device=self.device)])
        bad_step, signum = all_reduce_max(flags.to(collective_device())).tolist()
        if bad_step >= 0:
            self.stop_reason = f'non-finite loss at step {bad_step}'
        elif signum and not self.stop_reason:
            self.stop_by_signal(signum)
        return bad_step < 0

    def stop_by_signal(self, signum):
        """Stop the run because of signal `signum` (saving first)."""
        self.stop_signal = signum
        self.stop_reason = f'stopped by {signal.Signals(signum).name}'

    def position(self):
        """Where the run is, for printed lines: `epoch 3/12 step 5/46`, `epoch 3/12`, or `step 40/100`."""
        if self.args.max_iteration:
            return f'step {self.global_step}/{self.max_steps}'
        if self.batch_in_epoch == 0:
            return f'epoch {self.epoch}/{self.args.epochs}'
        updates = math.ceil(self.batch_in_epoch / self.args.grad_accum_steps)
        return f'epoch {self.epoch + 1}/{self.args.epochs} step {updates}/{self.updates_per_epoch}'

    def print_progress(self, images_per_second):
        """One line of running train metrics (this process's), learning rate and throughput."""
        if is_main_process():
            running = ' '.join(f'{k} {v:.4f}' for k, v in self.logger.recorder.means().items())
            tqdm.write(f'{self.position()} {running} lr {self.optimizer.param_groups[0]["lr"]:.2e} '
                       f'{images_per_second * world_size():.0f} img/s')

    def after_update(self):
        """Validate, save and decide whether to stop, as --valid_interval/--save_interval and signals say."""
        args, step = self.args, self.global_step
        if self.signals.received and not is_distributed():  # under torchrun, agreed at print intervals
            self.stop_by_signal(self.signals.received)
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
        if is_main_process():
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
        """One pass over the validation data in eval mode; returns the mean val/* metrics over all ranks."""
        self.model.eval()
        bar = progress(self.val_loader, self.args.progress_bar and is_main_process(), f'val {epoch}')
        for i, batch in enumerate(bar):
            with self.autocast():
                inputs, outputs, targets = self.step(batch)
                loss = self.compute_loss(outputs, targets)
            count = len(targets)
            self.logger.record_scalar('val/loss', loss, count)
            for name, value in self.compute_metrics(outputs, targets).items():
                self.logger.record_scalar(f'val/{name}', value, count)
            if i == 0 and self.args.log_images and self.logger.writer:
                self.logger.save_imgs(self.gen_imgs_to_write(inputs, outputs.float(), targets, 'val'), self.global_step)
        self.set_train_mode()
        return self.logger.save_curves(self.global_step)

    def save_checkpoint(self, metrics=None):
        """Save the full state (never one reached through a non-finite loss); best.pth when --monitor improved.

        Every rank takes part (the state gathers all ranks' random states); rank 0 writes.
        """
        if not self.agree_on_stop():
            return
        state = self.state_dict()
        if is_main_process():
            value = metrics.get(self.args.monitor) if metrics else None
            name = f'epoch{self.epoch:03d}_step{self.global_step:07d}.pth'
            self.logger.save_check_point(state, name, value if value is not None and math.isfinite(value) else None)
            self.history.save_json(os.path.join(self.args.model_dir, 'history.json'))
        barrier()

    def state_dict(self):
        """Everything needed to continue this run exactly: weights, optimizer, scheduler, gradient scaler,
        position in the data, random states (of every rank), metrics so far, early stopping, and the args."""
        return {
            'model': unwrap_model(self.model).state_dict(),
            'optimizer': self.optimizer.state_dict(),
            'scheduler': self.scheduler.state_dict(),
            'scaler': self.scaler.state_dict(),
            'epoch': self.epoch,
            'batch_in_epoch': self.batch_in_epoch,
            'global_step': self.global_step,
            'data_order': torch.tensor(self.train_loader.batch_sampler.order(self.epoch), dtype=torch.int32),
            'rng': all_gather_objects(rng_states()),
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
            self.epoch, self.batch_in_epoch = checkpoint['epoch'], checkpoint['batch_in_epoch']
            if self.is_unfrozen():  # the saved optimizer has the unfrozen param groups too
                self.unfreeze()
            self.optimizer.load_state_dict(checkpoint['optimizer'])
            self.scheduler.load_state_dict(checkpoint['scheduler'])
            self.scaler.load_state_dict(checkpoint['scaler'])
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
        set_rng_states(rng[rank()] if len(rng) == world_size() else rng[0])
        if is_main_process():
            print(f'resuming {path}: epoch {self.epoch + 1}, batch {self.batch_in_epoch}, step {self.global_step}')

    def write_run_records(self):
        """Write run_config.json and add this start to reproduce.json in the experiment folder."""
        args = self.args
        TrainerRunConfig(
            num_epochs=math.ceil(self.max_steps / self.updates_per_epoch), per_device_batch_size=args.batch_size,
            total_batch_size=args.batch_size * args.grad_accum_steps * world_size(),
            gradient_accumulation_steps=args.grad_accum_steps,
            gradient_clip_value=args.clip_grad_norm or args.clip_grad_value,
            num_update_steps_per_epoch=self.updates_per_epoch, max_num_train_steps=self.max_steps,
            world_size=world_size(), is_local_process_zero=local_rank() == 0, is_world_process_zero=rank() == 0,
            is_distributed=is_distributed(), mixed_precision=args.amp,
        ).save(args.model_dir)
        append_reproducibility_record(args.model_dir, args)

    def report(self, seconds):
        """Say how the run ended and where its files are."""
        folder, monitor = self.args.model_dir, self.args.monitor
        best = 'none' if self.best_metric is None else f'{self.best_metric:.4f}'
        first = '' if self.first_step_seconds is None else f' (first step {self.first_step_seconds:.1f}s after start)'
        print(f'{self.stop_reason or "done"} after {seconds:.0f}s at step {self.global_step}{first}; '
              f'best {monitor} {best}\n'
              f'  checkpoints: {folder}/best.pth, {folder}/last.pth\n'
              f'  TensorBoard: tensorboard --logdir {self.args.checkpoints_dir}\n'
              f'  evaluate:    python eval.py --load_model_path {folder}/best.pth\n'
              f'  continue:    python train.py --resume {folder}/last.pth', flush=True)


class SegmentationTrainer(Trainer):
    """Per-pixel classification (--task segment): the loop, loss and checkpoints are the Trainer's;
    only the metrics (pixel accuracy, mean IoU) and the pictures (image | predicted | true mask) differ."""

    default_monitor = 'val/miou'

    def __init__(self, args):
        if args.data_type in DATASETS and getattr(DATASETS[args.data_type], 'target', None) != 'mask':
            raise KilnError(f'--task segment needs a dataset of masks, not --data_type {args.data_type}: '
                            f'use shapes_seg or seg_list (and --model_type seg_net)')
        super().__init__(args)

    def compute_metrics(self, outputs, targets):
        return segmentation_metrics(outputs, targets, self.args.num_classes)

    def gen_imgs_to_write(self, inputs, outputs, targets, split):
        count = min(8, len(inputs))
        return {f'{split}/segmentation': segmentation_grid(denormalize(inputs[:count]), outputs[:count].argmax(1),
                                                           targets[:count], self.args.num_classes)}


TRAINERS = {'classify': Trainer, 'segment': SegmentationTrainer}  # --task; a new task is one more line


def main(argv=None):
    """Join torchrun's processes if any, make (or reopen, with --resume) the experiment folder, and train."""
    init_distributed(parse_args(parse_train_args, argv))
    try:
        args = run_on_main_process(prepare_train_args, argv)
        # a failed setup removes a folder it just made, never one that --resume reopened
        fresh = is_main_process() and not args.resume
        with discard_folder_if_setup_fails(args.model_dir) if fresh else contextlib.nullcontext():
            trainer = TRAINERS[args.task](args)
        trainer.train()
    finally:
        cleanup_distributed()
    if trainer.stop_reason and trainer.stop_reason.startswith('non-finite'):
        raise KilnError(f'{trainer.stop_reason}; nothing after it was saved. Lower --lr (or clip gradients) and '
                        f'continue from the last good checkpoint with --resume {args.model_dir}/last.pth')
    if trainer.stop_signal:
        sys.exit(128 + trainer.stop_signal)


if __name__ == '__main__':
    run_cli(main)
