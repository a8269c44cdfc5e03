"""The parts of the detection task: box data generator, dataset, CenterNet model, loss, decoding,
mAP (checked against torchmetrics/pycocotools) and pictures, plus one short training run."""

import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

import data.shapes_det_dataset as shapes_det_dataset
from conftest import REPO, timeout
from data.det_list_dataset import DetListDataset
from data.shapes import CLASS_NAMES, generate_shape_boxes, main as shapes_main
from data.shapes_det_dataset import ShapesDetDataset
from model.center_net import CenterNet
from tasks.detect import (
    IOU_THRESHOLDS,
    RECALL_THRESHOLDS,
    STRIDE,
    decode_detections,
    detection_loss,
    draw_detections,
    mean_average_precision,
)
from utils.errors import KilnError


def _read_lines(root, split):
    """[(image array HxWx3, [(x1, y1, x2, y2, label)])] of a generated split."""
    items = []
    with open(os.path.join(root, f'{split}.txt')) as f:
        for line in f:
            path, *fields = line.split()
            boxes = [tuple(float(v) for v in field.split(',')) for field in fields]
            items.append((np.array(Image.open(os.path.join(root, path))), boxes))
    return items


def _files(root):
    return {
        os.path.relpath(os.path.join(folder, name), root): open(os.path.join(folder, name), 'rb').read()
        for folder, _, names in os.walk(root)
        for name in names
    }


def _args(**overrides):
    values = dict(train_list=None, val_list=None, img_size=64, num_classes=None, data_root=None)
    values.update(overrides)
    return types.SimpleNamespace(**values)


@pytest.fixture(scope='module')
def tiny_boxes(tmp_path_factory):
    """A small detection set: 24 train and 12 val images of 64 px."""
    return generate_shape_boxes(str(tmp_path_factory.mktemp('det') / 'shapes_det'), train_size=24, val_size=12)


def test_box_generator_is_deterministic_and_its_boxes_fit_the_pixels(tiny_boxes, tmp_path):
    again = generate_shape_boxes(str(tmp_path / 'again'), train_size=24, val_size=12)
    other = generate_shape_boxes(str(tmp_path / 'other'), train_size=24, val_size=12, seed=1)
    assert _files(tiny_boxes) == _files(again) != _files(other)
    assert generate_shape_boxes(again, train_size=24, val_size=12) == again  # a complete copy is reused
    with open(os.path.join(tiny_boxes, 'classes.txt')) as f:
        assert tuple(f.read().split()) == CLASS_NAMES

    centres_differ, non_rings, counts = 0, 0, []
    for image, boxes in _read_lines(tiny_boxes, 'train') + _read_lines(tiny_boxes, 'val'):
        assert image.shape == (64, 64, 3) and 1 <= len(boxes) <= 4
        counts.append(len(boxes))
        outside = np.ones((64, 64), dtype=bool)
        for x1, y1, x2, y2, label in boxes:
            assert 0 <= x1 < x2 <= 64 and 0 <= y1 < y2 <= 64 and label in range(len(CLASS_NAMES))
            assert 10 <= max(x2 - x1, y2 - y1) <= 29  # sides of roughly 12-28 px
            outside[int(y1) : int(np.ceil(y2)), int(x1) : int(np.ceil(x2))] = False
        background = np.median(image[outside].astype(int), axis=0)  # noise and a little clutter: the median holds
        for x1, y1, x2, y2, label in boxes:
            inside = image[int(y1) : int(np.ceil(y2)), int(x1) : int(np.ceil(x2))].astype(int)
            differs = np.abs(inside - background).sum(-1) > 60
            assert differs.mean() > 0.15  # the shape fills a good part of its box
            # tight: the shape reaches each side (within its anti-aliased edge pixels)
            assert differs[:2].any() and differs[-2:].any() and differs[:, :2].any() and differs[:, -2:].any()
            if CLASS_NAMES[int(label)] != 'ring':  # a ring's centre is background
                non_rings += 1
                centre = image[int((y1 + y2) / 2), int((x1 + x2) / 2)].astype(int)
                centres_differ += np.abs(centre - background).sum() > 60
    assert centres_differ >= 0.95 * non_rings  # a later shape may rarely cover an earlier one's centre
    assert len(set(counts)) >= 3  # images really hold different numbers of shapes


def test_box_generator_command_line(tmp_path, capsys):
    shapes_main([str(tmp_path / 'cli'), '--detection', '--train_size', '3', '--val_size', '2', '--size', '48'])
    assert 'shapes dataset in' in capsys.readouterr().out
    lines = open(tmp_path / 'cli' / 'val.txt').read().splitlines()
    assert len(lines) == 2 and lines[0].startswith('images/val/00000.png ')
    assert Image.open(tmp_path / 'cli' / 'images' / 'val' / '00001.png').size == (48, 48)


def _check_item(item, size, image_size=64):
    assert set(item) == {'image', 'boxes', 'box_labels', 'region'}
    assert item['region'].tolist() == [0, 0, image_size, image_size]  # the whole image became the input
    assert item['image'].dtype == torch.uint8 and item['image'].shape == (3, size, size)
    assert item['boxes'].dtype == torch.float32 and item['boxes'].shape[1:] == (4,)
    assert item['box_labels'].dtype == torch.int64 and item['box_labels'].shape == item['boxes'].shape[:1]


def test_boxes_dataset_contract_and_tensors(tiny_boxes):
    val_list = os.path.join(tiny_boxes, 'val.txt')
    on_disk = DetListDataset(_args(val_list=val_list), 'val')  # read per sample (by DataLoader workers)
    dataset = ShapesDetDataset(_args(val_list=val_list), 'val')  # decoded once into memory
    assert len(dataset) == 12 and dataset.num_classes == 6 and dataset.class_names == list(CLASS_NAMES)
    assert dataset.targets == ('boxes', 'box_labels') and dataset.augment == ('crop', 'hflip')
    assert on_disk.augment == ('crop',)  # a user's boxes: flips only where the data allows them
    assert dataset.list_path == val_list and dataset.image_paths()[3].endswith('images/val/00003.png')
    lines = _read_lines(tiny_boxes, 'val')
    from_disk = [on_disk[i] for i in range(len(on_disk))]
    for item, (image, boxes) in zip(from_disk, lines):
        _check_item(item, 64)
        assert torch.equal(item['image'], torch.from_numpy(image).permute(2, 0, 1))
        assert torch.equal(item['boxes'], torch.tensor([b[:4] for b in boxes]))
        assert item['box_labels'].tolist() == [int(b[4]) for b in boxes]

    tensors = dataset.tensors()
    most = max(len(boxes) for _, boxes in lines)
    assert tensors['image'].shape == (12, 3, 64, 64) and tensors['image'].dtype == torch.uint8
    assert tensors['boxes'].shape == (12, most, 4) and tensors['boxes'].dtype == torch.float32
    assert tensors['box_labels'].shape == (12, most) and tensors['box_labels'].dtype == torch.int64
    assert dataset.tensors() is tensors  # decoded once
    for i, item in enumerate(from_disk):
        count = len(item['box_labels'])
        assert torch.equal(tensors['image'][i], item['image'])
        assert torch.equal(tensors['boxes'][i, :count], item['boxes']) and not tensors['boxes'][i, count:].any()
        assert torch.equal(tensors['box_labels'][i, :count], item['box_labels'])
        assert (tensors['box_labels'][i, count:] == -1).all()
        row = dataset[i]  # a row of the tensors: padded like a batch
        assert torch.equal(row['image'], item['image']) and torch.equal(row['boxes'][:count], item['boxes'])

    half = DetListDataset(_args(val_list=val_list, img_size=32), 'val')
    _check_item(half[5], 32)
    assert torch.allclose(half[5]['boxes'], from_disk[5]['boxes'] / 2)  # boxes follow the resize
    assert ShapesDetDataset(_args(val_list=val_list, img_size=32), 'val').tensors()['image'].shape == (12, 3, 32, 32)


def test_boxes_dataset_generates_its_default_copy_and_checks_lines(tmp_path, monkeypatch):
    small = lambda root: generate_shape_boxes(root, train_size=4, val_size=2)  # noqa: E731
    monkeypatch.setattr(shapes_det_dataset, 'generate_shape_boxes', small)
    dataset = ShapesDetDataset(_args(data_root=str(tmp_path)), 'train')
    assert dataset.list_path == os.path.join(str(tmp_path), 'shapes_det', 'train.txt') and len(dataset) == 4

    image = os.path.join(tmp_path, 'shapes_det', 'images', 'train', '00000.png')
    other = os.path.join(tmp_path, 'shapes_det', 'images', 'train', '00001.png')
    listing = tmp_path / 'mine.txt'
    listing.write_text(f'# no boxes on the first image\n{image}\n{other} 1,2,30,40,4  # a comment\n')
    mine = ShapesDetDataset(_args(train_list=str(listing)), 'train')
    assert mine.num_classes == 5 and mine.class_names is None  # no classes.txt there: the largest class + 1
    assert mine[0]['box_labels'].tolist() == [-1] and mine[1]['box_labels'].tolist() == [4]  # padded rows
    assert mine.tensors()['box_labels'].tolist() == [[-1], [4]]
    for bad in ('1,2,30,40', '1,2,30,x,1', '30,2,1,40,1', '1,2,30,40,-1', '1,2,inf,40,1', '1,2,30,nan,1'):
        listing.write_text(f'{image}\n{image} {bad}\n')
        with pytest.raises(KilnError, match='mine.txt:2: expected boxes'):
            DetListDataset(_args(train_list=str(listing)), 'train')
    # a box with another separator is told to use commas; the quoting hint is for a path cut at a space
    listing.write_text(f'{image}\n{image} 24;18;36;28;0\n')
    with pytest.raises(KilnError, match=r"got '24;18;36;28;0' \(separate the five values of a box with commas"):
        DetListDataset(_args(train_list=str(listing)), 'train')
    # x,y,width,height (COCO's) is told that x2,y2 is a corner; a box of no area, to drop it
    for bad, hint in (
        ('40,40,10,10,0', 'not a width and height'),
        ('5,5,5,9,0', 'a box of no area: drop it'),
        ('10, 10, 30, 20, 1', 'with commas and no spaces'),
    ):
        listing.write_text(f'{image} {bad}\n')
        with pytest.raises(KilnError, match=hint):
            DetListDataset(_args(train_list=str(listing)), 'train')
    listing.write_text(f'{image}\nmy images/a.png 1,2,30,40,0\n')
    with pytest.raises(KilnError, match=r"got 'images/a.png' \(a path with spaces must be quoted"):
        DetListDataset(_args(train_list=str(listing)), 'train')
    listing.write_text(f'{image} 1,2,30,40,9\n')
    with pytest.raises(KilnError, match='class 9 is outside 0..5'):
        DetListDataset(_args(train_list=str(listing), num_classes=6), 'train')
    # a line per box (as converters write) made an image per box, each with the others' objects as background
    listing.write_text(f'{image} 1,2,30,40,0\n{other} 1,2,30,40,0\n./{os.path.relpath(image, tmp_path)} 5,5,20,20,1\n')
    with pytest.raises(KilnError, match=r'mine.txt:1 and line 3 give image .*00000.png two lines of boxes; put all'):
        DetListDataset(_args(train_list=str(listing)), 'train')
    listing.write_text(f'{image} 1,2,30,40,0\n{image} 1,2,30,40,0\n')  # listed twice alike: seen twice, as allowed
    assert len(DetListDataset(_args(train_list=str(listing)), 'train')) == 2
    # a class number mistyped made as many classes (100001 outputs: out of memory at real sizes)
    listing.write_text(f'{image} 1,2,30,40,0\n{other} 1,2,30,40,100000\n')
    with pytest.raises(KilnError, match=r'mine.txt:2: label 100000 makes 100001 classes, but only 2 different'):
        DetListDataset(_args(train_list=str(listing)), 'train')


def test_parts_do_not_import_torchvision():
    probe = (
        'import sys, data.shapes_det_dataset, model.center_net, tasks.detect\n'
        'print("TORCHVISION" if "torchvision" in sys.modules else "CLEAN")'
    )
    result = subprocess.run([sys.executable, '-c', probe], cwd=REPO, capture_output=True, text=True, timeout=timeout())
    assert result.stdout.strip() == 'CLEAN', result.stderr


# two images: three boxes, and one box; the second image's list is padded with label -1
BOXES = torch.tensor(
    [[[4.0, 6, 22, 26], [30, 30, 58, 50], [40, 2, 60, 20]], [[10, 12, 30, 40], [0, 0, 0, 0], [0, 0, 0, 0]]]
)
LABELS = torch.tensor([[0, 3, 3], [5, -1, -1]])


def _model(num_classes=6, **kwargs):
    torch.manual_seed(0)
    return CenterNet(types.SimpleNamespace(num_classes=num_classes), **kwargs)


def _right_answer(boxes, labels, num_classes=6, size=64):
    """Model outputs that say exactly the true boxes: confident centre peaks, true sizes and offsets."""
    cells = size // STRIDE
    heatmap = torch.full((len(boxes), num_classes, cells, cells), -12.0)
    box_size, offset = torch.zeros(len(boxes), 2, cells, cells), torch.zeros(len(boxes), 2, cells, cells)
    for b in range(len(boxes)):
        for (x1, y1, x2, y2), label in zip(boxes[b].tolist(), labels[b].tolist()):
            if label < 0:
                continue
            cx, cy = (x1 + x2) / 2 / STRIDE, (y1 + y2) / 2 / STRIDE
            heatmap[b, label, int(cy), int(cx)] = 12.0
            box_size[b, :, int(cy), int(cx)] = torch.tensor([x2 - x1, y2 - y1]) / STRIDE
            offset[b, :, int(cy), int(cx)] = torch.tensor([cx - int(cx), cy - int(cy)])
    return {'heatmap': heatmap, 'size': box_size, 'offset': offset}


def test_center_net_shapes_and_layer_groups():
    model = _model()
    outputs = model(torch.randn(2, 3, 64, 64))
    assert outputs['heatmap'].shape == (2, 6, 16, 16)
    assert outputs['size'].shape == outputs['offset'].shape == (2, 2, 16, 16)
    assert model(torch.randn(1, 3, 96, 96))['heatmap'].shape == (1, 6, 24, 24)  # any multiple of 16
    assert [name for name, _ in model.named_children()][-1] == 'head'
    assert sum(p.numel() for p in model.parameters()) < 1_000_000  # trains on a CPU


def test_loss_is_finite_and_lowest_for_the_right_answer():
    outputs = _model()(torch.randn(2, 3, 64, 64))
    loss, parts = detection_loss(outputs, BOXES, LABELS, parts=True)
    assert torch.isfinite(loss) and loss > 0 and set(parts) == {'heatmap', 'size', 'offset'}
    loss.backward()
    right = detection_loss(_right_answer(BOXES, LABELS), BOXES, LABELS)
    assert right < 1e-3 < loss
    shifted = _right_answer(BOXES + 4, LABELS)  # peaks one cell off: worse
    assert detection_loss(shifted, BOXES, LABELS) > 100 * right
    empty = detection_loss(outputs, BOXES[:, :0], LABELS[:, :0])  # no boxes at all: background only
    assert torch.isfinite(empty)


def test_decode_returns_fixed_shapes_and_finds_the_right_answer():
    boxes, scores, labels = decode_detections(_right_answer(BOXES, LABELS), k=50)
    assert boxes.shape == (2, 50, 4) and scores.shape == labels.shape == (2, 50)
    assert (scores[:, :-1] >= scores[:, 1:]).all() and ((boxes >= 0) & (boxes <= 64)).all()
    assert torch.allclose(scores[0, :3], torch.ones(3)) and scores[0, 3] < 1e-4
    order = boxes[0, :3, 0].argsort()  # the true boxes are in order of x1
    assert torch.allclose(boxes[0, order], BOXES[0], atol=1e-4) and torch.equal(labels[0, order], LABELS[0])
    assert torch.allclose(boxes[1, 0], BOXES[1, 0], atol=1e-4) and labels[1, 0] == 5
    random = decode_detections(_model()(torch.randn(3, 3, 64, 64)), k=7)
    assert [tuple(t.shape) for t in random] == [(3, 7, 4), (3, 7), (3, 7)]


def test_loss_and_decode_never_read_tensor_values_on_the_host():
    # meta tensors have no values: any .item(), nonzero() or boolean-mask indexing raises
    outputs = {key: value.detach().to('meta') for key, value in _right_answer(BOXES, LABELS).items()}
    assert detection_loss(outputs, BOXES.to('meta'), LABELS.to('meta')).shape == ()
    assert [tuple(t.shape) for t in decode_detections(outputs, k=20)] == [(2, 20, 4), (2, 20), (2, 20)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a GPU')
def test_loss_and_decode_run_without_sync_on_a_gpu():
    model = _model().cuda()
    images, boxes, labels = torch.randn(2, 3, 64, 64).cuda(), BOXES.cuda(), LABELS.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        outputs = model(images)
        detection_loss(outputs, boxes, labels).backward()
        decode_detections(outputs)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _random_case(seed, num_classes=4, images=10):
    """Predictions (jittered true boxes, false alarms, duplicates, tied scores) and targets."""
    g = torch.Generator().manual_seed(seed)

    def boxes(count):
        corner = torch.rand(count, 2, generator=g) * 50
        return torch.cat([corner, corner + 2 + torch.rand(count, 2, generator=g) * 20], dim=1)

    predictions, targets = [], []
    for _ in range(images):
        true_boxes = boxes(int(torch.randint(0, 5, (1,), generator=g)))
        true_labels = torch.randint(0, num_classes - 1, (len(true_boxes),), generator=g)  # the last class: no truth
        count = int(torch.randint(0, 9, (1,), generator=g))
        if len(true_boxes):
            pick = torch.randint(0, len(true_boxes), (count,), generator=g)
            found = true_boxes[pick] + torch.randn(count, 4, generator=g) * 2
            found = torch.cat([torch.minimum(found[:, :2], found[:, 2:]), torch.maximum(found[:, :2], found[:, 2:])], 1)
            wrong = torch.rand(count, generator=g) < 0.2
            labels = torch.where(wrong, torch.randint(0, num_classes, (count,), generator=g), true_labels[pick])
        else:
            found, labels = boxes(count), torch.randint(0, num_classes, (count,), generator=g)
        scores = torch.rand(count, generator=g)
        if seed % 2:
            scores = (scores * 4).round() / 4  # many ties
        predictions.append((found, scores, labels))
        targets.append((true_boxes, true_labels))
    return predictions, targets


def _hand_made_cases():
    """(predictions, targets, expected {'map50', 'map'} or None) for edge cases."""
    box, other = torch.tensor([[10.0, 10, 30, 30]]), torch.tensor([[40.0, 40, 60, 60]])
    half = torch.tensor([[10.0, 10, 30, 50]])  # IoU exactly 0.5 with `box`
    one = lambda *v: torch.tensor(v)  # noqa: E731
    empty = (torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.int64))
    return [
        # perfect
        ([(box, one(0.9), one(1))], [(box, one(1))], {'map50': 1.0, 'map': 1.0}),
        # a duplicate below the match costs nothing; a false alarm above it halves the precision
        ([(torch.cat([box, box]), one(0.9, 0.8), one(1, 1))], [(box, one(1))], {'map50': 1.0, 'map': 1.0}),
        ([(torch.cat([other, box]), one(0.9, 0.8), one(1, 1))], [(box, one(1))], {'map50': 0.5, 'map': 0.5}),
        # IoU 0.5 matches at the 0.5 threshold only
        ([(half, one(0.7), one(2))], [(box, one(2))], {'map50': 1.0, 'map': 0.1}),
        # an image with no predictions: recall stops at 1/2
        ([(box, one(0.9), one(0)), empty], [(box, one(0)), (other, one(0))], {'map50': 51 / 101, 'map': 51 / 101}),
        # a class with predictions but no truth is not averaged in; a class with truth but none found counts 0
        (
            [(torch.cat([box, other]), one(0.9, 0.9), one(0, 3))],
            [(torch.cat([box, other]), one(0, 1))],
            {'map50': 0.5, 'map': 0.5},
        ),
        # no truth anywhere: -1, as COCO reports
        (
            [(box, one(0.5), one(0))],
            [(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64))],
            {'map50': -1.0, 'map': -1.0},
        ),
        # a detection equally close (IoU 0.6) to two true boxes takes the last, as COCO does, which frees the
        # first for the next detection
        (
            [(torch.tensor([[5.0, 0, 25, 20], [0, 0, 20, 20]]), one(0.9, 0.8), one(2, 2))],
            [(torch.tensor([[0.0, 0, 20, 20], [10, 0, 30, 20]]), one(2, 2))],
            None,
        ),
        # equal scores across images, two classes, duplicates in several images
        (
            [
                (torch.cat([box, box, other]), one(0.5, 0.5, 0.5), one(0, 0, 1)),
                (torch.cat([other, half]), one(0.5, 0.5), one(1, 0)),
            ],
            [(torch.cat([box, other]), one(0, 1)), (half, one(0))],
            None,
        ),
    ]


def test_mean_average_precision_hand_made_cases():
    for predictions, targets, expected in _hand_made_cases():
        if expected is not None:
            assert mean_average_precision(predictions, targets, num_classes=4) == pytest.approx(expected, abs=1e-12)


def test_each_class_has_its_ap50_and_map50_is_their_mean():
    """result.txt of a detection run had mAP only: which class fails was not to be seen."""
    for predictions, targets, _ in _hand_made_cases():
        scored = mean_average_precision(predictions, targets, num_classes=4, class_names=['a', 'b', 'c', 'd'])
        present = {int(label) for _, labels in targets for label in torch.as_tensor(labels).reshape(-1).tolist()}
        per_class = [scored[f'ap50/{name}'] for name in 'abcd']
        assert [not np.isnan(value) for value in per_class] == [c in present for c in range(4)], scored
        if present:
            assert scored['map50'] == pytest.approx(np.nanmean(per_class), abs=1e-12)


def test_mean_average_precision_agrees_with_torchmetrics():
    detection = pytest.importorskip(
        'torchmetrics.detection',
        reason='torchmetrics (with pycocotools) is a test-only dependency: pip install torchmetrics pycocotools',
    )
    cases = [(p, t) for p, t, _ in _hand_made_cases()] + [_random_case(seed) for seed in range(16)]
    for predictions, targets in cases:
        # COCO's own float64 thresholds: torchmetrics' default ones are float32 values, a hair off 0.55, 0.3, ...,
        # which moves results by ~1e-3 where an IoU or recall lands exactly on a threshold
        reference = detection.MeanAveragePrecision(
            iou_type='bbox', iou_thresholds=IOU_THRESHOLDS.tolist(), rec_thresholds=RECALL_THRESHOLDS.tolist()
        )
        reference.update(
            [{'boxes': b, 'scores': s, 'labels': c} for b, s, c in predictions],
            [{'boxes': b, 'labels': c} for b, c in targets],
        )
        expected = reference.compute()
        mine = mean_average_precision(predictions, targets, num_classes=4)
        assert mine['map50'] == pytest.approx(float(expected['map_50']), abs=1e-6)
        assert mine['map'] == pytest.approx(float(expected['map']), abs=1e-6)


def test_a_centre_off_the_picture_decodes_to_an_empty_box_and_is_drawn():
    """Offsets gone wild (early training) gave boxes with x2 < x1, and drawing them failed the run."""
    generator = torch.Generator().manual_seed(0)
    for offset in (-30.0, 30.0):
        outputs = {
            'heatmap': torch.randn(2, 3, 8, 8, generator=generator),
            'size': torch.rand(2, 2, 8, 8, generator=generator) * 4,
            'offset': torch.full((2, 2, 8, 8), offset),
        }
        boxes, scores, labels = decode_detections(outputs)
        assert (boxes[..., 2:] >= boxes[..., :2]).all() and boxes.min() >= 0 and boxes.max() <= 32, offset
        draw_detections(
            torch.zeros(2, 3, 32, 32, dtype=torch.uint8), boxes, labels, scores * 0 + 1, None, BOXES, LABELS
        )


def test_draw_detections_returns_a_picture():
    boxes, scores, labels = decode_detections(_right_answer(BOXES, LABELS))
    images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    picture = draw_detections(images, boxes, labels, scores, list(CLASS_NAMES), BOXES, LABELS)
    assert picture.dtype == np.uint8 and picture.ndim == 3 and picture.shape[2] == 3
    assert picture.shape[0] >= 4 * 64 and picture.shape[1] >= 2 * 4 * 64  # two enlarged tiles side by side
    plain = draw_detections(images, boxes, labels, scores * 0, None, [b[:0] for b in BOXES], LABELS[:, :0])
    assert plain.shape == picture.shape and (plain != picture).any()  # nothing drawn on the same images
    # two predictions of one box: their labels were drawn over each other ('sqring 0.495'); now the less
    # likely one's label is under the other's, each on its class's colour
    from tasks.detect import PALETTE
    from utils.viz import CAPTION

    box = torch.tensor([[[8.0, 8.0, 40.0, 40.0], [8.0, 8.0, 40.0, 40.0]]])
    twice = draw_detections(images[:1], box, torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.9]]), list(CLASS_NAMES),
                            [box[0][:0]], torch.zeros(1, 0))  # fmt: skip
    top, left = CAPTION + 4 + 8 * 4, 4 + 8 * 4  # the box's corner: under the title, past the padding
    assert tuple(twice[top + 6, left + 1]) == PALETTE[2] and tuple(twice[top + 12 + 6, left + 1]) == PALETTE[1]


def test_the_map_of_a_crowded_image_counts_up_to_100_detections():
    """Validation kept the 50 best detections of an image: with 64 objects found exactly, mAP was 0.78."""
    from tasks.detect import DetectionMetrics

    corners = torch.tensor([(16.0 * x + 2, 16.0 * y + 2) for y in range(8) for x in range(8)])
    boxes = torch.cat([corners, corners + 12], dim=1)[None]  # 64 boxes of 12 pixels, one per 16-pixel cell
    labels = torch.zeros(1, 64, dtype=torch.long)
    metrics = DetectionMetrics(num_classes=6)
    metrics.update(_right_answer(boxes, labels, size=128), {'boxes': boxes, 'box_labels': labels})
    assert metrics.compute() == {'map50': 1.0, 'map': 1.0}
