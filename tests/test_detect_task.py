"""The third example task, object detection, through the real entry points: train.py learns to find the
generated shapes within the CI budget, eval.py reports mAP, predict.py writes a row per box; and the
task is one file plus registry lines, with its dataset and model files, mentioned nowhere else."""

import csv
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, copy_of_the_project, project_files, run_script, timeout

DETECTION_FILES = ('tasks/detect.py', 'data/det_list_dataset.py', 'data/shapes_det_dataset.py', 'model/center_net/')
DETECTION_NAMES = re.compile(r'detect(?!_anomaly)|center_?net|shapes_det|det_list|ShapesDet|DetList', re.IGNORECASE)


def _ok(result):
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope='module')
def boxes(tmp_path_factory):
    """A small generated detection set: 512 train and 128 val images of 64 pixels."""
    from data.shapes import generate_shape_boxes

    return generate_shape_boxes(str(tmp_path_factory.mktemp('det') / 'boxes'), train_size=512, val_size=128, seed=1)


@pytest.mark.slow
def test_detection_trains_evaluates_and_predicts(boxes, tmp_path):
    checkpoints = tmp_path / 'ck'
    lists = ['--train_list', os.path.join(boxes, 'train.txt'), '--val_list', os.path.join(boxes, 'val.txt')]
    options = '--task detect --data_type shapes_det --epochs 8 --batch_size 32 --lr 6e-3 --warmup_steps 20 --cpu'
    trained = _ok(
        run_script(
            'train.py',
            *options.split(),
            *lists,
            '--checkpoints_dir',
            checkpoints,
            '--no-progress_bar',
            '--print_freq',
            '1000',
        )
    )
    folder = checkpoints / 'center_net_shapes_det_default'  # the task chose the model; the image size is 64
    with open(folder / 'history.json') as f:
        history = json.load(f)['metrics']
    assert max(history['val/map50']) > 0.2, history['val/map50']  # measured 0.3 after 8 epochs; a full run 0.98
    assert 'val/map50' in trained.stdout

    evaluated = _ok(run_script('eval.py', '--load_model_path', str(folder), '--cpu', '--no-progress_bar'))
    result = folder / 'eval' / 'best_val_default'
    with open(result / 'result.json') as f:
        metrics = json.load(f)['metrics']
    assert metrics['map'] == pytest.approx(max(history['val/map']), abs=1e-9)  # the same loop, best.pth by mAP
    assert 0 <= metrics['map'] <= metrics['map50'] and 'map50' in evaluated.stdout
    assert (result / 'detections_batch0000.png').is_file()

    _ok(
        run_script(
            'predict.py',
            '--load_model_path',
            str(folder),
            '--input',
            os.path.join(boxes, 'val.txt'),
            '--cpu',
            '--no-progress_bar',
        )
    )
    with open(folder / 'predict' / 'best_val_default' / 'predictions.csv') as f:
        rows = list(csv.DictReader(f))
    assert rows and set(rows[0]) == {'image', 'class', 'class_name', 'score', 'x1', 'y1', 'x2', 'y2'}
    found = [row for row in rows if row['score']]  # the others: an image without a detection, fields empty
    assert all(float(row['score']) >= 0.3 and float(row['x2']) > float(row['x1']) for row in found)
    assert all(set(row.values()) == {row['image'], ''} for row in rows if not row['score'])
    assert len({row['image'] for row in found}) > 16  # boxes found in many of the 128 images
    assert len({row['image'] for row in rows}) == 128  # and every image has its rows


def test_detection_is_one_task_file_and_registry_lines(tmp_path):
    """No code outside tasks/, data/ and model/ (docs, packaging and tests aside) mentions detection, and
    the registries name it in one line each for the task, its two datasets and its model."""
    copy_of_the_project(tmp_path)
    outside = [
        path
        for path in project_files(tmp_path)
        if not path.startswith(('tasks/', 'data/', 'model/', 'tests/'))
        and path.endswith(('.py', '.sh', '.xml', '.json', 'run'))
    ]
    assert 'train.py' in outside and 'utils/evaluation.py' in outside
    mentions = [path for path in outside if DETECTION_NAMES.search(open(tmp_path / path).read())]
    assert mentions == []
    for registry, count in (('tasks/task_entry.py', 1), ('data/data_entry.py', 2), ('model/model_entry.py', 1)):
        lines = [line for line in open(os.path.join(REPO, registry)) if DETECTION_NAMES.search(line)]
        assert len(lines) == count and all(line.strip().startswith("'") for line in lines), (registry, lines)


def test_kiln_without_the_detection_files_still_works(tmp_path):
    """Delete the task's files and registry lines from a copy: everything else still imports and runs."""
    copy_of_the_project(tmp_path)
    for path in DETECTION_FILES:
        subprocess.run(['rm', '-r', str(tmp_path / path)], check=True)
    for registry in ('tasks/task_entry.py', 'data/data_entry.py', 'model/model_entry.py'):
        lines = open(tmp_path / registry).read().splitlines(keepends=True)
        open(tmp_path / registry, 'w').write(''.join(line for line in lines if not DETECTION_NAMES.search(line)))
    probe = (
        'import train, eval, predict, options\n'
        'from tasks.task_entry import TASKS\n'
        'print(sorted(TASKS), train.hparams_metric_names(options.parse_args(options.parse_train_args, [])))'
    )
    result = subprocess.run(
        [sys.executable, '-c', probe], cwd=tmp_path, capture_output=True, text=True, timeout=timeout()
    )
    from tasks.task_entry import TASKS

    left = sorted(name for name in TASKS if name != 'detect')  # a project's own tasks too
    assert result.returncode == 0 and str(left) in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize('resize', ['squash', 'crop'])
def test_rows_give_boxes_in_the_image_pixels_of_the_list(tmp_path, monkeypatch, resize):
    """eval.py's and predict.py's rows name boxes in the pixels the list's boxes are in (they were in the
    model's input pixels: an 80x64 image at --img_size 32 gave x scaled by 0.4, y by 0.5)."""
    import argparse

    import torch
    from PIL import Image

    import tasks.detect as detect
    from data.det_list_dataset import DetListDataset

    Image.new('RGB', (80, 64), 'black').save(tmp_path / 'wide.png')
    (tmp_path / 'train.txt').write_text('wide.png 23,17,48,42,1\n')
    (tmp_path / 'classes.txt').write_text('a\nb\n')
    options = argparse.Namespace(
        train_list=str(tmp_path / 'train.txt'), img_size=32, num_classes=None, data_type='det_list', resize=resize
    )
    sample = DetListDataset(options, 'train')[0]
    batch = {'image': sample['image'][None].float(), 'region': sample['region'][None]}
    task = detect.DetectTask(argparse.Namespace(num_classes=2, loss=None), ['a', 'b'])
    decoded = (sample['boxes'][None], torch.tensor([[0.9]]), sample['box_labels'][None])  # the model finds the box
    monkeypatch.setattr(detect, 'decode_detections', lambda outputs: decoded)
    (rows,) = task.predict_rows(batch, None, ['wide.png'], None)
    ((label, name, score, *box),) = rows
    assert (label, name) == (1, 'b') and [float(v) for v in box] == pytest.approx([23, 17, 48, 42], abs=0.05), box


def test_an_image_without_a_detection_keeps_its_row(monkeypatch):
    """predictions.csv has every image read: one without a box over MIN_SCORE gets a row of empty fields."""
    import argparse

    import torch

    import tasks.detect as detect

    task = detect.DetectTask(argparse.Namespace(num_classes=2, loss=None), ['a', 'b'])
    boxes = torch.tensor([[[1.0, 2.0, 3.0, 4.0]], [[5.0, 6.0, 7.0, 8.0]]])
    decoded = (boxes, torch.tensor([[0.9], [detect.MIN_SCORE / 2]]), torch.tensor([[1], [0]]))
    monkeypatch.setattr(detect, 'decode_detections', lambda outputs: decoded)
    found, empty = task.predict_rows({'image': torch.zeros(2, 3, 8, 8)}, None, ['x.png', 'y.png'], None)
    assert found == [[1, 'b', '0.9000', '1.0', '2.0', '3.0', '4.0']]
    assert empty == [[''] * (len(task.predict_header) - 1)]


def test_normalized_boxes_are_refused_and_small_boxes_kept(tmp_path):
    """YOLO-style 0..1 boxes trained on nothing (each under a pixel, dropped) and validation lost its
    small true boxes, both without a word."""
    import argparse

    import torch
    from PIL import Image

    from data.det_list_dataset import DetListDataset
    from utils.errors import KilnError

    Image.new('RGB', (400, 400), 'black').save(tmp_path / 'big.png')
    (tmp_path / 'yolo.txt').write_text('big.png 0.375,0.5,0.583,0.833,0\n')
    options = argparse.Namespace(img_size=32, num_classes=None, data_type='det_list')
    with pytest.raises(KilnError, match='every box lies within 0..1, as normalized'):
        DetListDataset(argparse.Namespace(**vars(options), train_list=str(tmp_path / 'yolo.txt')), 'train')
    (tmp_path / 'small.txt').write_text('big.png 10,10,200,200,0 300,300,308,308,1\n')
    sample = DetListDataset(argparse.Namespace(**vars(options), train_list=str(tmp_path / 'small.txt')), 'train')[0]
    assert sample['box_labels'].tolist() == [0, 1]  # the 8-pixel box is 0.64 pixels at 32: kept
    assert sample['boxes'][1].tolist() == pytest.approx([24, 24, 24.64, 24.64])
    # a training crop at decode time drops what it leaves under a pixel, as the crops on the device do
    training = DetListDataset(argparse.Namespace(**vars(options), train_list=str(tmp_path / 'small.txt')), 'train')

    class WholeImage:  # a resized crop that keeps the whole image: only the rule for small boxes differs
        def draw_boxes(self, widths, heights, generator=None):
            return torch.stack([torch.zeros_like(widths), torch.zeros_like(heights), widths, heights], 1).float()

    training.decode_crops(WholeImage())
    assert training[0]['box_labels'].tolist() == [0]


def test_a_box_outside_its_image_is_one_line_and_one_partly_outside_is_clipped(tmp_path):
    """Boxes written for another resolution (500,500,600,600 in a 100x60 image) were clamped to nothing
    and dropped: training and validation's mAP went on without them, without a word."""
    import argparse

    from PIL import Image

    from data.det_list_dataset import DetListDataset

    for name in ('a', 'b'):
        Image.new('RGB', (100, 60), 'black').save(tmp_path / f'{name}.png')
    (tmp_path / 'classes.txt').write_text('thing\n')
    (tmp_path / 'partly.txt').write_text('a.png 90,50,130,70,0\nb.png 10,10,20,20,0\n')
    options = argparse.Namespace(img_size=50, num_classes=None, data_type='det_list', resize='squash')
    sample = DetListDataset(argparse.Namespace(**vars(options), train_list=str(tmp_path / 'partly.txt')), 'train')[0]
    assert sample['boxes'].tolist() == [pytest.approx([45, 250 / 6, 50, 50])]  # clipped at 100x60, then halved
    (tmp_path / 'outside.txt').write_text('a.png 10,10,20,20,0\nb.png 10,10,20,20,0 500,500,600,600,0\n')
    result = run_script(
        'train.py',
        *('--task', 'detect', '--data_type', 'det_list', '--train_list', tmp_path / 'outside.txt'),
        *('--val_list', tmp_path / 'partly.txt', '--img_size', '32', '--batch_size', '2', '--epochs', '1'),
        *('--num_workers', '1', '--cpu', '--no-progress_bar', '--checkpoints_dir', tmp_path / 'ck'),
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
    assert 'outside.txt:2: box 500,500,600,600 lies outside its image (100x60 pixels' in lines[0], lines[0]
