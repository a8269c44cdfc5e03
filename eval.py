"""Evaluate a checkpoint: `python eval.py --load_model_path checkpoints/<experiment>/best.pth`.

Writes into `<experiment>/eval/<checkpoint>_<list>_<save_prefix>/`: result.txt, result.json,
predictions.csv, the task's pictures of the whole list (e.g. confusion_matrix.png) and a picture
every --viz_freq batches. With several checkpoints (files, experiment folders, quoted globs) each
gets its result folder and a comparison table is written too. The evaluation loop is the one
validation runs (utils/evaluation.py), so the numbers agree with training's.
"""

from utils.errors import quiet_interrupts, run_cli

quiet_interrupts()
from options import parse_args, parse_test_args

if __name__ == '__main__':
    ARGS = run_cli(lambda argv: parse_args(parse_test_args, argv))  # --help and mistakes answer before torch loads

import contextlib
import csv
import json
import os

from data.data_entry import select_dataset
from data.loader import Batches
from options import Options, prefix_map
from tasks.task_entry import task_class
from utils.checkpoint import load_checkpoint
from utils.checkpoint_keeper import verify
from utils.device import select_device
from utils.distributed import cleanup_distributed, init_distributed, is_main_process, run_on_main_process
from utils.errors import KilnError
from utils.evaluation import evaluate
from utils.model_setup import setup_model
from utils.run_folder import (
    checkpoints_to_evaluate,
    create_run_folder,
    discard_folder_if_setup_fails,
    evaluated_list_name,
    result_folder,
)
from utils.viz import save_png

# options that describe the model and data; the ones not given are taken from the checkpoint's training run
INHERITED = ('task', 'model_type', 'data_type', 'img_size', 'num_classes', 'val_list', 'loss', 'topk')


def load_for_inference(args, path):
    """Load the checkpoint `path` (checked against its recorded checksum) and resolve the options it is
    run with: those not given come from its training run, then from its task's defaults.
    Returns (options, checkpoint, task class)."""
    verify(path)
    checkpoint = load_checkpoint(path)
    if not isinstance(checkpoint, dict):
        raise KilnError(
            f'{path} holds a {type(checkpoint).__name__}, not model weights; '
            f'give a checkpoint written by train.py or a state dict'
        )
    trained_with = checkpoint.get('args') if isinstance(checkpoint.get('args'), dict) else {}
    given = {name: getattr(args, name, None) for name in INHERITED}
    values = {name: given[name] if given[name] is not None else trained_with.get(name) for name in INHERITED}
    if values['model_type'] is None:
        raise KilnError(f'{path} does not say which model it holds; give --model_type')
    task_type = task_class(values['task'] or 'classify')
    values.update(
        task=values['task'] or 'classify',
        img_size=values['img_size'] or task_type.default_image_size,
        topk=values['topk'] or 3,
        data_type=values['data_type'] or task_type.default_data[bool(values['val_list'])],
    )
    class_names = checkpoint.get('class_names')
    if values['num_classes'] is None and class_names:
        values['num_classes'] = len(class_names)
    return Options.of(args, **values, load_model_path=path), checkpoint, task_type


def evaluate_checkpoint(args, path):
    """Evaluate one checkpoint into its own result folder; return its metrics."""
    options, checkpoint, task_type = load_for_inference(args, path)
    folder = result_folder(path, 'eval', evaluated_list_name(args.val_list), options.save_prefix)  # 'val' unless given
    options = options.replace(result_dir=folder)
    run_on_main_process(create_run_folder, folder, options, 'choose a new --save_prefix to keep the old results')
    with discard_folder_if_setup_fails(folder) if is_main_process() else contextlib.nullcontext():
        device = select_device(options.cpu, options.gpus)
        dataset = select_dataset(options, 'val')
        options = options.replace(num_classes=options.num_classes or dataset.num_classes)
        task = task_type(options, dataset.class_names or checkpoint.get('class_names'))
        task.check_dataset(dataset, options.data_type)
        data = Batches(
            dataset,
            device,
            batch_size=options.batch_size,
            shuffle=False,
            seed=options.seed,
            collate=task.collate,
            workers=options.num_workers,
            channels_last=options.channels_last,
            image_size=options.img_size,
        )
        setup = setup_model(
            options, device, checkpoint, strict=not options.load_not_strict, source=path, prefix_map=prefix_map(options)
        )
        every = range(0, len(data), options.viz_freq) if options.save_viz else ()
        evaluation = evaluate(
            setup.wrapped,
            data,
            task,
            setup.autocast,
            class_names=task.class_names,
            keep_rows=True,
            picture_batches=every,
            progress_bar=options.progress_bar and is_main_process(),
            description='eval',
        )
    if is_main_process():
        write_results(folder, options, task, dataset, evaluation)
        main_metrics = {k: v for k, v in evaluation.metrics.items() if '/' not in k}
        print(f'{path}: ' + ' '.join(f'{k} {v:.4f}' for k, v in main_metrics.items()))
        print(
            f'  results in {folder}: result.txt, result.json, predictions.csv{", pictures" if options.save_viz else ""}'
        )
    return evaluation.metrics


def write_results(folder, options, task, dataset, evaluation):
    """result.txt (one `metric: value` per line), result.json, predictions.csv and the pictures."""
    header = {
        'checkpoint': options.load_model_path,
        'list': getattr(dataset, 'list_path', None),
        'samples': len(dataset),
    }
    with open(os.path.join(folder, 'result.txt'), 'w') as f:
        f.writelines(f'{key}: {value}\n' for key, value in header.items())
        f.writelines(f'{key}: {value:.4f}\n' for key, value in evaluation.metrics.items())
    details = {'class_names': task.class_names}
    confusion = getattr(evaluation.metric_object, 'confusion', None)
    if confusion is not None:
        details['confusion_matrix'] = confusion.tolist()
    with open(os.path.join(folder, 'result.json'), 'w') as f:
        json.dump({**header, 'metrics': evaluation.metrics, **details}, f, indent=1)
    paths = dataset.image_paths()
    with open(os.path.join(folder, 'predictions.csv'), 'w', newline='') as f:
        writer = csv.writer(f)
        writer.writerow(task.eval_header)
        for path, rows in zip(paths, evaluation.rows):
            writer.writerows([path, *row] for row in rows)
    if options.save_viz:
        for batch, pictures in evaluation.pictures.items():
            for name, picture in pictures.items():
                save_png(picture, os.path.join(folder, f'{name}_batch{batch:04d}.png'))
    for name, picture in task.result_pictures(evaluation.metric_object).items():
        save_png(picture, os.path.join(folder, f'{name}.png'))


def prepare_comparison(args, checkpoints):
    """Check that no result folder exists yet, then create the comparison folder; return its path."""
    for checkpoint in checkpoints:
        folder = result_folder(checkpoint, 'eval', evaluated_list_name(args.val_list), args.save_prefix)
        if os.path.exists(folder):
            raise KilnError(f'{folder} already exists; choose a new --save_prefix to keep the old results')
    folder = os.path.join(
        args.checkpoints_dir, 'comparisons', f'{evaluated_list_name(args.val_list)}_{args.save_prefix}'
    )
    create_run_folder(folder, args, 'choose a new --save_prefix to keep the old comparison')
    return folder


def write_comparison(folder, rows):
    """comparison.csv (every metric) and comparison.txt (the main ones, aligned): one row per checkpoint."""
    names = list(dict.fromkeys(name for _, metrics in rows for name in metrics))
    with open(os.path.join(folder, 'comparison.csv'), 'w', newline='') as f:
        writer = csv.writer(f)
        writer.writerow(['checkpoint', *names])
        writer.writerows(
            [path, *(f'{metrics[n]:.6f}' if n in metrics else '' for n in names)] for path, metrics in rows
        )
    main_names = [name for name in names if '/' not in name]
    table = [['checkpoint', *main_names]] + [
        [path, *(f'{metrics[n]:.4f}' if n in metrics else '-' for n in main_names)] for path, metrics in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    with open(os.path.join(folder, 'comparison.txt'), 'w') as f:
        f.writelines('  '.join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() + '\n' for row in table)


def main(argv=None, args=None):
    """Join torchrun's processes if any, then evaluate the checkpoint, or each of several and compare them."""
    args = args or parse_args(parse_test_args, argv)
    init_distributed(args.cpu, args.gpus)
    try:
        checkpoints = checkpoints_to_evaluate(args.load_model_path)
        if len(checkpoints) == 1:
            return evaluate_checkpoint(args, checkpoints[0])
        folder = run_on_main_process(prepare_comparison, args, checkpoints)
        rows = [(checkpoint, evaluate_checkpoint(args, checkpoint)) for checkpoint in checkpoints]
        if is_main_process():
            write_comparison(folder, rows)
            with open(os.path.join(folder, 'comparison.txt')) as f:
                print(f.read().rstrip())
            print(f'comparison of {len(rows)} checkpoints in {folder}: comparison.txt, comparison.csv')
        return rows
    finally:
        cleanup_distributed()


if __name__ == '__main__':
    run_cli(lambda argv: main(argv, ARGS))
