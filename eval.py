"""Evaluate a checkpoint: `python eval.py --load_model_path checkpoints/<experiment>/best.pth`.

Writes into `<experiment>/eval/<checkpoint>_<list>_<save_prefix>/`: result.txt, result.json,
predictions.csv, confusion_matrix.png and a picture every --viz_freq batches.
"""
from options import parse_args, parse_test_args

if __name__ == '__main__':
    parse_args(parse_test_args)  # answer --help and option mistakes before the slow torch import

import contextlib
import csv
import json
import os

import torch

from data.augment import denormalize
from data.data_entry import select_eval_loader
from metrics import (accuracy_from_confusion, classification_metrics, confusion_matrix, iou_from_confusion,
                     segmentation_metrics)
from model.model_entry import equip_multi_gpu, select_model
from options import (checkpoints_to_evaluate, create_run_folder, discard_folder_if_setup_fails, evaluated_list_name,
                     prefix_map, prepare_test_args, result_folder)
from utils.checkpoint import load_checkpoint
from utils.distributed import (all_gather_objects, all_reduce_sum, cleanup_distributed, init_distributed,
                               is_main_process, run_on_main_process)
from utils.errors import KilnError, run_cli
from utils.logger import Recorder, progress
from utils.torch_utils import autocast_for, load_weights, place_model, select_device, to_device
from utils.viz import confusion_matrix_image, labeled_grid, save_png, segmentation_grid

# options that describe the model and data; unset ones are taken from the checkpoint's training run
# --data_type when neither it nor the checkpoint says: (without --val_list, with it)
DEFAULT_DATA = {'classify': ('shapes', 'list'), 'segment': ('shapes_seg', 'seg_list')}
INHERITED = ('task', 'model_type', 'data_type', 'img_size', 'num_classes', 'val_list')


def load_evaluated_checkpoint(args):
    """Load --load_model_path and fill the options left unset (task, model, data, image size, ...)
    from the training run that wrote it; returns the checkpoint."""
    checkpoint = load_checkpoint(args.load_model_path)
    if not isinstance(checkpoint, dict):
        raise KilnError(f'{args.load_model_path} holds a {type(checkpoint).__name__}, not model weights; '
                        f'give a checkpoint written by train.py or a state dict')
    trained_with = checkpoint.get('args') if isinstance(checkpoint.get('args'), dict) else {}
    for name in INHERITED:
        if getattr(args, name) is None:
            setattr(args, name, trained_with.get(name))
    if args.model_type is None:
        raise KilnError(f'{args.load_model_path} does not say which model it holds; give --model_type')
    args.task = args.task or 'classify'
    args.data_type = args.data_type or DEFAULT_DATA[args.task][bool(args.val_list)]
    args.img_size = args.img_size or 32
    return checkpoint


class Evaluator:
    """Runs a checkpoint over a list of images and writes metrics, predictions and pictures."""

    def __init__(self, args, checkpoint):
        """`checkpoint` is the loaded --load_model_path; see `load_evaluated_checkpoint`."""
        self.args = args
        self.device = select_device(args)
        self.loader = select_eval_loader(args)
        self.dataset = self.loader.dataset
        args.num_classes = args.num_classes or self.dataset.num_classes
        self.class_names = self.dataset.class_names or checkpoint.get('class_names')
        model = select_model(args)
        load_weights(model, checkpoint, strict=not args.load_not_strict, source=args.load_model_path,
                     prefix_map=prefix_map(args))
        self.model = equip_multi_gpu(place_model(model, args, self.device), args)
        self.autocast = autocast_for(self.device, args.amp)

    def step(self, batch):
        """Move one batch to the device and run the model; return (inputs, outputs, targets)."""
        inputs, targets = to_device(batch, self.device, self.args.channels_last)
        with self.autocast():
            return inputs, self.model(inputs).float(), targets

    def compute_metrics(self, outputs, targets):
        """Metrics of one batch as {name: device tensor}; averaged over the whole list."""
        return classification_metrics(outputs, targets, self.args.topk)

    def gen_imgs_to_write(self, inputs, outputs, targets):
        """Pictures of (the first 32 images of) one batch as {file name stem: HxWx3 uint8 array}."""
        inputs, outputs, targets = inputs[:32], outputs[:32], targets[:32]
        grid = labeled_grid(denormalize(inputs), outputs.argmax(1).tolist(), targets.tolist(), self.class_names)
        return {'predictions': grid}

    def prediction_rows(self, outputs, targets):
        """Per-sample results of one batch as a float64 tensor (N, k): label, prediction, confidence."""
        confidence, predicted = outputs.softmax(dim=1).max(dim=1)
        return torch.stack([targets.double(), predicted.double(), confidence.double()], dim=1)

    def metrics_from_confusion(self, matrix, names):
        """Metrics only the whole list's confusion matrix gives: recall of each class."""
        _, recall = accuracy_from_confusion(matrix)
        return {f'recall/{name}': value for name, value in zip(names, recall.tolist())}

    def write_predictions(self, writer, names, paths, rows):
        """Write predictions.csv (a csv.writer) from `prediction_rows` in dataset order."""
        writer.writerow(['image', 'label', 'prediction', 'confidence', 'label_name', 'prediction_name'])
        for path, (label, predicted, confidence) in zip(paths, rows):
            writer.writerow([path, int(label), int(predicted), f'{confidence:.4f}', names[int(label)],
                             names[int(predicted)]])

    @torch.no_grad()
    def eval(self):
        """Evaluate the whole list and write the result files; return the metrics.

        Under torchrun each rank evaluates every world_size-th image (none twice); counts, sums
        and predictions are gathered, so the results equal those of one process. Rank 0 writes.
        """
        self.model.eval()
        recorder = Recorder()
        num_classes = self.args.num_classes
        matrix = torch.zeros(num_classes, num_classes, dtype=torch.long, device=self.device)
        rows = []
        for i, batch in enumerate(progress(self.loader, self.args.progress_bar and is_main_process(), 'eval')):
            inputs, outputs, targets = self.step(batch)
            for name, value in self.compute_metrics(outputs, targets).items():
                recorder.record(name, value, len(targets))
            matrix += confusion_matrix(outputs.argmax(dim=1).flatten(), targets.flatten(), num_classes)
            rows.append(self.prediction_rows(outputs, targets))
            if self.args.save_viz and i % self.args.viz_freq == 0 and is_main_process():
                for name, image in self.gen_imgs_to_write(inputs, outputs, targets).items():
                    save_png(image, os.path.join(self.args.result_dir, f'{name}_batch{i:04d}.png'))
        metrics = recorder.summary(all_ranks=True)
        all_reduce_sum(matrix)
        names = self.class_names or [str(c) for c in range(num_classes)]
        metrics.update(self.metrics_from_confusion(matrix, names))
        per_rank = all_gather_objects(torch.cat(rows).cpu().tolist())
        in_order = [per_rank[i % len(per_rank)][i // len(per_rank)] for i in range(sum(map(len, per_rank)))]
        if is_main_process():
            self.write_results(metrics, matrix.cpu(), in_order, names)
        return metrics

    def write_results(self, metrics, matrix, rows, names):
        """Write result.txt, result.json, predictions.csv and confusion_matrix.png."""
        folder, args = self.args.result_dir, self.args
        header = {'checkpoint': args.load_model_path, 'list': self.dataset.list_path, 'samples': len(self.dataset)}
        with open(os.path.join(folder, 'result.txt'), 'w') as f:
            f.writelines(f'{key}: {value}\n' for key, value in header.items())
            f.writelines(f'{key}: {value:.4f}\n' for key, value in metrics.items())
        with open(os.path.join(folder, 'result.json'), 'w') as f:
            json.dump({**header, 'metrics': metrics, 'class_names': names,
                       'confusion_matrix': matrix.tolist()}, f, indent=1)
        with open(os.path.join(folder, 'predictions.csv'), 'w', newline='') as f:
            self.write_predictions(csv.writer(f), names, self.dataset.image_paths(), rows)
        save_png(confusion_matrix_image(matrix, names), os.path.join(folder, 'confusion_matrix.png'))


class SegmentationEvaluator(Evaluator):
    """Evaluates a segmentation checkpoint: exact mean IoU and per-class IoU over all pixels, pixel
    accuracy per image, and pictures of image | predicted mask | true mask."""

    def compute_metrics(self, outputs, targets):
        return segmentation_metrics(outputs, targets, self.args.num_classes)

    def gen_imgs_to_write(self, inputs, outputs, targets):
        inputs, outputs, targets = inputs[:8], outputs[:8], targets[:8]
        return {'segmentation': segmentation_grid(denormalize(inputs), outputs.argmax(1), targets, self.args.num_classes)}

    def prediction_rows(self, outputs, targets):
        """Per-image pixel accuracy."""
        return (outputs.argmax(dim=1) == targets).flatten(1).double().mean(dim=1, keepdim=True)

    def metrics_from_confusion(self, matrix, names):
        """The list's mean IoU (over classes present), pixel accuracy and IoU of each class."""
        iou = iou_from_confusion(matrix)
        accuracy, _ = accuracy_from_confusion(matrix)
        return {'miou': iou.nanmean().item(), 'pixel_acc': accuracy.item(),
                **{f'iou/{name}': value for name, value in zip(names, iou.tolist())}}

    def write_predictions(self, writer, names, paths, rows):
        writer.writerow(['image', 'pixel_accuracy'])
        for path, (accuracy,) in zip(paths, rows):
            writer.writerow([path, f'{accuracy:.4f}'])


EVALUATORS = {'classify': Evaluator, 'segment': SegmentationEvaluator}  # --task


def evaluate(argv, checkpoint=None):
    """Evaluate one checkpoint into its own result folder; return (args, metrics)."""
    args = run_on_main_process(prepare_test_args, argv, checkpoint)
    with discard_folder_if_setup_fails(args.result_dir) if is_main_process() else contextlib.nullcontext():
        loaded = load_evaluated_checkpoint(args)
        evaluator = EVALUATORS[args.task](args, loaded)
    metrics = evaluator.eval()
    if is_main_process():
        print(f'{args.load_model_path}: ' + ' '.join(f'{k} {v:.4f}' for k, v in metrics.items() if '/' not in k))
        print(f'  results in {args.result_dir}: result.txt, result.json, predictions.csv, '
              f'confusion_matrix.png{", a picture every --viz_freq batches" if args.save_viz else ""}')
    return args, metrics


def prepare_comparison(args, checkpoints):
    """Check that no result folder exists yet, then create the comparison folder; return its path."""
    for checkpoint in checkpoints:
        if os.path.exists(result_folder(args, checkpoint)):
            raise KilnError(f'{result_folder(args, checkpoint)} already exists; choose a new --save_prefix '
                            f'to keep the old results')
    folder = os.path.join(args.checkpoints_dir, 'comparisons', f'{evaluated_list_name(args)}_{args.save_prefix}')
    create_run_folder(folder, args, 'choose a new --save_prefix to keep the old comparison')
    return folder


def write_comparison(folder, rows):
    """comparison.csv (every metric) and comparison.txt (the main ones, aligned): one row per checkpoint."""
    names = list(dict.fromkeys(name for _, metrics in rows for name in metrics))
    with open(os.path.join(folder, 'comparison.csv'), 'w', newline='') as f:
        writer = csv.writer(f)
        writer.writerow(['checkpoint', *names])
        writer.writerows([path, *(f'{metrics[n]:.6f}' if n in metrics else '' for n in names)] for path, metrics in rows)
    main_names = [name for name in names if '/' not in name]
    table = [['checkpoint', *main_names]] + [[path, *(f'{metrics[n]:.4f}' if n in metrics else '-' for n in main_names)]
                                             for path, metrics in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    with open(os.path.join(folder, 'comparison.txt'), 'w') as f:
        f.writelines('  '.join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() + '\n' for row in table)


def main(argv=None):
    """Join torchrun's processes if any, then evaluate the checkpoint, or each of several and compare them."""
    parsed = parse_args(parse_test_args, argv)
    init_distributed(parsed)
    try:
        checkpoints = checkpoints_to_evaluate(parsed)
        if len(checkpoints) == 1:
            evaluate(argv)
            return
        folder = run_on_main_process(prepare_comparison, parsed, checkpoints)
        rows = [(checkpoint, evaluate(argv, checkpoint)[1]) for checkpoint in checkpoints]
        if is_main_process():
            write_comparison(folder, rows)
            with open(os.path.join(folder, 'comparison.txt')) as f:
                print(f.read().rstrip())
            print(f'comparison of {len(rows)} checkpoints in {folder}: comparison.txt, comparison.csv')
    finally:
        cleanup_distributed()


if __name__ == '__main__':
    run_cli(main)
