"""Train a model: `python train.py --help`.

Read it top down: `main` resolves the options and the experiment folder once, `build` makes every
part of the run from them (each part lives in a file named by its one job), and `train` is the
loop. A new task, dataset or model is a file plus a registry line; nothing here changes for it.
"""

import time

STARTED = time.perf_counter()  # for the time-to-first-step figure

from utils.errors import KilnError, quiet_interrupts, run_cli

quiet_interrupts()  # a Ctrl-C while torch loads: one line, exit 130
from options import parse_args, parse_train_args

if __name__ == '__main__':
    ARGS = run_cli(lambda argv: parse_args(parse_train_args, argv))  # --help and mistakes answer before torch loads

import contextlib
import dataclasses
import math
import os
import sys

import torch
from tqdm import tqdm

from data.augment import augmentation_names
from data.data_entry import select_dataset
from data.loader import Batches
from options import Options, prefix_map, saved_options
from tasks.task_entry import TASKS, task_class
from utils.checkpoint import atomic_write_json, load_checkpoint, unwrap_model
from utils.checkpoint_keeper import LAST, CheckpointKeeper
from utils.checkpointer import Checkpointer, Position, RandomStates
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
from utils.evaluation import evaluate
from utils.finetune import FineTuning
from utils.model_setup import setup_model
from utils.monitor import Monitor
from utils.progress import progress
from utils.recorder import Recorder
from utils.run_folder import (
    TrainerRunConfig,
    append_reproducibility_record,
    checkpoint_path,
    discard_folder_if_setup_fails,
    open_experiment,
)
from utils.run_history import InMemoryRunHistory
from utils.seeding import set_deterministic, set_seed
from utils.stopping import Stopper, StopReason
from utils.trackers import build_trackers

OPTIMIZERS = {
    'sgd': lambda groups, o: torch.optim.SGD(groups, o.lr, momentum=o.momentum, weight_decay=o.weight_decay),
    'adam': lambda groups, o: torch.optim.Adam(groups, o.lr, weight_decay=o.weight_decay),
    'adamw': lambda groups, o: torch.optim.AdamW(groups, o.lr, weight_decay=o.weight_decay),
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


@dataclasses.dataclass
class Run:
    """The parts of one training run, as `build` made them; `train` drives them."""

    options: Options
    task: object
    device: torch.device
    train_data: Batches
    val_data: Batches
    setup: object  # utils.model_setup.ModelSetup
    finetuning: FineTuning
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler
    position: Position
    stopper: Stopper
    monitor: Monitor
    history: InMemoryRunHistory
    recorder: Recorder  # train/loss and the learning rate between validations
    train_metrics: object  # the task's metrics of the training batches between validations
    checkpointer: Checkpointer
    trackers: object = None
    lock: object = None  # the experiment folder's lock, held by rank 0 while the run lives
    max_steps: int = 0
    updates_per_epoch: int = 0
    first_step_seconds: float | None = None


def resolve_task_defaults(args):
    """Fill the options a task decides when they are not given: model, dataset, loss, monitor."""
    task = task_class(args.task)
    args.model_type = args.model_type or task.default_model
    args.data_type = args.data_type or task.default_data[bool(args.train_list or args.val_list)]
    args.loss = args.loss or task.default_loss
    args.img_size = args.img_size or task.default_image_size
    args.monitor = args.monitor or task.monitor
    args.monitor_mode = args.monitor_mode or task.monitor_mode
    return args


def resolve_options(args, task_type, train_set):
    """The run's final options, read-only from here on: the number of classes comes from the data."""
    options = Options.of(args, num_classes=args.num_classes or train_set.num_classes)
    metric_names = [f'{split}/{name}' for split in ('val', 'train') for name in task_type.metric_names(options)]
    if options.monitor not in metric_names:
        raise KilnError(
            f'--monitor {options.monitor} is not a metric of --task {options.task}; choose one of: '
            f'{", ".join(metric_names)}'
        )
    return options


def batches(options, task, dataset, device, train):
    """The train or validation batches of `dataset` as the options ask (see data/loader.py)."""
    overfit = options.overfit_batches
    augment = augmentation_names(options.augment, getattr(dataset, 'augment', ())) if train and not overfit else ()
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
    )


def build(args):
    """Every part of a training run, built from the resolved options (`args` from open_experiment)."""
    set_seed(args.seed)
    set_deterministic(args.deterministic)
    torch.autograd.set_detect_anomaly(args.detect_anomaly)
    device = select_device(args.cpu, args.gpus)
    task_type = task_class(args.task)
    train_set = select_dataset(args, 'train')
    options = resolve_options(args, task_type, train_set)
    task = task_type(options, train_set.class_names)
    task.check_dataset(train_set, options.data_type)
    # --overfit_batches validates on the very batches it trains on
    val_set = train_set if options.overfit_batches else select_dataset(options, 'val')
    train_data, val_data = (
        batches(options, task, train_set, device, True),
        batches(options, task, val_set, device, False),
    )

    checkpoint = load_checkpoint(options.resume_from) if options.resume_from else None
    weights = checkpoint_path(options.load_model_path) if options.load_model_path and checkpoint is None else None
    setup = setup_model(
        options, device, weights, strict=not options.load_not_strict, prefix_map=prefix_map(options), wrap=False
    )
    # freeze before wrapping for DDP, which syncs only what is trainable when it wraps
    finetuning = FineTuning(setup.model, options.freeze_to, options.freeze_batch_norms, options.unfreeze_at_epoch)
    setup.wrap(options)
    groups = finetuning.param_groups(options.lr, options.head_lr, options.backbone_lr, options.unfrozen_lr_scale)
    optimizer = OPTIMIZERS[options.optimizer](groups, options)
    updates_per_epoch = math.ceil(len(train_data) / options.grad_accum_steps)
    max_steps = options.max_iteration or options.epochs * updates_per_epoch
    scheduler = SCHEDULERS[options.scheduler](optimizer, options, max_steps, updates_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=options.amp == 'fp16')
    position, history, recorder = Position(), InMemoryRunHistory(), Recorder()
    monitor = Monitor(options.monitor, options.monitor_mode, options.early_stop_patience, options.early_stop_min_delta)
    train_metrics = task.train_metrics()
    keeper = (
        CheckpointKeeper(options.model_dir, options.keep_last, options.keep_best, options.monitor_mode)
        if is_main_process()
        else None
    )
    # the stateful parts a checkpoint is made of; `position` before the data order it checks
    parts = {
        'model': setup.model,
        'optimizer': optimizer,
        'scheduler': scheduler,
        'scaler': scaler,
        'position': position,
        'data_order': position.data_order(train_data),
        'rng': RandomStates(),
        'history': history,
        'monitor': monitor,
    }
    rank_zero_parts = {'recorder': recorder}  # sums of every process: restored on rank 0 only
    if train_metrics is not None:
        rank_zero_parts['train_metrics'] = train_metrics
    checkpointer = Checkpointer(parts, rank_zero_parts, keeper)
    run = Run(
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
        Stopper(device),
        monitor,
        history,
        recorder,
        train_metrics,
        checkpointer,
        max_steps=max_steps,
        updates_per_epoch=updates_per_epoch,
    )
    if checkpoint is not None:
        checkpointer.load(checkpoint, options.resume_from)
        run.stopper.resume_at(position.step)
        if finetuning.is_unfrozen(position.epoch, position.batch):  # --unfreeze_at_epoch took effect before
            finetuning.unfreeze()
            setup.wrap(options)
        if is_main_process():
            print(
                f'resuming {options.resume_from}: epoch {position.epoch + 1}, batch {position.batch}, '
                f'step {position.step}'
            )
    if is_main_process():
        run.trackers = build_trackers(
            options.loggers,
            options.model_dir,
            os.path.basename(options.model_dir),
            hparams_metric_names(options),
            position.step if checkpoint else None,
            checkpoint.get('trackers') if checkpoint else None,
            options,
        )
        if setup.load_report is not None:
            atomic_write_json(
                {'source': options.load_model_path, **setup.load_report.to_dict()},
                os.path.join(options.model_dir, 'load_report.json'),
            )
    return run


def train(run):
    """Train until --epochs (or --max_iteration) are done or a stop; return the Stop, or None when done."""
    o, task, position, stopper = run.options, run.task, run.position, run.stopper
    model = run.setup.wrapped
    if is_main_process():
        write_run_records(run)
    start, seen = time.perf_counter(), 0
    with stopper, training_profiler(o.profile, o.model_dir) as profiler:
        while stopper.stop is None and position.step < run.max_steps:
            if run.finetuning.unfreezes_at(position.epoch, position.batch):  # --unfreeze_at_epoch
                run.finetuning.unfreeze()
                run.setup.wrap(o)
                model = run.setup.wrapped
            run.finetuning.train_mode(model)
            epoch = position.epoch
            for batch in progress(
                run.train_data.epoch(epoch, start=position.batch),
                o.progress_bar and is_main_process(),
                f'epoch {epoch + 1}',
                total=len(run.train_data) - position.batch,
            ):
                # the batches of one update: --grad_accum_steps of them, fewer at the end of the epoch
                group_start = position.batch // o.grad_accum_steps * o.grad_accum_steps
                group_size = min(o.grad_accum_steps, len(run.train_data) - group_start)
                position.batch += 1
                update = position.batch == group_start + group_size
                # DDP averages gradients only on the batch that ends an update
                with contextlib.nullcontext() if update or not is_distributed() else model.no_sync():
                    with run.setup.autocast():
                        outputs = task.forward(model, batch)
                        loss = task.loss(outputs, batch)
                    run.scaler.scale(loss / group_size).backward()
                stopper.watch_loss(loss)
                count = task.count(batch)
                seen += count
                run.recorder.record('train/loss', loss, count)
                if run.train_metrics is not None:
                    run.train_metrics.update(task.outputs_to_float(outputs).detach(), batch)
                if not update:
                    continue

                optimizer_step(run)
                position.step += 1
                stopper.after_step()  # a stop signal, agreed by every process
                profiler.step()
                if run.first_step_seconds is None:
                    run.first_step_seconds = time.perf_counter() - STARTED
                if position.step % o.print_freq == 0:  # the only host syncs between validations
                    stopper.check_finite()
                    print_progress(run, seen / (time.perf_counter() - start))
                if position.batch == len(run.train_data):  # so a checkpoint saved now records a whole epoch
                    position.epoch, position.batch = epoch + 1, 0
                    run.history.end_epoch()
                after_update(run)
                if stopper.stop or position.step >= run.max_steps:
                    break
    return stopper.stop


def optimizer_step(run):
    """Unscale and clip the accumulated gradients, step the optimizer and the schedule."""
    o = run.options
    if o.clip_grad_norm or o.clip_grad_value:
        run.scaler.unscale_(run.optimizer)
        params = [p for group in run.optimizer.param_groups for p in group['params']]
        if o.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, o.clip_grad_norm)
        if o.clip_grad_value:
            torch.nn.utils.clip_grad_value_(params, o.clip_grad_value)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    if o.scheduler != 'plateau':
        run.scheduler.step()


def after_update(run):
    """Validate and save as --valid_interval / --save_interval say (and before stopping)."""
    o, step, stopper = run.options, run.position.step, run.stopper
    finished = step >= run.max_steps
    due = step % o.valid_interval == 0 if o.valid_interval else run.position.batch == 0
    metrics = validate(run) if (due or finished) and stopper.stop is None else None
    due_save = o.save_interval is not None and step % o.save_interval == 0
    if metrics is not None or due_save or finished or stopper.stop:
        save(run, metrics)


def validate(run):
    """Close the train/* means, evaluate the validation split, and update history, best and early stopping."""
    o, step = run.options, run.position.step
    metrics = run.recorder.summary(all_ranks=True)  # train/loss since the last validation
    if run.train_metrics is not None:
        metrics.update({f'train/{k}': v for k, v in run.train_metrics.compute().items()})
        run.train_metrics.reset()
    metrics['train/lr'] = run.optimizer.param_groups[0]['lr']
    evaluation = evaluate(
        run.setup.wrapped,
        run.val_data,
        run.task,
        run.setup.autocast,
        picture_batches={0} if o.log_images else (),
        progress_bar=o.progress_bar and is_main_process(),
    )
    run.finetuning.train_mode(run.setup.wrapped)
    metrics.update({f'val/{k}': v for k, v in evaluation.metrics.items()})
    for name, value in metrics.items():
        run.history.update_metric(name, value)
    value = metrics[o.monitor]
    if o.scheduler == 'plateau':
        run.scheduler.step(value)
    improved = run.monitor.update(value)
    run.stopper.check_early_stop(run.monitor)
    if run.trackers:
        run.trackers.log_metrics(metrics, step, run.position.epoch)
        for pictures in evaluation.pictures.values():
            run.trackers.log_images({f'val/{name}': picture for name, picture in pictures.items()}, step)
    if is_main_process():
        shown = ' '.join(f'{k} {v:.4f}' for k, v in metrics.items() if k != 'train/lr')
        print(f'{position_text(run)} {shown}{" (best)" if improved else ""}', flush=True)
    return dict(metrics, improved=improved)


def save(run, metrics=None):
    """Save the full state, unless a loss or model value is no longer finite (then the run stops and
    nothing reached through it is saved); best.pth when --monitor improved. Every process takes part."""
    if not run.stopper.check_finite(unwrap_model(run.setup.model)):
        return
    metrics = metrics or {}
    monitored = metrics.get(run.options.monitor)
    extra = {
        'args': saved_options(run.options),
        'class_names': run.task.class_names,
        'monitor_value': monitored,
        'trackers': run.trackers.state_dict() if run.trackers else {},
    }
    run.checkpointer.save(run.position.epoch, run.position.step, monitored, bool(metrics.get('improved')), extra)
    if is_main_process():
        run.history.save_json(os.path.join(run.options.model_dir, 'history.json'))
        if run.trackers:
            run.trackers.commit(run.position.step)
    barrier()


def position_text(run):
    """Where the run is, for printed lines: `epoch 3/12 step 5/46`, `epoch 3/12`, or `step 40/100`."""
    o, position = run.options, run.position
    if o.max_iteration:
        return f'step {position.step}/{run.max_steps}'
    if position.batch == 0:
        return f'epoch {position.epoch}/{o.epochs}'
    updates = math.ceil(position.batch / o.grad_accum_steps)
    return f'epoch {position.epoch + 1}/{o.epochs} step {updates}/{run.updates_per_epoch}'


def print_progress(run, images_per_second):
    """One line of running train metrics (of this process), learning rate and throughput."""
    if is_main_process():
        running = ' '.join(f'{k} {v:.4f}' for k, v in run.recorder.means().items())
        tqdm.write(
            f'{position_text(run)} {running} lr {run.optimizer.param_groups[0]["lr"]:.2e} '
            f'{images_per_second * world_size():.0f} img/s'
        )


def write_run_records(run):
    """Write run_config.json, add this start to reproduce.json, and give the trackers the options."""
    o = run.options
    TrainerRunConfig(
        num_epochs=math.ceil(run.max_steps / run.updates_per_epoch),
        per_device_batch_size=o.batch_size,
        total_batch_size=o.batch_size * o.grad_accum_steps * world_size(),
        gradient_accumulation_steps=o.grad_accum_steps,
        gradient_clip_value=o.clip_grad_norm or o.clip_grad_value,
        num_update_steps_per_epoch=run.updates_per_epoch,
        max_num_train_steps=run.max_steps,
        world_size=world_size(),
        is_local_process_zero=local_rank() == 0,
        is_world_process_zero=rank() == 0,
        is_distributed=is_distributed(),
        mixed_precision=o.amp,
    ).save(o.model_dir)
    append_reproducibility_record(o.model_dir, o)
    shown = saved_options(o)
    run.trackers.log_text('args', '\n'.join(f'    {k}: {v}' for k, v in sorted(shown.items())), run.position.step)
    run.trackers.log_hparams(hparams(o))


def hparams(options):
    """The options shown in TensorBoard's HParams tab and given to other trackers: the main ones, and
    every option set to something else than its default (so a sweep's options are there)."""
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
    defaults = vars(parse_args(parse_train_args, []))
    shown = {
        name: value
        for name, value in sorted(saved_options(options).items())
        if name in main or (name in defaults and value != defaults[name] and name not in ('checkpoints_dir',))
    }
    return {name: value if isinstance(value, (int, float, str, bool)) else str(value) for name, value in shown.items()}


def hparams_metric_names(options):
    """The final and best metric names of every registered task, so runs of different tasks in one
    TensorBoard logdir each show theirs in the HParams tab."""
    names = []
    for name in TASKS:
        with contextlib.suppress(KilnError):
            names += [
                f'final/{split}/{metric}'
                for split in ('train', 'val')
                for metric in task_class(name).metric_names(options)
            ]
            names.append(f'best/{task_class(name).monitor}')
    return list(dict.fromkeys(names + [f'best/{options.monitor}']))


def final_metrics(run):
    """The last value of every metric and the best --monitor value."""
    metrics = {f'final/{name}': run.history.get_latest_metric(name) for name in sorted(run.history.get_metric_names())}
    if run.monitor.best is not None:
        metrics[f'best/{run.options.monitor}'] = run.monitor.best
    return metrics


def report(run, stop, seconds):
    """Say how the run ended and where its files are (only files that exist)."""
    o, folder = run.options, run.options.model_dir
    best = 'none' if run.monitor.best is None else f'{run.monitor.best:.4f}'
    first = '' if run.first_step_seconds is None else f' (first step {run.first_step_seconds:.1f}s after start)'
    lines = [
        f'{stop.message if stop else "done"} after {seconds:.0f}s at step {run.position.step}{first}; '
        f'best {o.monitor} {best}'
    ]
    existing = [name for name in ('best.pth', 'last.pth') if os.path.exists(os.path.join(folder, name))]
    if existing:
        lines.append(f'  checkpoints: {", ".join(os.path.join(folder, name) for name in existing)}')
    if 'tensorboard' in o.loggers:
        lines.append(f'  TensorBoard: tensorboard --logdir {o.checkpoints_dir}')
    if 'best.pth' in existing:
        lines.append(f'  evaluate:    python eval.py --load_model_path {folder}/best.pth')
    if 'last.pth' in existing:
        lines.append(f'  continue:    python train.py --resume {folder}/last.pth')
    print('\n'.join(lines), flush=True)


def run_training(run):
    """Train, then finish the trackers and report; returns the Stop (or None)."""
    start = time.perf_counter()
    stop = None
    try:
        stop = train(run)
    finally:
        if run.trackers:
            if stop is None or stop.reason != StopReason.NONFINITE:
                with contextlib.suppress(KilnError):
                    run.trackers.finish(final_metrics(run))
            run.trackers.close()
    if is_main_process():
        report(run, stop, time.perf_counter() - start)
    return stop


def open_run(argv, args):
    """Rank 0 makes the experiment folder (or reopens it with --resume) and holds its lock; every
    process gets the resolved options. Returns (args, lock or None)."""
    lock = None

    def on_main_process():
        nonlocal lock
        resolved, lock = open_experiment(argv, args)
        return resolved

    return run_on_main_process(on_main_process), lock


def start(argv):
    """What `main` does before training, in one process: resolve the options, open the experiment
    folder and build the run (for scripts and tests: `train(start(argv))`)."""
    args, lock = open_experiment(argv, resolve_task_defaults(parse_args(parse_train_args, argv)))
    run = build(resolve_task_defaults(args))
    run.lock = lock
    return run


def main(argv=None, args=None):
    """Join torchrun's processes if any, make (or reopen) the experiment folder, build the run and train."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = args or parse_args(parse_train_args, argv)
    init_distributed(args.cpu, args.gpus)
    try:
        if args.fast_dev_run:
            return fast_dev_run(argv, args)
        args, lock = open_run(argv, resolve_task_defaults(args))
        resolve_task_defaults(args)  # a resumed run's options come from its args.yaml: complete them alike
        # a failed start removes a folder it just made, never one that --resume reopened
        fresh = is_main_process() and args.resume_from is None and not args.resume
        with discard_folder_if_setup_fails(args.model_dir) if fresh else contextlib.nullcontext():
            run = build(args)
            run.lock = lock
            stop = run_training(run)
    finally:
        cleanup_distributed()
    finish(run, stop)
    return run


def finish(run, stop):
    """Exit as the stop asks: a one-line error after a non-finite value, 128 + the signal number after a signal."""
    if stop is None:
        return
    if stop.reason == StopReason.NONFINITE:
        path = os.path.join(run.options.model_dir, LAST)
        if os.path.exists(path):  # name only files that exist
            advice = f'nothing after it was saved. Lower --lr (or clip gradients) and continue from --resume {path}'
        else:
            advice = 'nothing was saved. Lower --lr (or clip gradients) and start again (--resume reuses the folder)'
        raise KilnError(f'{stop.message}; {advice}')
    if stop.reason == StopReason.SIGNAL:
        sys.exit(128 + stop.signum)


def fast_dev_run(argv, args):
    """--fast_dev_run: 2 training and 2 validation batches and one save in a throwaway folder under
    <checkpoints_dir>/fast_dev_run/, then eval.py and predict.py on that checkpoint."""
    import eval as evaluation_script
    import predict

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
    dev_argv = [token for token in dev_argv if token != '--fast_dev_run']
    run = main(dev_argv)
    checkpoint = os.path.join(run.options.model_dir, LAST)
    device = ['--cpu'] if args.cpu else []
    evaluation_script.main(['--load_model_path', checkpoint, '--no-progress_bar', *device])
    predict.main(
        ['--load_model_path', checkpoint, '--input', run.val_data.dataset.list_path, '--no-progress_bar', *device]
    )
    print(f'fast_dev_run: trained, saved, evaluated and predicted in {run.options.model_dir}')
    return run


if __name__ == '__main__':
    run_cli(lambda argv: main(argv, ARGS))
