"""Train a model: `python train.py --help`.

Read it top down: `main` resolves the options and the experiment folder once, `Trainer.build` makes
every part of the run from them (each part lives in a file named by its one job), and
`Trainer.train` is the loop, in one screen; the pieces a new kind of training changes are methods
of their own (`train_step`, `optimizer_step`, `validate`, `save`). A new task, dataset or model is a
file plus a registry line; nothing here changes for it.
"""

import time

STARTED = time.perf_counter()  # for the time-to-first-step figure: the first run's counts its imports too

from utils.errors import (
    TRAINING_STEPS,
    KilnError,
    is_peer_lost,
    listed,
    quiet_interrupts,
    run_cli,
    run_to_exit,
    shell_word,
)

if __name__ == '__main__':  # a Ctrl-C while torch loads: one line, exit 130 (imported, it changes no handler)
    quiet_interrupts()
from options import parse_args, parse_train_args

if __name__ == '__main__':
    ARGS = run_cli(lambda argv: parse_args(parse_train_args, argv))  # --help and mistakes answer before torch loads

import contextlib
import math
import os
import sys

import torch

from data.augment import AUGMENTATIONS, MIXES, augmentation_names
from data.data_entry import resize_of, select_dataset
from data.list_dataset import classes_only_validated, match_classes
from data.loader import Batches
from options import (
    PROJECT,
    as_trained,
    command_words,
    ignored_options,
    option_defaults,
    prefix_map,
    resolve,
    saved_options,
)
from tasks.task_entry import TASKS, task_class
from utils.allocator import keep_freed_memory
from utils.checkpoint import atomic_write_json, load_checkpoint, unwrap_model
from utils.checkpoint_keeper import BEST, LAST, CheckpointKeeper, end_written, verify
from utils.checkpointer import Checkpointer, Position, RandomStates, TrainingData
from utils.debug import training_profiler
from utils.device import select_device
from utils.distributed import (
    barrier,
    cleanup_distributed,
    init_distributed,
    is_distributed,
    is_main_process,
    local_rank,
    rank,
    run_on_main_process,
    world_size,
)
from utils.ema import ModelEma
from utils.evaluation import evaluate
from utils.finetune import FineTuning
from utils.logger import Logger
from utils.model_setup import setup_model
from utils.monitor import Monitor
from utils.progress import progress, write_line
from utils.run_folder import (
    checkpoint_path,
    discard_folder_if_setup_fails,
    open_experiment,
    remove_unused_runs,
    resumed_on_cpu,
    set_aside_newer,
)
from utils.run_history import RunHistory, write_history_json
from utils.run_records import TrainerRunConfig, append_reproducibility_record, reproducibility_record, save_args
from utils.seeding import process_settings_kept, set_deterministic, set_seed
from utils.stopping import StoppedWaitingForData, Stopper, StopReason
from utils.trackers import build_trackers, keeps_pictures

# `fused`: one kernel per step; with --amp fp16 on a GPU it also takes GradScaler's inf check on the
# device, where the plain optimizers have GradScaler read it on the host at every step (a sync)
OPTIMIZERS = {
    'sgd': lambda groups, o, fused: torch.optim.SGD(
        groups, o.lr, momentum=o.momentum, weight_decay=o.weight_decay, fused=fused
    ),
    'adam': lambda groups, o, fused: torch.optim.Adam(groups, o.lr, weight_decay=o.weight_decay, fused=fused),
    'adamw': lambda groups, o, fused: torch.optim.AdamW(groups, o.lr, weight_decay=o.weight_decay, fused=fused),
}


def _warmup_cosine(optimizer, o, total_steps, steps_per_epoch):
    def factor(step):
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        done = (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, done)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --scheduler name -> builder(optimizer, options, total optimizer steps, optimizer steps per epoch)
SCHEDULERS = {
    'none': lambda optimizer, o, total, per_epoch: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    'cosine': _warmup_cosine,
    'step': lambda optimizer, o, total, per_epoch: torch.optim.lr_scheduler.StepLR(
        optimizer, o.lr_step_epochs * per_epoch, o.lr_gamma
    ),
    'plateau': lambda optimizer, o, total, per_epoch: torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode=o.monitor_mode, factor=o.lr_gamma, patience=o.lr_patience
    ),
}


def batches(options, task, dataset, device, train):
    """The train or validation batches of `dataset` as the options ask (see data/loader.py)."""
    overfit = options.overfit_batches
    augment = augmentation_names(options.augment, getattr(dataset, 'augment', ())) if train and not overfit else ()
    if 'resized_crop' in augment and callable(getattr(dataset, 'decode_crops', None)):  # read from disk
        dataset.decode_crops(AUGMENTATIONS['resized_crop'](options.img_size, options))  # from the full image
        augment = tuple(name for name in augment if name != 'resized_crop')
    limit = overfit or (options.limit_train_batches if train else options.limit_val_batches)
    return Batches(
        dataset,
        device,
        batch_size=options.batch_size,
        shuffle=train or bool(overfit),
        seed=options.seed,
        augment=augment,
        collate=task.collate,
        workers=options.num_workers,
        limit=limit,
        fixed_order=bool(overfit),
        channels_last=options.channels_last,
        image_size=options.img_size,
        options=options,
    )


def schedule_length(options, train_data):
    """(optimizer steps per epoch, optimizer steps of the whole run) for the training batches `train_data`."""
    updates_per_epoch = math.ceil(len(train_data) / options.grad_accum_steps)
    return updates_per_epoch, options.max_iteration or options.epochs * updates_per_epoch


class Trainer:
    """One training run: its parts, made by `Trainer.build` from the resolved options, and the loop
    that drives them, `train()`.

    Each part lives in a file named by its one job and carries its own state (what a checkpoint is
    made of); the Trainer's own state is the number of steps to make. A new kind of training changes
    one method: `train_step` (a second loss term, a teacher model), `optimizer_step`, `validate` or
    `save`. Subclass the Trainer and run it as train.py runs its own, from a script of yours:
    `run_to_exit(lambda argv: train.main(argv, trainer_type=MyTrainer))` (the folder, torchrun, signals,
    --fast_dev_run and one-line errors as for train.py; the run's "continue" or "train more" line names your script).
    """

    # the metrics a subclass of yours adds (e.g. 'val/kd' from its validate), that --monitor may name
    own_metrics = ()

    def __init__(
        self,
        *,
        options,
        task,
        device,
        train_data,
        val_data,
        setup,
        finetuning,
        optimizer,
        scheduler,
        scaler,
        position,
        stopper,
        monitor,
        history,
        logger,
        checkpointer,
        ema=None,
        lock=None,
        start_record=None,
    ):
        self.options, self.task, self.device = options, task, device
        self.train_data, self.val_data = train_data, val_data
        self.setup, self.finetuning = setup, finetuning  # the model (plain, compiled, wrapped) and its freezing
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.position, self.stopper, self.monitor, self.history = position, stopper, monitor, history
        self.logger, self.checkpointer = logger, checkpointer
        self.ema = ema  # the average of the weights that validation uses (--ema_decay), or None
        self.lock = lock  # the experiment folder's lock, held by rank 0 while the run lives
        self.start_record = start_record  # this start's reproducibility_record (rank 0), made when built
        self.updates_per_epoch, self.max_steps = schedule_length(options, train_data)
        self.first_step_seconds = None
        self.pictured_at = None  # when validation pictures were last logged (see --image_interval)
        self.logs_pictures = options.log_images and keeps_pictures(options.loggers)  # the same on every rank
        self.printed_at = None  # (time, samples trained) at the last printed line
        self.end_due = False  # resumed at its end, which it has yet to write (see `build`)

    @classmethod
    def build(cls, options, lock=None):
        """Every part of a training run, from the options resolved by `open_experiment` (the number of
        classes still comes from the data); with --resume, loaded from the checkpoint."""
        # git answers for reproduce.json while the data and the model load, rather than beside the first steps
        start_record = reproducibility_record(options) if is_main_process() else None
        keep_freed_memory()  # each step's batches reuse the last step's memory, not fresh pages
        set_seed(options.seed)
        set_deterministic(options.deterministic)
        torch.autograd.set_detect_anomaly(options.detect_anomaly)
        device = select_device(options.cpu, options.gpus)
        task_type = task_class(options.task)
        # --load_model_path: read first, so that a checkpoint of another task is said before the data
        source = (
            checkpoint_path(options.load_model_path) if options.load_model_path and not options.resume_from else None
        )
        if source:
            verify(source)  # against its folder's recorded checksum, as eval.py and --resume do
        weights = load_checkpoint(source) if source else None
        if weights is not None:
            check_trained_task(options, weights, source)
        train_set = select_dataset(options, 'train')
        options = options.replace(
            num_classes=options.num_classes or train_set.num_classes,
            resize=options.resize or resize_of(train_set),
        )
        check_monitor(options, task_type, cls.own_metrics, cls.__qualname__)
        task = task_type(options, train_set.class_names)
        task.check_dataset(train_set, options.data_type)
        mixing = set(augmentation_names(options.augment, getattr(train_set, 'augment', ()))) & set(MIXES)
        if mixing and not task.mixes:
            raise KilnError(
                f'--task {options.task} cannot train on mixed samples ({", ".join(sorted(mixing))}); '
                f'use --augment without them'
            )
        # --overfit_batches validates on the very batches it trains on
        val_set = train_set if options.overfit_batches else select_dataset(options, 'val')
        match_classes(val_set, task.class_names, options.train_list)  # numbers where the training data has no names
        untrained = classes_only_validated(train_set, val_set) if not options.overfit_batches else []
        if untrained and is_main_process():
            labels = listed([str(label) for label in untrained], 5)
            print(
                f'note: no training sample has label {labels}, which the validation list has: those samples count '
                f'as wrong (labels counted from 1 in one list and from 0 in the other?)'
            )
        train_data = batches(options, task, train_set, device, True)
        val_data = batches(options, task, val_set, device, False)

        checkpoint = load_checkpoint(options.resume_from) if options.resume_from else None
        imagenet_net = options.model_type.startswith(('tv_', 'timm:'))
        if imagenet_net and not (checkpoint or weights or options.pretrained_path) and is_main_process():
            print(
                f'note: --model_type {options.model_type} starts from random weights; give --pretrained_path '
                f'(a local ImageNet weights file) to fine-tune it'
            )
        setup = setup_model(
            options if checkpoint is None else options.replace(pretrained_path=None),  # resumed: its own weights
            device,
            weights,
            strict=not options.load_not_strict,
            prefix_map=prefix_map(options),
            source=source,
            wrap=False,
        )
        # freeze before wrapping for DDP, which syncs only what is trainable when it wraps
        finetuning = FineTuning(
            setup.model,
            options.freeze_to,
            options.freeze_batch_norms,
            options.unfreeze_at_epoch,
            options.unfrozen_lr_scale,
        )
        setup.wrap(options)
        groups = finetuning.param_groups(options.lr, options.head_lr, options.backbone_lr)
        fused = options.amp == 'fp16' and device.type == 'cuda' or None  # None, not False: False also turns off foreach
        optimizer = OPTIMIZERS[options.optimizer](groups, options, fused)
        updates_per_epoch, max_steps = schedule_length(options, train_data)
        epochs = math.ceil(max_steps / updates_per_epoch)
        unfreeze_at = finetuning.unfreeze_at_epoch  # None without --freeze_to: nothing is frozen to unfreeze
        resumed_at = checkpoint.get('position') if checkpoint is not None else None  # (checked as it loads)
        unfrozen = isinstance(resumed_at, dict) and finetuning.is_unfrozen(resumed_at['epoch'], resumed_at['batch'])
        if unfreeze_at is not None and unfreeze_at > epochs and not unfrozen and not options.fast_dev_run:
            longer = (  # a resumed run keeps its --unfreeze_at_epoch: only its length can change
                f'--max_iteration above {(unfreeze_at - 1) * updates_per_epoch}'
                if options.max_iteration
                else f'--epochs {unfreeze_at} or more'
            )
            advice = f'give {longer}' if checkpoint is not None else f'give an epoch up to {epochs}, or {longer}'
            raise KilnError(
                f'--unfreeze_at_epoch {options.unfreeze_at_epoch} comes after the last epoch of this run ({epochs}): '
                f'the layers frozen by --freeze_to would never train; {advice}'
            )
        scheduler = SCHEDULERS[options.scheduler](optimizer, options, max_steps, updates_per_epoch)
        scaler = torch.amp.GradScaler(device.type, enabled=options.amp == 'fp16')
        ema = ModelEma(setup.model, options.ema_decay) if options.ema_decay else None
        position, history = Position(), RunHistory()
        monitor = Monitor(
            options.monitor, options.monitor_mode, options.early_stop_patience, options.early_stop_min_delta
        )
        trackers = None
        # the others log to no tracker; nor does a finished or early-stopped run resumed (nothing new to log)
        finished = (
            checkpoint is not None
            and Checkpointer.step_of(checkpoint, options.resume_from) >= max_steps
            and not checkpoint['position'].get('validation_due')
        )
        if checkpoint is not None and isinstance(checkpoint.get('monitor'), dict):
            monitor.load_state_dict(checkpoint['monitor'])  # (again with every part in resume)
            finished = finished or monitor.exhausted()
        # ...unless it ended without its end records (killed after its last checkpoint, a full disk): it
        # writes them now (history.json, the final and best metrics, the trackers' HParams row)
        end_due = finished and not end_written(options.model_dir, Checkpointer.step_of(checkpoint, options.resume_from))
        if is_main_process() and (not finished or end_due):
            trackers = build_trackers(
                options.loggers,
                options.model_dir,
                os.path.basename(options.model_dir),
                hparams_metric_names(options),
                Checkpointer.step_of(checkpoint, options.resume_from) if checkpoint else None,
                checkpoint.get('trackers') if checkpoint else None,
                options,
            )
        logger = Logger(trackers, task)
        # the stateful parts a checkpoint is made of; `position` before the data order it checks
        parts = {
            'model': setup.model,
            'optimizer': optimizer,
            'scheduler': scheduler,
            'scaler': scaler,
            'position': position,
            'data_order': TrainingData(train_data),  # (its name in checkpoints of earlier Kilns)
            'rng': RandomStates(),
            'history': history,
            'monitor': monitor,
            'recorder': logger.recorder,
        }
        if ema is not None:
            parts['ema'] = ema
        if logger.train_metrics is not None:
            parts['train_metrics'] = logger.train_metrics
        checkpointer = Checkpointer(
            parts,
            per_process=['rng'],
            summed=[name for name in ('recorder', 'train_metrics') if name in parts],
            late_parts={'trackers': logger.trackers},
            writer=logger.writer,
        )
        trainer = cls(
            options=options,
            task=task,
            device=device,
            train_data=train_data,
            val_data=val_data,
            setup=setup,
            finetuning=finetuning,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            position=position,
            stopper=Stopper(),
            monitor=monitor,
            history=history,
            logger=logger,
            checkpointer=checkpointer,
            ema=ema,
            lock=lock,
            start_record=start_record,
        )
        trainer.end_due = end_due
        if checkpoint is not None:
            trainer.resume(checkpoint)  # refused (other data, options, ...): no file of the folder changed yet
        if is_main_process():  # rank 0 keeps the files; a resume from an older checkpoint sets the newer aside
            if checkpoint is not None and trainer.work_left():  # (one that trains nothing changes no file)
                set_aside_newer(options.model_dir, checkpoint['position']['step'])
            checkpointer.keeper = CheckpointKeeper(
                options.model_dir, options.keep_last, options.keep_best, options.monitor_mode
            )
            if checkpoint is not None and (trainer.work_left() or end_due):  # the folder's newest: its best.pth
                checkpointer.keeper.settle_best(monitor.best)  # (points at the checkpoint of its best value)
        if setup.load_report is not None and is_main_process():
            report = {'source': options.load_model_path, **setup.load_report.to_dict()}
            atomic_write_json(report, os.path.join(options.model_dir, 'load_report.json'))
        return trainer

    def resume(self, checkpoint):
        """Continue from `checkpoint` (loaded from --resume): every part's state, and the freezing it had."""
        self.checkpointer.load(checkpoint, self.options.resume_from)
        if isinstance(self.scheduler, torch.optim.lr_scheduler.LambdaLR):  # a longer --epochs: a longer schedule
            scheduler = self.scheduler  # the rate of the step to come, not the one the file's schedule ended on
            saved = self.optimizer.param_groups[0]['lr']
            for group, base, factor in zip(self.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
                group['lr'] = base * factor(scheduler.last_epoch)
            now = self.optimizer.param_groups[0]['lr']
            if not math.isclose(now, saved, rel_tol=1e-3, abs_tol=1e-12) and is_main_process():
                print(
                    f"note: the schedule is stretched to this run's {self.max_steps} steps: the learning rate of "
                    f"the next step is {now:.3g}, where the run's own schedule had {saved:.3g}"
                )
        self.stopper.check_early_stop(self.monitor)  # it had stopped early: nothing left to train
        position = self.position
        if self.finetuning.is_unfrozen(position.epoch, position.batch):  # --unfreeze_at_epoch took effect before
            self.finetuning.unfreeze()
            self.setup.wrap(self.options)
        trained_by = checkpoint.get('trainer', type(self).__qualname__)  # (absent from earlier Kilns' checkpoints)
        if trained_by != type(self).__qualname__ and is_main_process():
            print(
                f'note: {self.options.resume_from} was trained by {trained_by}, this run trains with '
                f'{type(self).__qualname__}: to keep its train_step (and the rest), resume with the script that runs '
                f'{trained_by}'
            )
        if is_main_process():
            where = self.position_text()  # as the printed lines say it, and the optimizer steps made
            steps = '' if self.options.max_iteration else f', step {position.step}'
            if position.step > self.max_steps:  # a shorter --epochs or --max_iteration than it was trained with
                steps += f', past the {self.max_steps} steps this run is set to'
            print(f'resuming {self.options.resume_from}: {where}{steps}')

    # the loop ---------------------------------------------------------------------------------------
    def train(self):
        """Train until --epochs (or --max_iteration) are done or a stop; return the Stop, or None when done."""
        o, position, stopper = self.options, self.position, self.stopper
        self.record_start()
        seen, self.pictured_at, self.saved_step = 0, time.perf_counter(), position.step
        self.printed_at = self.pictured_at, 0  # (time, samples trained) of the last printed line
        with stopper, training_profiler(o.profile, o.model_dir, self.device) as profiler:
            if position.validation_due:  # resumed from a stop signal that came before this step's validation
                self.after_update()
            while stopper.stop is None and position.step < self.max_steps:
                if self.finetuning.unfreezes_at(position.epoch, position.batch):  # --unfreeze_at_epoch
                    self.finetuning.unfreeze()
                    self.setup.wrap(o)  # DDP syncs only what was trainable when it wrapped
                self.finetuning.train_mode(self.setup.wrapped)
                epoch, epoch_batches = position.epoch, len(self.train_data)
                epoch_data = progress(
                    self.train_data.epoch(epoch, start=position.batch, stop_ends_wait=self.stop_may_end_a_wait),
                    o.progress_bar if is_main_process() else False,
                    f'epoch {epoch + 1}',
                    total=epoch_batches - position.batch,
                )
                for batch in self.until_stopped_waiting(epoch_data):
                    # the batches of one update: --grad_accum_steps of them, fewer at the end of the epoch
                    group_start = position.batch // o.grad_accum_steps * o.grad_accum_steps
                    group_size = min(o.grad_accum_steps, epoch_batches - group_start)
                    position.batch += 1
                    update = position.batch == group_start + group_size
                    seen += self.train_step(batch, group_size, update)
                    if not update:
                        continue

                    position.lr = FineTuning.shown_lr(self.optimizer)  # the rate this step applies: train/lr
                    self.optimizer_step()
                    position.step += 1
                    stopper.after_step()  # a stop signal, agreed by every process
                    profiler.step()
                    if self.first_step_seconds is None:
                        self.first_step_seconds = time.perf_counter() - STARTED
                        TRAINING_STEPS.append(self.first_step_seconds)  # a mistake from now on is worth a restart
                    if position.step % o.print_freq == 0:  # the only host sync between validations and saves
                        self.print_progress(seen)
                    if position.batch == epoch_batches:  # so a checkpoint saved now records a whole epoch
                        position.epoch, position.batch = epoch + 1, 0
                    self.after_update()
                    if stopper.stop or position.step >= self.max_steps:
                        break
        return stopper.stop

    def stop_may_end_a_wait(self):
        """Whether a stop signal may end the loop's wait for its next batch: in one process (under torchrun
        the processes agree on a step to stop at), before an update's first batch. In the middle of an
        update's batches the state is no step's (half its gradient, batch norm statistics and random
        numbers moved on): the wait goes on, the update ends, and the stop comes after it."""
        return world_size() == 1 and self.position.batch % self.options.grad_accum_steps == 0

    def until_stopped_waiting(self, batches):
        """`batches`, until a stop signal comes while the loop waits for one (a worker stuck in a read):
        then the run stops at its last step, saved now if it was not (see utils/stopping.py)."""
        try:
            yield from batches
        except StoppedWaitingForData as stopped:
            self.train_data.close(stuck=True)
            self.stopper.stop_by_signal(stopped.signum)
            if self.saved_step != self.position.step:
                self.save()

    def train_step(self, batch, group_size, update):
        """Forward, loss and backward of one batch, whose gradient counts 1/`group_size` in the update;
        `update` says that the batch ends one (DDP averages gradients only then). Records the loss and
        the train metrics on the device; returns the number of samples."""
        model, task = self.setup.wrapped, self.task
        with contextlib.nullcontext() if update or not is_distributed() else model.no_sync():
            with self.setup.autocast():
                outputs = task.forward(model, batch)
                loss = task.loss(outputs, batch)
            self.scaler.scale(loss / group_size if group_size > 1 else loss).backward()
        count = task.count(batch)
        self.stopper.watch_loss(loss, self.position.step + 1)
        self.logger.record('train/loss', loss, count)
        self.logger.record_outputs(outputs, task.metric_targets(batch))
        return count

    def optimizer_step(self):
        """Unscale and clip the accumulated gradients, step the optimizer and the schedule."""
        o = self.options
        if o.clip_grad_norm or o.clip_grad_value:
            self.scaler.unscale_(self.optimizer)
            params = [p for group in self.optimizer.param_groups for p in group['params']]
            if o.clip_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, o.clip_grad_norm)
            if o.clip_grad_value:
                torch.nn.utils.clip_grad_value_(params, o.clip_grad_value)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if o.scheduler != 'plateau':
            self.scheduler.step()
        if self.ema is not None:  # --ema_decay
            self.ema.update()

    def after_update(self):
        """Validate and save as --valid_interval / --save_interval say (and before stopping)."""
        o, step, stopper = self.options, self.position.step, self.stopper
        finished = step >= self.max_steps
        due = step % o.valid_interval == 0 if o.valid_interval else self.position.batch == 0
        # a stop signal leaves a due validation to the resumed run, which makes it first (not never)
        self.position.validation_due = (due or finished) and stopper.stop is not None
        metrics = self.validate() if (due or finished) and stopper.stop is None else None
        due_save = o.save_interval is not None and step % o.save_interval == 0
        if metrics is not None or due_save or finished or stopper.stop:
            self.save(metrics)

    def validate(self):
        """Close the train/* means, evaluate the validation split, and update history, best and early
        stopping; the curves and pictures go to the Logger. Returns the metrics (and 'improved')."""
        o, step = self.options, self.position.step
        metrics = self.logger.summary()  # train/* since the last validation, over every process
        metrics['train/lr'] = self.applied_lr()
        last = step >= self.max_steps
        pictures = self.logs_pictures and (last or time.perf_counter() - self.pictured_at >= o.image_interval)
        if self.ema is not None:
            self.ema.agree()  # every process validates the average that rank 0 saves
        evaluation = evaluate(
            self.ema.module if self.ema is not None else self.setup.wrapped,  # what best.pth and eval.py use
            self.val_data,
            self.task,
            self.setup.autocast,
            picture_batches={0} if pictures else (),
            pictures=lambda number, source: self.logger.log_pictures(source, self.task.pictures, step),
            progress_bar=o.progress_bar if is_main_process() else False,
        )
        if pictures:
            self.pictured_at = time.perf_counter()
        self.finetuning.train_mode(self.setup.wrapped)
        metrics.update({f'val/{k}': v for k, v in evaluation.metrics.items()})
        for name, value in metrics.items():
            self.history.update_metric(name, value)
        if o.monitor not in metrics:  # one of a subclass's own_metrics that this validation did not give
            raise KilnError(
                f'--monitor {o.monitor}: the validation at step {step} gave no such metric (it gave '
                f'{", ".join(sorted(metrics))}); log it there, or monitor another'
            )
        value = metrics[o.monitor]
        if o.scheduler == 'plateau':
            self.scheduler.step(value)
        improved = self.monitor.update(value)
        self.stopper.check_early_stop(self.monitor)
        self.logger.log_metrics(metrics, step, self.position.epoch)
        if is_main_process():
            shown = ' '.join(f'{k} {v:.4f}' for k, v in metrics.items() if k != 'train/lr')
            write_line(f'{self.position_text()} {shown}{" (best)" if improved else ""}')
        return dict(metrics, improved=improved)

    def save(self, metrics=None):
        """Save the full state, unless a loss or model value is no longer finite (then the run stops and
        nothing reached through it is saved); best.pth when --monitor improved. Every process takes part;
        the state is copied now and written on the Logger's writer thread."""
        if not self.stopper.check_finite(unwrap_model(self.setup.model), step=self.position.step):
            return
        metrics = metrics or {}
        monitored = metrics.get(self.options.monitor)
        extra = {
            'args': saved_options(self.options),
            'class_names': list(self.task.class_names),
            'monitor_value': monitored,
            'weights': 'ema' if self.ema is not None else 'model',  # which weights were validated: eval.py's
            'trainer': type(self).__qualname__,  # a subclass's run resumed by another Trainer is told so
        }
        self.checkpointer.save(self.position.epoch, self.position.step, monitored, bool(metrics.get('improved')), extra)
        self.saved_step = self.position.step
        self.logger.commit(self.position.step)  # after the file: every point up to this step is final
        self.write_history()

    def write_history(self, now=False):
        """history.json on the writer thread (rank 0), when the history has new values: rewritten whole, so at
        most every 30 s (`now`: at once; the run does it at its end); the checkpoint holds the history too."""
        metrics = self.history.for_file(now) if is_main_process() else None
        if metrics is not None:
            self.logger.submit(self._write_history_file, metrics)

    def _write_history_file(self, metrics):
        self.checkpointer.keeper.same_folder.check()  # the run's folder is still at its path
        write_history_json(metrics, self.folder('history.json'))

    # what the run says and writes about itself ---------------------------------------------------------
    def folder(self, name):
        """A path in the experiment folder."""
        return os.path.join(self.options.model_dir, name)

    def judged_options(self):
        """The options as this run acts on them, for the notes on flags it ignores: with the dataset's
        own augmentations where the options left them to it (its resize mode was set in `build`)."""
        o = self.options
        dataset = getattr(self.train_data.dataset, 'augment', ())
        return o.replace(augment=','.join(augmentation_names(o.augment, dataset)) or 'none')

    def position_text(self):
        """Where the run is, for printed lines: `epoch 3/12 step 5/46`, `epoch 3/12`, or `step 40/100`."""
        o, position = self.options, self.position
        if o.max_iteration:
            return f'step {position.step}/{self.max_steps}'
        if position.batch == 0:
            return f'epoch {position.epoch}/{o.epochs}'
        updates = math.ceil(position.batch / o.grad_accum_steps)
        return f'epoch {position.epoch + 1}/{o.epochs} step {updates}/{self.updates_per_epoch}'

    def applied_lr(self):
        """The learning rate of the last optimizer step (the optimizer's, before any step or from a
        checkpoint of an earlier Kiln that did not keep it)."""
        lr = self.position.lr
        return FineTuning.shown_lr(self.optimizer) if lr is None else lr

    def print_progress(self, seen):
        """One line of running train metrics (of this process), learning rate and throughput (samples per
        second of every process since the previous line; `seen`: samples this process trained so far),
        from one host read that also checks the losses since the last line (every process takes part)."""
        running = self.logger.running_means()  # a host read: the time below follows the device
        now, (then, seen_then) = time.perf_counter(), self.printed_at
        self.printed_at = now, seen
        self.stopper.check_finite(losses_finite=math.isfinite(running.get('train/loss', 0.0)), step=self.position.step)
        if is_main_process():
            shown = ' '.join(f'{k} {v:.4f}' for k, v in running.items())
            write_line(
                f'{self.position_text()} {shown} lr {self.applied_lr():.2e} '
                f'{(seen - seen_then) / (now - then) * world_size():.0f} img/s'
            )

    def record_start(self):
        """Write run_config.json, add this start to reproduce.json, write a resumed run's options (args.txt,
        args.yaml: a resume refused while the run was built changes neither) and give the trackers the
        options (the files on the writer thread). A run resumed at its end trains nothing: its records stay."""
        o = self.options
        if not (self.work_left() or self.end_due):
            return
        self.logger.log_text(
            'args', '\n'.join(f'    {k}: {v}' for k, v in sorted(saved_options(o).items())), self.position.step
        )
        self.logger.log_hparams(hparams(o))
        if not is_main_process():
            return
        config = TrainerRunConfig(
            num_epochs=math.ceil(self.max_steps / self.updates_per_epoch),
            per_device_batch_size=o.batch_size,
            total_batch_size=o.batch_size * o.grad_accum_steps * world_size(),
            gradient_accumulation_steps=o.grad_accum_steps,
            gradient_clip_norm=o.clip_grad_norm,
            gradient_clip_value=o.clip_grad_value,
            num_update_steps_per_epoch=self.updates_per_epoch,
            max_num_train_steps=self.max_steps,
            world_size=world_size(),
            is_local_process_zero=local_rank() == 0,
            is_world_process_zero=rank() == 0,
            is_distributed=is_distributed(),
            mixed_precision=o.amp,
        )
        self.logger.submit(config.save, o.model_dir)
        if o.resume:
            self.logger.submit(save_args, o, o.model_dir)
        record, self.start_record = self.start_record or reproducibility_record(o), None  # git's answers read once
        self.logger.submit(append_reproducibility_record, o.model_dir, record)

    def work_left(self):
        """Whether the run has anything to do: steps to train, or a validation a stop signal left due (False
        for a finished or early-stopped run resumed)."""
        position = self.position
        return self.stopper.stop is None and (position.step < self.max_steps or position.validation_due)

    def final_metrics(self):
        """The last value of every metric and the best --monitor value."""
        history = self.history
        metrics = {f'final/{name}': history.get_latest_metric(name) for name in sorted(history.get_metric_names())}
        if self.monitor.best is not None:
            metrics[f'best/{self.options.monitor}'] = self.monitor.best
        return metrics

    def summary_line(self):
        """What the run trains, on what, for how long and where: read at the start, it catches a wrong
        list, a class count off by a typo or a schedule of the wrong length before any time is spent."""
        o = self.options
        limited = o.overfit_batches or o.limit_train_batches or o.limit_val_batches
        used = f' (using {len(self.train_data)} and {len(self.val_data)} batches)' if limited else ''
        warmup = ''
        if o.scheduler == 'cosine' and o.warmup_steps > self.max_steps:  # (equal: --lr at the last step)
            warmup = (
                f' (the warm-up, --warmup_steps {o.warmup_steps}, outlasts them: the learning rate never reaches --lr)'
            )
        classes, steps = (
            ('class' if o.num_classes == 1 else 'classes'),
            ('step' if self.updates_per_epoch == 1 else 'steps'),
        )
        return (
            f'{o.task}: {o.model_type} on {o.data_type}, {o.num_classes} {classes}, '
            f'{len(self.train_data.dataset)} training and {len(self.val_data.dataset)} validation samples{used}; '
            f'{self.updates_per_epoch} {steps} per epoch, {self.max_steps} in all{warmup}; into {o.model_dir}'
        )

    def report(self, stop, seconds, idle=False):
        """Say how the run ended (`idle`: it had nothing left to do) and where its files are (only files
        that exist), with commands to paste (paths quoted for the shell)."""
        o, folder = self.options, self.options.model_dir
        best = f'{self.monitor.best:.4f}' if self.monitor.best is not None else 'none yet'
        first = (  # timed from train.py's first line (imports, data, model), the run's seconds from the loop's start
            ''
            if self.first_step_seconds is None
            else f' (first step {self.first_step_seconds:.1f}s after train.py started)'
        )
        lines = [
            f'{stop.message if stop else "done"} after {seconds:.0f}s at step {self.position.step}{first}; '
            f'best {o.monitor} {best}'
        ]
        if stop is None and idle:  # resumed at its end
            more = (  # --max_iteration ends the run whatever --epochs says
                f'a --max_iteration above {self.position.step} (or --max_iteration none and more --epochs)'
                if o.max_iteration
                else 'more --epochs'
            )
            lines[0] += f' (nothing left to train: give {more} to go on)'
        elif stop is not None and stop.reason == StopReason.EARLY_STOP and idle:
            lines[0] += ' (when it was saved: nothing left to train)'

        existing = [name for name in (BEST, LAST) if os.path.exists(self.folder(name))]
        if existing:
            lines.append(f'  checkpoints: {", ".join(self.folder(name) for name in existing)}')
        if 'tensorboard' in o.loggers:  # beside the other runs, or alone where a resume found it
            beside = os.path.dirname(os.path.abspath(folder)) == os.path.abspath(o.checkpoints_dir)
            lines.append(f'  TensorBoard: tensorboard --logdir {shell_word(o.checkpoints_dir if beside else folder)}')
        if BEST in existing:
            best = shell_word(self.folder(BEST))
            lines.append(f'  evaluate:    python {program("eval.py")} --load_model_path {best}')
        # where to go on from: last.pth, or the checkpoint a resume that had nothing to train was given (an
        # older one, with a shorter --epochs, say: last.pth may be a newer, longer run's end)
        continued, resumed = self.folder(LAST), self.options.resume_from
        if idle and resumed and not (os.path.isfile(continued) and os.path.samefile(resumed, continued)):
            continued = resumed
        if os.path.isfile(continued) and not o.fast_dev_run:  # (its folder goes with the next one)
            more = []  # a run that ended trains nothing more when resumed as it is: say what to change
            early = stop is not None and stop.reason == StopReason.EARLY_STOP
            if early:
                more += ['--early_stop_patience', str(2 * o.early_stop_patience)]
            if stop is None or early and self.position.step >= self.max_steps:  # a longer run than it reached
                step, epoch = self.position.step, self.position.epoch
                more += (
                    ['--max_iteration', str(2 * max(o.max_iteration, step))]
                    if o.max_iteration
                    else ['--epochs', str(2 * max(o.epochs, epoch))]
                )
            label = 'train more:' if more else 'continue:'
            lines.append(f'  {label:<13}{self.continue_command(continued, more)}')
        print('\n'.join(lines), flush=True)

    def continue_command(self, checkpoint, more=()):
        """The command that resumes `checkpoint` with the options `more` (words): train.py's, or your script's
        for a subclass (its own train_step, ...: resumed by train.py, the run would go on without them), with
        as many processes (the checkpoint's place in the data counts theirs); for a subclass made where no
        script is (a notebook), the call to make."""
        path = getattr(sys.modules['__main__'], '__file__', None)
        if type(self) is not Trainer and not path:
            return f'train.main({["--resume", checkpoint, *more]!r}, trainer_type={type(self).__qualname__})'
        count, here = world_size(), os.environ.get('LOCAL_WORLD_SIZE')
        torchrun = 'python -m utils.torchrun'  # a module of the project: found from its folder, or so
        if os.getcwd() != os.path.realpath(PROJECT):  # (getcwd gives the real path)
            torchrun = f'PYTHONPATH={shell_word(PROJECT)}${{PYTHONPATH:+:$PYTHONPATH}} python -P -m utils.torchrun'
        launch = (
            'python'
            if count == 1
            else f'{torchrun} --standalone --nproc-per-node={count}'
            if here == str(count)
            else f'torchrun ({count} processes)'
        )
        script = program('train.py') if type(self) is Trainer or not path else shell_word(os.path.relpath(path))
        return ' '.join([launch, script, '--resume', shell_word(checkpoint), *more])

    def run(self):
        """Train, then let the Logger write what is pending, finish and close the trackers, and report;
        returns the Stop (or None)."""
        start, idle = time.perf_counter(), not self.work_left()
        if is_main_process():
            print(self.summary_line(), flush=True)
        try:
            stop = self.train()
            if not idle or self.end_due:  # (one resumed with nothing to do leaves the folder's history.json)
                self.write_history(now=True)
        except BaseException as error:
            if is_peer_lost(error):  # the line that says so (utils/errors.py) says what to do next
                saved = self.options.resume_from or getattr(self, 'saved_step', 0) > 0  # a checkpoint to go on from
                error.add_note(
                    'the newest checkpoint is whole: continue with --resume' if saved else 'nothing was saved yet'
                )
            with contextlib.suppress(Exception):  # the error to show is the first one
                self.write_history(now=True)
            with contextlib.suppress(Exception):
                self.logger.close()  # what was logged so far is written and readable
            raise
        # final and best metrics only for a run that ended: one stopped by a signal is resumed, and ends
        # then as one never stopped (its final/, best/ and HParams points once, at its real end)
        ended = stop is None or stop.reason == StopReason.EARLY_STOP
        self.logger.close(self.final_metrics() if ended else None)
        if ended and is_main_process() and (not idle or self.end_due):
            self.checkpointer.keeper.record_end(self.position.step)  # a resume at the end has nothing to do
        if is_main_process():
            self.report(stop, time.perf_counter() - start, idle)
        return stop


def program(name):
    """Kiln's script `name` (train.py, eval.py) as a command names it from the working folder."""
    return shell_word(os.path.relpath(os.path.realpath(os.path.join(PROJECT, name))))


def check_trained_task(options, checkpoint, source):
    """A KilnError when --load_model_path's `checkpoint` (the file `source`) was trained for another task
    than this run's (unless --load_not_strict takes what fits from it: a backbone for another task); a
    note when its images were normalized otherwise."""
    trained = checkpoint.get('args') if isinstance(checkpoint.get('args'), dict) else {}
    normalized = as_trained(trained).get('normalize')
    if normalized not in (None, options.normalize) and is_main_process():  # a note: fine-tuning may mean to change it
        print(
            f'note: {source} was trained on images normalized with --normalize {normalized}; this run uses '
            f'{options.normalize} (give --normalize {normalized} to keep what its weights saw)'
        )
    if options.load_not_strict or trained.get('task') in (None, options.task):
        return
    model = trained.get('model_type')
    raise KilnError(
        f'{source} was trained for --task {trained["task"]} (--model_type {model}), '
        f'this run is --task {options.task}; to fine-tune it give --task {trained["task"]} --model_type {model}, '
        f'or --load_not_strict to take the tensors that fit'
    )


def check_monitor(options, task_type, own_metrics=(), trainer_name='Trainer'):
    """A KilnError when --monitor is not one of the task's train/ or val/ metrics, nor of `own_metrics`
    (those the Trainer subclass `trainer_name` logs); a resumed run trained by another one's (its own
    metric, monitored) is told to resume with that one's script."""
    metric_names = [f'val/{name}' for name in task_type.metric_names(options)]
    metric_names += [f'train/{name}' for name in task_type.train_metric_names(options)]
    metric_names += [name for name in own_metrics if name not in metric_names]
    if options.monitor in metric_names:
        return
    resumed = getattr(options, 'resume_from', None)
    trained_by = load_checkpoint(resumed, mmap=True).get('trainer') if resumed else None
    if trained_by not in (None, trainer_name):
        raise KilnError(
            f'--monitor {options.monitor}: {resumed} was trained by {trained_by}, whose metric it is; resume it '
            f'with the script that runs {trained_by}'
        )
    raise KilnError(
        f'--monitor {options.monitor} is not a metric of --task {options.task}; choose one of: '
        f'{", ".join(metric_names)}'
    )


def hparams(options):
    """The options shown in TensorBoard's HParams tab and given to other trackers: the main ones, and
    every option set to something else than its default (so a sweep's options are there); an unset one
    (None) left out, so that a column of numbers (--max_iteration) holds numbers only."""
    main = (
        'task',
        'model_type',
        'data_type',
        'optimizer',
        'lr',
        'batch_size',
        'epochs',
        'max_iteration',
        'scheduler',
        'weight_decay',
        'amp',
        'seed',
        'augment',
    )
    defaults = option_defaults(parse_train_args)
    shown = {
        name: value
        for name, value in sorted(saved_options(options).items())
        if value is not None
        and (name in main or (name in defaults and value != defaults[name] and name not in ('checkpoints_dir',)))
    }
    return {name: value if isinstance(value, (int, float, str, bool)) else str(value) for name, value in shown.items()}


def hparams_metric_names(options):
    """The final and best metric names of every registered task, so runs of different tasks in one
    TensorBoard logdir each show theirs in the HParams tab."""
    names = []
    for name in TASKS:
        with contextlib.suppress(KilnError):
            task = task_class(name)
            names += [f'final/train/{metric}' for metric in task.train_metric_names(options)]
            names += [f'final/val/{metric}' for metric in task.metric_names(options)]
            names.append(f'best/{task.monitor}')
    return list(dict.fromkeys(names + [f'best/{options.monitor}']))


def open_run(argv, options):
    """Rank 0 makes the experiment folder (or reopens it with --resume) and holds its lock; every
    process gets the run's options. Returns (options, lock or None)."""
    lock = None

    def on_main_process():
        nonlocal lock
        opened, lock = open_experiment(argv, options)
        return opened

    return run_on_main_process(on_main_process), lock


def start(argv):
    """What `main` does before training, in one process: resolve the options, open the experiment
    folder and build the Trainer (for benchmarks and tests: `start(argv).run()`)."""
    options, lock = open_experiment(argv, resolve(parse_args(parse_train_args, argv)))
    return Trainer.build(options, lock)


RUNS_STARTED = []  # one entry per `main` of this process so far


def main(argv=None, args=None, trainer_type=Trainer):
    """Join torchrun's processes if any, make (or reopen) the experiment folder, build the Trainer (or
    `trainer_type`, a subclass) and run it; returns the Trainer."""
    global STARTED
    if RUNS_STARTED or not getattr(sys.modules['__main__'], '__file__', None):  # a later run of this process (a
        STARTED = time.perf_counter()  # script's of several), or one from a notebook: timed from this call
    RUNS_STARTED.append(main)
    argv = command_words(argv)
    args = args or parse_args(parse_train_args, argv)
    if args.fast_dev_run and args.resume:
        raise KilnError('--fast_dev_run trains in a throwaway folder of its own: drop --resume')
    init_distributed(resumed_on_cpu(args, argv), args.gpus)  # (a CPU run resumed joins a CPU group)
    try:
        with process_settings_kept():  # --deterministic, --detect_anomaly: for this run only
            if args.fast_dev_run:
                return fast_dev_run(argv, args, trainer_type)
            trainer, stop = train_in_group(argv, args, trainer_type)
    finally:
        cleanup_distributed()
    finish(trainer, stop)
    return trainer


def train_in_group(argv, args, trainer_type=Trainer, keep_lock=False, users_argv=None):
    """Open the experiment folder, build the Trainer (or `trainer_type`) and run it, in the process
    group already joined; returns (the Trainer, its Stop or None). The folder's lock is released at the
    end, or with `keep_lock` left to the caller (`trainer.lock`) once the run succeeded. Notes on options
    that do nothing here are about `users_argv` (default `argv`): the flags the user gave."""
    options, lock = open_run(argv, resolve(args))
    # a failed start removes a folder it just made, never one that --resume reopened
    fresh = is_main_process() and options.resume_from is None and not options.resume
    try:
        made_parents = lock.made_parents if lock else ()  # (--checkpoints_dir's folders made for this run)
        with discard_folder_if_setup_fails(options.model_dir, made_parents) if fresh else contextlib.nullcontext():
            trainer = trainer_type.build(options, lock)
            if is_main_process():
                for note in ignored_options(trainer.judged_options(), users_argv or argv):  # said, not refused
                    print(f'note: {note}')
                lists = [options.train_list, options.val_list]
                if all(lists) and os.path.realpath(lists[0]) == os.path.realpath(lists[1]):
                    print('note: --val_list is the --train_list: val/* measure the data the run trains on')
            try:
                stop = trainer.run()
                barrier()  # each process returns once rank 0's files are written (--fast_dev_run reads them next)
            finally:
                trainer.train_data.close()
                trainer.val_data.close()
    except BaseException:
        keep_lock = False
        raise
    finally:
        if lock is not None and not keep_lock:  # the folder is free for a --resume in this process too
            lock.release()
    return trainer, stop


def finish(trainer, stop):
    """Exit as the stop asks: a one-line error after a non-finite value, 128 + the signal number after a signal."""
    if stop is None:
        return
    if stop.reason == StopReason.NONFINITE:
        path = trainer.folder(LAST)
        # (a resumed run keeps its --lr and clipping: the run to go on in is a new one)
        if os.path.exists(path):  # name only files that exist
            advice = (
                f'nothing after it was saved. To go on with a lower --lr (or --clip_grad_norm 1), start a run '
                f'from its weights: --load_model_path {path} --save_prefix NEW_NAME'
            )
        else:
            advice = (
                'nothing was saved. Start again with a lower --lr (or --clip_grad_norm 1), adding --resume (it '
                'reuses the folder)'
            )
        raise KilnError(f'{stop.message}; {advice}')
    if stop.reason == StopReason.SIGNAL:
        sys.exit(128 + stop.signum)


def fast_dev_run(argv, args, trainer_type=Trainer):
    """--fast_dev_run: 2 training and 2 validation batches and one save in a throwaway folder under
    <checkpoints_dir>/fast_dev_run/, then eval.py and predict.py on that checkpoint; the folders of earlier
    ones go (the newest stays, to look at)."""
    stamp = time.strftime('%Y%m%d_%H%M%S') + f'_{os.getpid()}_{time.time_ns() % 10**9}'
    throwaway = os.path.join(args.checkpoints_dir, 'fast_dev_run')
    dev_argv = [
        *argv,
        '--checkpoints_dir',
        throwaway,
        '--save_prefix',
        stamp,
        '--max_iteration',
        '2',
        '--limit_train_batches',
        '2',
        '--limit_val_batches',
        '2',
        '--valid_interval',
        '2',
    ]
    # --fast_dev_run stays among its options: Trainer.build knows its 2 steps are not the run's schedule
    # the folder stays locked until predict.py is done: another --fast_dev_run removes only unlocked ones
    dev_args = parse_args(parse_train_args, dev_argv)
    trainer, stop = train_in_group(dev_argv, dev_args, trainer_type, keep_lock=True, users_argv=argv)
    try:
        return check_dev_run(trainer, stop, args, throwaway)
    finally:
        if trainer.lock is not None:
            trainer.lock.release()


def check_dev_run(trainer, stop, args, throwaway):
    """--fast_dev_run's eval.py and predict.py on the run's checkpoint, then the earlier runs' folders go."""
    import eval as evaluation_script
    import predict

    finish(trainer, stop)
    checkpoint = trainer.folder(LAST)
    device = ['--cpu'] if args.cpu else ['--gpus', str(args.gpus[0])] if args.gpus else []  # where it trained
    # in the same processes and group as the training; eval.py leaves the group at its end
    evaluation_script.main(['--load_model_path', checkpoint, '--no-progress_bar', *device])
    if os.environ.get('RANK', '0') != '0':  # predict.py runs in one process: torchrun's others are done
        return trainer
    remove_unused_runs(throwaway, trainer.options.model_dir)  # the earlier fast_dev_runs' folders
    images = getattr(trainer.val_data.dataset, 'list_path', None)
    if images is None:  # a dataset of no files (see data/data_entry.py)
        print(
            f'fast_dev_run: trained, saved and evaluated in {trainer.options.model_dir} (no predict.py: '
            f'--data_type {args.data_type} names no image files)'
        )
        return trainer
    predict.main(['--load_model_path', checkpoint, '--input', images, '--no-progress_bar', *device])
    print(f'fast_dev_run: trained, saved, evaluated and predicted in {trainer.options.model_dir}')
    return trainer


if __name__ == '__main__':
    run_to_exit(lambda argv: main(argv, ARGS))
