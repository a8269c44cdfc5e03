"""The training recipe: colour jitter, random erasing, mixup and cutmix, an EMA of the weights, and timm
backbones. Each part does what it says, the same for a sample whatever the batch size, and a run with
them resumes bitwise exactly after a SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, experiment_of, run_script, timeout, tiny_run_args, train_succeeds


def _load(path):
    return torch.load(path, weights_only=True, map_location='cpu')


# --- the augmentations, one by one ---------------------------------------------------------------------


def test_colour_jitter_scales_brightness_contrast_and_saturation():
    from data.augment import ColorJitter

    image = torch.tensor([[[[100, 200]], [[50, 100]], [[0, 60]]]], dtype=torch.uint8)  # (1, 3, 1, 2)

    def jittered(brightness, contrast, saturation):
        batch = {'image': image.clone()}
        ColorJitter(2).apply(batch, {'factors': torch.tensor([[brightness, contrast, saturation]])})
        return batch['image'].float()

    assert torch.equal(jittered(1, 1, 1), image.float())
    assert torch.equal(jittered(0.5, 1, 1), (image.float() * 0.5).round())
    gray = jittered(1, 1, 0)  # no saturation: every channel is the luma
    assert torch.equal(gray[:, 0], gray[:, 1]) and torch.equal(gray[:, 1], gray[:, 2])
    flat = jittered(1, 0, 1)  # no contrast: both pixels the same
    assert torch.equal(flat[..., 0], flat[..., 1])


@pytest.mark.parametrize('seed', range(3))
def test_colour_jitter_matches_torchvision_clamping_after_each_step(seed):
    """Kiln clamped only at the end: pixels that brightness pushed past 255 raised the contrast's mean
    and the saturation's grey, 39 levels off torchvision's ColorJitter with the same factors."""
    from torchvision.transforms.v2 import functional

    from data.augment import ColorJitter

    generator = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 256, (1, 3, 24, 24), generator=generator, dtype=torch.uint8)
    image[..., :12, :] = (image[..., :12, :] // 2 + 128).to(torch.uint8)  # bright: brightness 1.4 clips it
    brightness, contrast, saturation = 1.4, 0.6, 1.4
    batch = {'image': image.clone()}
    ColorJitter(24).apply(batch, {'factors': torch.tensor([[brightness, contrast, saturation]])})
    expected = functional.adjust_saturation(
        functional.adjust_contrast(functional.adjust_brightness(image[0], brightness), contrast), saturation
    )
    difference = (batch['image'][0].int() - expected.int()).abs().max().item()
    assert difference <= 3, f'seed {seed}: {difference} levels off torchvision'


@pytest.mark.parametrize('name', ['color', 'erase'])
def test_pixel_augmentations_refuse_a_float_image_in_one_line(name):
    """A dataset's own float (already normalized) image came out of `color` nearly constant and got
    pixel values up to 255 pasted in by `erase`, with no word."""
    from data.augment import BatchTransform
    from utils.errors import KilnError

    transform = BatchTransform((name,), 8)
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(KilnError, match=f'--augment {name} .*float images.*leave {name} out of --augment'):
        transform({'image': images}, transform.draw(2, torch.Generator().manual_seed(1)), torch.arange(2))


def test_random_erasing_fills_its_box_and_nothing_else():
    from data.augment import RandomErasing

    image = torch.full((2, 3, 8, 8), 7, dtype=torch.uint8)
    params = {
        'erase': torch.tensor([True, False]),
        'box': torch.tensor([[0.25, 0.5, 0.75, 1.0]] * 2),
        'colour': torch.tensor([[1, 2, 3]] * 2, dtype=torch.uint8),
    }
    batch = {'image': image.clone()}
    RandomErasing(8).apply(batch, params)
    erased = batch['image'][0]
    assert erased[:, 4:, 2:6].tolist() == [[[c] * 4] * 4 for c in (1, 2, 3)]
    assert (erased[:, :4] == 7).all() and (erased[:, :, :2] == 7).all() and torch.equal(batch['image'][1], image[1])


def test_mixup_and_cutmix_mix_neighbouring_positions_and_their_targets():
    from data.augment import Mix
    from options import parse_args, parse_train_args, resolve
    from tasks.classify import ClassifyTask

    images = torch.arange(5, dtype=torch.float32).view(5, 1, 1, 1).expand(5, 3, 4, 4).clone()
    positions = torch.tensor([10, 11, 12, 13, 15])  # 14 is in another batch: 15 stays alone
    params = {
        'lam': torch.tensor([0.75, 0.75, 0.75, 0.75, 0.4]),
        'cut': torch.tensor([False, False, True, True, False]),
        'box': torch.tensor([[0.0, 0.0, 0.5, 1.0]] * 5),
    }
    batch = {'image': images.clone(), 'label': torch.tensor([0, 1, 2, 3, 4])}
    Mix().apply(batch, params, positions)
    mixed = batch['image'][:, 0]
    assert batch['mix_partner'].tolist() == [1, 0, 3, 2, 4]
    assert mixed[0].unique().tolist() == [0.25] and mixed[1].unique().tolist() == [0.75]  # mixup: 3/4 own
    assert mixed[2, :, :2].unique().tolist() == [3.0] and mixed[2, :, 2:].unique().tolist() == [2.0]  # cutmix
    assert torch.equal(mixed[4], images[4, 0]) and batch['mix_lam'][4] == 1  # no partner: as it was

    task = ClassifyTask(resolve(parse_args(parse_train_args, [])).replace(num_classes=5))
    logits = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    expected = torch.stack(
        [
            lam * torch.nn.functional.cross_entropy(logits[i : i + 1], batch['label'][i : i + 1])
            + (1 - lam) * torch.nn.functional.cross_entropy(logits[i : i + 1], batch['label'][partner : partner + 1])
            for i, (lam, partner) in enumerate(zip(batch['mix_lam'].tolist(), batch['mix_partner'].tolist()))
        ]
    ).mean()
    assert torch.allclose(task.loss(logits, batch), expected)
    batch['mix_lam'] = torch.tensor([0.75, 0.25, 0.5, 0.4, 1.0])
    assert task.metric_targets(batch)['label'].tolist() == [0, 0, 2, 2, 4]  # the larger share's label


def test_mix_pairs_neighbours_in_a_batch_that_starts_at_an_odd_position():
    """Pairs were taken by index in the batch: a batch (or a process's share of it) that started at an
    odd position of the epoch, every other batch with an odd batch size, mixed nothing."""
    from data.augment import Mix

    images = torch.arange(5, dtype=torch.float32).view(5, 1, 1, 1).expand(5, 3, 2, 2).clone()
    positions = torch.tensor([11, 12, 13, 14, 15])  # 10 is in the batch before: 11 stays alone
    params = {'lam': torch.full((5,), 0.5), 'cut': torch.zeros(5, dtype=torch.bool), 'box': torch.zeros(5, 4)}
    batch = {'image': images.clone()}
    Mix().apply(batch, params, positions)
    assert batch['mix_partner'].tolist() == [0, 2, 1, 4, 3]
    assert batch['mix_lam'].tolist() == [1.0, 0.5, 0.5, 0.5, 0.5]
    assert batch['image'][1:, 0, 0, 0].tolist() == [1.5, 1.5, 3.5, 3.5]


@pytest.mark.parametrize('seed', range(5))
def test_cutmix_lam_is_the_share_of_pixels_a_sample_keeps(seed):
    """CutMix's lam was the area of its box before the box met the pixel grid: off by up to 0.03 at
    32 pixels, in the loss's share of each label."""
    from data.augment import BatchTransform

    count, side = 64, 32
    transform = BatchTransform(('cutmix',), side)
    params = transform.draw(count, torch.Generator().manual_seed(seed))
    images = torch.arange(count, dtype=torch.float32).view(count, 1, 1, 1).expand(count, 3, side, side)
    batch = transform({'image': images.clone()}, params, torch.arange(count))
    assert bool(params[(0, 'cut')].all()), f'seed {seed}: every pair is cut'
    own = (batch['image'][:, 0] == images[:, 0]).float().mean(dim=(1, 2))  # the share of its own pixels
    error = (batch['mix_lam'] - own).abs().max().item()
    assert error < 1e-6, f'seed {seed}: lam is off the share of pixels kept by up to {error:.4f}'


def test_the_recipe_augments_a_sample_alike_whatever_the_batch_size(tiny_shapes):
    from data.loader import Batches
    from data.mem_list_dataset import MemListDataset
    from options import parse_args, parse_train_args, resolve

    argv = tiny_run_args(tiny_shapes, 'unused')[:6] + ['--img_size', '32']
    options = resolve(parse_args(parse_train_args, argv))
    dataset = MemListDataset(options, 'train')
    names = ('resized_crop', 'hflip', 'color', 'erase', 'mixup', 'cutmix')

    def epoch(batch_size):
        batches = Batches(
            dataset, torch.device('cpu'), batch_size=batch_size, shuffle=True, seed=4, augment=names, options=options
        )
        return torch.cat([batch['image'] for batch in batches.epoch(3)]), batches

    by_8, batches = epoch(8)
    by_4, _ = epoch(4)
    assert torch.equal(by_8, by_4)
    plain = torch.cat(
        [b['image'] for b in Batches(dataset, torch.device('cpu'), batch_size=8, shuffle=True, seed=4).epoch(3)]
    )
    assert not torch.equal(by_8, plain)
    assert batches.transform.mix is not None and len(batches.transform.augmentations) == 4


def test_a_task_that_cannot_mix_says_so(tiny_shapes, tmp_path):
    from conftest import tiny_seg_args

    result = run_script(
        'train.py', *tiny_seg_args(tiny_shapes, tmp_path / 'ck'), '--task', 'segment', '--augment', 'crop,mixup'
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and 'cannot train on mixed samples (mixup)' in lines[0]


# --- the average of the weights -------------------------------------------------------------------------


def test_the_weight_average_follows_the_weights_with_tensorflow_s_warm_up():
    from utils.ema import ModelEma

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ema = ModelEma(model, decay=0.9)
    start = model[0].weight.detach().clone()
    expected = start.clone()
    for step in range(1, 30):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        ema.update()
        decay = min(0.9, (1 + step) / (10 + step))
        expected = decay * expected + (1 - decay) * model[0].weight.detach()
    assert torch.allclose(ema.module[0].weight, expected) and not torch.allclose(expected, model[0].weight)
    copy = ModelEma(model, 0.9)
    copy.load_state_dict(ema.state_dict())
    assert copy.updates == 29 and torch.equal(copy.module[0].weight, ema.module[0].weight)


def test_a_tied_weight_is_averaged_once_a_step():
    """A weight two layers share (tied embeddings, a reused block) moves by (1 - decay) of the way a step,
    not by 1 - decay squared, as when it was averaged once per name in the state dict."""
    from utils.ema import ModelEma

    shared = torch.nn.Linear(2, 2, bias=False)
    model = torch.nn.Sequential(shared, shared)
    ema = ModelEma(model, decay=0.5)
    ema.updates = 100  # past the warm-up: the decay is 0.5
    with torch.no_grad():
        shared.weight.fill_(0)
        ema.module[0].weight.fill_(1)
    ema.update()
    assert ema.module[1].weight is ema.module[0].weight and torch.allclose(
        ema.module[0].weight, torch.full((2, 2), 0.5)
    )


def test_ema_runs_validate_save_and_evaluate_the_average(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--epochs', '2', '--ema_decay', '0.9', '--loggers', 'csv']
    train_succeeds(args)
    last = _load(os.path.join(experiment_of(args), 'last.pth'))
    assert last['weights'] == 'ema' and last['ema']['updates'] == 12
    assert any(not torch.equal(last['ema']['module'][name], tensor) for name, tensor in last['model'].items())
    with open(os.path.join(experiment_of(args), 'history.json')) as f:
        validated = {name[4:]: values[-1] for name, values in json.load(f)['metrics'].items() if name[:4] == 'val/'}
    result = run_script(
        'eval.py', '--load_model_path', os.path.join(experiment_of(args), 'last.pth'), '--cpu', '--no-progress_bar'
    )
    assert result.returncode == 0, result.stderr
    (evaluated,) = os.listdir(os.path.join(experiment_of(args), 'eval'))
    with open(os.path.join(experiment_of(args), 'eval', evaluated, 'result.json')) as f:
        report = json.load(f)
    assert report['weights'] == 'ema'
    assert {name: pytest.approx(value, abs=1e-6) for name, value in validated.items()} == {
        name: report['metrics'][name] for name in validated
    }


# --- bitwise resume with the whole recipe ------------------------------------------------------------

RECIPE = [
    '--augment',
    'crop,hflip,color,erase,mixup,cutmix',
    '--ema_decay',
    '0.99',
    '--deterministic',
    '--save_interval',
    '1',
    '--batch_size',
    '8',
    '--epochs',
    '2',
]


def test_a_run_with_the_recipe_killed_and_resumed_ends_bitwise_equal(tiny_shapes, tmp_path):
    whole = tiny_run_args(tiny_shapes, tmp_path / 'whole') + RECIPE
    train_succeeds(whole)
    killed = tiny_run_args(tiny_shapes, tmp_path / 'killed') + RECIPE
    process = subprocess.Popen(
        [sys.executable, 'train.py', *killed], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    record = os.path.join(experiment_of(killed), 'checkpoints.json')
    deadline = time.time() + timeout(300)
    while True:  # kill after the checkpoint of step 7, in the middle of the first epoch
        assert process.poll() is None and time.time() < deadline, process.communicate()
        try:
            with open(record) as f:
                if json.load(f)['files'].get('epoch000_step0000007.pth'):
                    break
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert _load(os.path.join(experiment_of(killed), 'last.pth'))['position']['step'] < 24
    train_succeeds(killed, '--resume')
    final = [_load(os.path.join(experiment_of(args), 'last.pth')) for args in (whole, killed)]
    assert final[0]['position'] == final[1]['position'] and final[0]['history'] == final[1]['history']
    for part in ('model', 'ema'):
        state = final[0][part] if part == 'model' else final[0][part]['module']
        other = final[1][part] if part == 'model' else final[1][part]['module']
        for name, tensor in state.items():
            assert torch.equal(tensor, other[name]), f'{part} {name}'


# --- timm backbones -------------------------------------------------------------------------------------


def test_a_timm_backbone_trains_evaluates_and_predicts_from_local_weights(tiny_shapes, tmp_path):
    timm = pytest.importorskip('timm', reason="timm is an optional extra (python3 -m pip install -e '.[timm]')")
    from safetensors.torch import save_file

    weights = tmp_path / 'model.safetensors'  # as timm's own files come: the ImageNet head included
    source = timm.create_model('test_convnext', pretrained=False)
    save_file({name: tensor.contiguous() for name, tensor in source.state_dict().items()}, str(weights))
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + [
        '--epochs',
        '1',
        '--loggers',
        'csv',
        '--model_type',
        'timm:test_convnext',
    ]
    result = train_succeeds(args, '--pretrained_path', weights, '--freeze_to', '-2', '--lr', '1e-3')
    assert f'tensors of ImageNet weights loaded from {weights}' in result.stdout
    folder = experiment_of(args, 'timm-test_convnext')
    trained = _load(os.path.join(folder, 'last.pth'))
    frozen = ['stem.0.weight', 'stem.0.bias']  # the stem's convolution (normalization layers stay trainable)
    assert frozen and all(torch.equal(trained['model'][name], source.state_dict()[name]) for name in frozen)
    assert trained['model']['head.fc.weight'].shape[0] == 6 and trained['args']['model_type'] == 'timm:test_convnext'
    assert run_script('eval.py', '--load_model_path', folder, '--cpu', '--no-progress_bar').returncode == 0
    predicted = run_script(
        'predict.py', '--load_model_path', folder, '--input', os.path.join(tiny_shapes, 'val.txt'), '--cpu'
    )
    assert predicted.returncode == 0 and '48 images predicted' in predicted.stdout, predicted.stderr


def test_a_timm_backbone_without_the_extra_or_a_known_name_is_one_line(tiny_shapes, tmp_path, monkeypatch):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    monkeypatch.setitem(sys.modules, 'timm', None)  # as if it were not installed
    result = run_script('train.py', *args, '--model_type', 'timm:resnet18')
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "pip install -e '.[timm]'" in lines[0], result.stderr
    monkeypatch.undo()
    pytest.importorskip('timm', reason='timm is an optional extra')
    result = run_script('train.py', *args, '--model_type', 'timm:convnext_tinyy')
    assert result.returncode == 2 and 'did you mean convnext_tiny' in result.stderr
