"""Evaluate a checkpoint: `python eval.py --load_model_path checkpoints/<experiment>/best.pth`.

Writes into `<experiment>/eval/<checkpoint>_<list>_<save_prefix>/`: result.txt, result.json,
predictions.csv, the task's pictures of the whole list (e.g. confusion_matrix.png) and a picture
every --viz_freq batches. With several checkpoints (files, experiment folders, quoted globs) each
gets its result folder and a comparison table is written too. The evaluation loop is the one
validation runs (utils/evaluation.py), so the numbers agree with training's.
"""

from utils.errors import quiet_interrupts, run_cli, run_to_exit

if __name__ == '__main__':  # (imported, it changes no handler: see train.py)
    quiet_interrupts()
from options import parse_args, parse_test_args

if __name__ == '__main__':
    ARGS = run_cli(lambda argv: parse_args(parse_test_args, argv))  # --help and mistakes answer before torch loads

import contextlib
import csv
import os
import unicodedata

from data.data_entry import dataset_class, resize_of, select_dataset
from data.list_dataset import match_classes
from data.list_file import open_names_file
from data.loader import Batches
from options import command_words, given_options, inherit, prefix_map
from tasks.task_entry import task_class
from utils.allocator import keep_freed_memory
from utils.checkpoint import json_text, load_checkpoint
from utils.checkpoint_keeper import verify
from utils.device import select_device
from utils.distributed import cleanup_distributed, init_distributed, is_main_process, run_on_main_process
from utils.errors import KilnError
from utils.evaluation import evaluate
from utils.fault_points import fault_point
from utils.logger import Logger
from utils.model_setup import setup_model
from utils.run_folder import (
    PublishedTogether,
    StagedResults,
    checkpoints_to_evaluate,
    evaluated_list_name,
    result_folder,
)
from utils.viz import save_png


def load_for_inference(args, given, path):
    """Load the checkpoint `path` (checked against its recorded checksum) and resolve the options it is
    run with (options.inherit: those not `given` that decide the numbers come from its training run).
    Returns (options, checkpoint, task class)."""
    verify(path)
    checkpoint = load_checkpoint(path)
    if not isinstance(checkpoint, dict):
        raise KilnError(
            f'{path} holds a {type(checkpoint).__name__}, not model weights; '
            f'give a checkpoint written by train.py or a state dict'
        )
    trained_with = checkpoint.get('args') if isinstance(checkpoint.get('args'), dict) else {}
    if 'model_type' not in given and not trained_with.get('model_type'):
        raise KilnError(f'{path} does not say which model it holds; give --model_type')
    options = inherit(args, given, trained_with).replace(load_model_path=path)
    if options.resize is None:  # a checkpoint that does not say (a state dict): the dataset's way, as train.py
        options = options.replace(resize=resize_of(dataset_class(options.data_type)))
    class_names = checkpoint.get('class_names')
    if options.num_classes is None and class_names:
        options = options.replace(num_classes=len(class_names))
    return options, checkpoint, task_class(options.task)


class Evaluator:
    """Evaluates one checkpoint on a list: built from the resolved options and the loaded checkpoint,
    `eval()` runs the evaluation loop that validation runs (so the numbers agree with training's) and
    writes result.txt, result.json, predictions.csv and the pictures (every --viz_freq batches, drawn and
    saved by its Logger's writer thread) into `folder` (the staged one: the results name
    options.result_dir, the folder it becomes)."""

    def __init__(self, options, checkpoint, task_type, folder):
        self.folder = folder
        keep_freed_memory()  # each batch reuses the last one's memory, not fresh pages
        self.device = select_device(options.cpu, options.gpus)
        self.dataset = select_dataset(options, 'val')
        self.options = options = options.replace(num_classes=options.num_classes or self.dataset.num_classes)
        trained = checkpoint.get('class_names')
        match_classes(self.dataset, trained, options.load_model_path)
        names = list(self.dataset.class_names or ())  # a validation folder may hold the first trained classes
        first = [unicodedata.normalize('NFC', name) for name in (trained or ())[: len(names)]]  # (as matched)
        self.task = task_type(options, trained if trained and names == first else names)
        self.task.check_dataset(self.dataset, options.data_type)
        self.data = Batches(
            self.dataset,
            self.device,
            batch_size=options.batch_size,
            shuffle=False,
            seed=options.seed,
            collate=self.task.collate,
            workers=options.num_workers,
            channels_last=options.channels_last,
            image_size=options.img_size,
            options=options,  # --normalize
        )
        self.setup = setup_model(
            options,
            self.device,
            checkpoint,
            strict=not options.load_not_strict,
            source=options.load_model_path,
            prefix_map=prefix_map(options),
            inference=True,
        )
        self.logger = Logger()  # no trackers: results are files of the result folder
        self.weights = checkpoint.get('weights', 'model')  # 'ema': the average of the weights (--ema_decay)

    def eval(self):
        """Evaluate the whole list, write the results (rank 0) and return the metrics."""
        o = self.options
        evaluation = evaluate(
            self.setup.wrapped,
            self.data,
            self.task,
            self.setup.autocast,
            class_names=self.task.class_names,
            keep_rows=True,
            picture_batches=range(0, len(self.data), o.viz_freq) if o.save_viz else (),
            pictures=lambda number, source: self.logger.save_pictures(number, source, self.task.pictures, self.folder),
            progress_bar=o.progress_bar if is_main_process() else False,
            description='eval',
        )
        if is_main_process():
            self.write_results(evaluation)
            self.logger.close()  # the pictures are written
        return evaluation.metrics

    def report(self, metrics):
        """What to print: the main metrics and where the results are."""
        main_metrics = {k: v for k, v in metrics.items() if '/' not in k}
        return (
            f'{self.options.load_model_path}: '
            + ' '.join(f'{k} {v:.4f}' for k, v in main_metrics.items())
            + f'\n  results in {self.options.result_dir}: result.txt, result.json, predictions.csv'
            + (', pictures' if self.options.save_viz else '')
        )

    def write_results(self, evaluation):
        """result.txt (one `metric: value` per line), result.json, predictions.csv and the task's
        pictures of the whole list (e.g. the confusion matrix)."""
        folder, task = self.folder, self.task
        header = {
            'checkpoint': self.options.load_model_path,
            'weights': self.weights,
            'list': getattr(self.dataset, 'list_path', None),
            'samples': len(self.dataset),
        }
        with open_names_file(os.path.join(folder, 'result.txt')) as f:
            f.writelines(f'{key}: {value}\n' for key, value in header.items())
            f.writelines(f'{key}: {value:.4f}\n' for key, value in evaluation.metrics.items())
        details = {'class_names': task.class_names}
        confusion = getattr(evaluation.metric_object, 'confusion', None)
        if confusion is not None:
            details['confusion_matrix'] = confusion.tolist()
        with open_names_file(os.path.join(folder, 'result.json')) as f:
            f.write(json_text({**header, 'metrics': evaluation.metrics, **details}))
        fault_point('writing_results')
        with open_names_file(os.path.join(folder, 'predictions.csv')) as f:
            writer = csv.writer(f)
            writer.writerow(task.eval_header)
            image_paths = getattr(self.dataset, 'image_paths', lambda: range(len(evaluation.rows)))  # or numbers
            for path, rows in zip(image_paths(), evaluation.rows):
                writer.writerows([path, *row] for row in rows)
        for name, picture in task.result_pictures(evaluation.metric_object).items():
            save_png(picture, os.path.join(folder, f'{name}.png'))


def evaluate_checkpoint(args, given, path, say=print, publish_with=None):
    """Evaluate one checkpoint into its own new result folder and `say` (print) what it found; return (its
    metrics, the list evaluated). The folder appears whole when the evaluation ends (and is said then), or
    with `publish_with` (a comparison's PublishedTogether) when that block ends well (a comparison's `say` keeps
    the report until then)."""
    options, checkpoint, task_type = load_for_inference(args, given, path)
    name = evaluated_list_name(args.val_list)  # 'val' unless given
    folder = result_folder(path, 'eval', name, options.save_prefix, options.output_dir)
    options = options.replace(result_dir=folder)
    staged = run_on_main_process(  # rank 0 writes the results; the others only evaluate their share
        StagedResults, folder, options, 'choose a new --save_prefix to keep the old results', '--output_dir'
    )
    with contextlib.ExitStack() as own:
        if is_main_process():
            (publish_with or own).enter_context(staged)  # published whole, or removed
        evaluator = Evaluator(options, checkpoint, task_type, staged.path)
        try:
            metrics = evaluator.eval()
        finally:
            with contextlib.suppress(Exception):  # the error to show is the first one
                evaluator.logger.close()  # pictures pending are written before the folder is published or goes
            evaluator.data.close()
    if is_main_process():  # once the results are whole (a comparison's `say` keeps it until the end)
        say(evaluator.report(metrics))  # a closed output cannot take them away
    return metrics, getattr(evaluator.dataset, 'list_path', None)


def prepare_comparison(args, checkpoints):
    """Check that every checkpoint is whole and that no two of them, and no earlier results, share a
    result folder, then stage the comparison folder (StagedResults)."""
    folders, name = {}, evaluated_list_name(args.val_list)
    for checkpoint in checkpoints:
        verify(checkpoint)  # a corrupt one is said now, not after the others were evaluated
        folder = result_folder(checkpoint, 'eval', name, args.save_prefix, args.output_dir)
        if os.path.exists(folder):
            raise KilnError(f'{folder} already exists; choose a new --save_prefix to keep the old results')
        if folder in folders:
            raise KilnError(
                f'{folders[folder]} and {checkpoint} would both write their results to {folder} (experiment '
                f'folders of the same name under --output_dir): evaluate them in two commands with their own '
                f'--save_prefix'
            )
        folders[folder] = checkpoint
    folder = os.path.join(  # beside the results when they go to --output_dir
        args.output_dir or args.checkpoints_dir, 'comparisons', f'{name}_{args.save_prefix}'
    )
    return StagedResults(folder, args, 'choose a new --save_prefix to keep the old comparison', '--checkpoints_dir')


def write_comparison(folder, rows):
    """comparison.csv (every metric) and comparison.txt (the main ones, aligned): one row per checkpoint,
    `rows` being (checkpoint, metrics, list evaluated); a `list` column when the checkpoints were evaluated
    on different lists (each on its own validation list: no --val_list). Returns whether they were."""
    names = list(dict.fromkeys(name for _, metrics, _ in rows for name in metrics))
    main_names = [name for name in names if '/' not in name]
    lists = len({list_path for _, _, list_path in rows}) > 1

    def row(path, list_path, values):
        return [str(path), *([str(list_path)] if lists else []), *values]

    with open_names_file(os.path.join(folder, 'comparison.csv')) as f:
        writer = csv.writer(f)
        writer.writerow(row('checkpoint', 'list', names))
        for path, metrics, list_path in rows:
            writer.writerow(row(path, list_path, (f'{metrics[n]:.6f}' if n in metrics else '' for n in names)))
    table = [row('checkpoint', 'list', main_names)] + [
        row(path, list_path, (f'{metrics[n]:.4f}' if n in metrics else '-' for n in main_names))
        for path, metrics, list_path in rows
    ]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(table[0]))]
    with open_names_file(os.path.join(folder, 'comparison.txt')) as f:
        for cells in table:
            f.write('  '.join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip() + '\n')
    return lists


def main(argv=None, args=None):
    """Join torchrun's processes if any, then evaluate the checkpoint, or each of several and compare them.
    Returns the metrics of one checkpoint ({'loss': ..., 'acc': ...}), or for several the comparison's rows:
    (checkpoint, metrics, list evaluated) each."""
    argv = command_words(argv)
    args = args or parse_args(parse_test_args, argv)
    given = given_options(parse_test_args, argv)
    init_distributed(args.cpu, args.gpus)
    try:
        checkpoints = checkpoints_to_evaluate(args.load_model_path, args.config)
        if len(checkpoints) == 1:
            return evaluate_checkpoint(args, given, checkpoints[0])[0]
        comparison = run_on_main_process(prepare_comparison, args, checkpoints)
        rows, reports = [], []
        # all or nothing: every folder is published once the comparison is written (the comparison's last), and
        # all are removed when one fails or the run is stopped; a SIGKILL leaves none, so the command runs again
        with PublishedTogether() as made:
            if is_main_process():
                made.enter_context(comparison)
            for checkpoint in checkpoints:
                metrics, list_path = evaluate_checkpoint(args, given, checkpoint, reports.append, made)
                rows.append((checkpoint, metrics, list_path))
            several_lists = write_comparison(comparison.path, rows) if is_main_process() else False
        if is_main_process():  # every folder whole: now printing may fail (a closed pipe) without harm
            print('\n'.join(reports))
            with open(os.path.join(comparison.folder, 'comparison.txt'), errors='surrogateescape') as f:
                print(f.read().rstrip())
            print(f'comparison of {len(rows)} checkpoints in {comparison.folder}: comparison.txt, comparison.csv')
            if several_lists:
                print('  (each on its own validation list, in the list column: give --val_list to compare on one)')
        return rows
    finally:
        cleanup_distributed()


if __name__ == '__main__':
    run_to_exit(lambda argv: main(argv, ARGS))
