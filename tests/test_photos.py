"""Real photos in: class folders, both resize modes, RandomResizedCrop at decode time and on the
device, and the fast JPEG decoder, on photographs that scikit-image ships (data/photo_set.py)."""

import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from conftest import REPO, run_script, timeout

pytest.importorskip('skimage', reason="the photo set needs scikit-image (python3 -m pip install -e '.[dev]')")

CLASSES = ['astronaut', 'cat', 'coffee', 'motorcycle', 'retina', 'rocket']  # sorted folder names


@pytest.fixture(scope='module')
def photos(tmp_path_factory):
    """A small photo set: 8 training and 4 validation photos per class, 48 to 200 pixels a side."""
    from data.photo_set import make_photo_set

    return make_photo_set(str(tmp_path_factory.mktemp('photos') / 'set'), 8, 4, sizes=(48, 200))


def _args(photos, checkpoints, *extra):
    return [
        '--data_type',
        'photos',
        '--train_list',
        os.path.join(photos, 'train'),
        '--val_list',
        os.path.join(photos, 'val'),
        '--img_size',
        '32',
        '--batch_size',
        '8',
        '--num_workers',
        '0',
        '--checkpoints_dir',
        str(checkpoints),
        '--no-progress_bar',
        '--cpu',
        *extra,
    ]


def _one_error_line(result, *needles):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    shown = f'exit {result.returncode}\n{result.stdout}\n{result.stderr}'
    assert result.returncode == 2 and len(lines) == 1 and 'Traceback' not in result.stderr, shown
    assert all(needle in lines[0] for needle in needles), shown
    return lines[0]


# --- class folders ----------------------------------------------------------------------------------


def test_class_folders_train_evaluate_and_predict_without_a_list(photos, tmp_path):
    result = run_script('train.py', *_args(photos, tmp_path / 'ck', '--epochs', '2'))
    assert result.returncode == 0, result.stdout + result.stderr
    folder = tmp_path / 'ck' / 'small_cnn_photos_default'
    checkpoint = torch.load(folder / 'last.pth', weights_only=True, map_location='cpu')
    assert checkpoint['class_names'] == CLASSES and checkpoint['args']['resize'] == 'crop'

    result = run_script('eval.py', '--load_model_path', folder, '--cpu', '--no-progress_bar')
    assert result.returncode == 0, result.stderr
    (evaluated,) = (folder / 'eval').iterdir()
    report = json.loads((evaluated / 'result.json').read_text())
    assert report['class_names'] == CLASSES and report['samples'] == 6 * 4
    rows = (evaluated / 'predictions.csv').read_text().splitlines()[1:]
    assert len(rows) == 24 and all(row.startswith(os.path.join(photos, 'val')) for row in rows)

    result = run_script('predict.py', '--load_model_path', folder, '--input', os.path.join(photos, 'val'), '--cpu')
    assert result.returncode == 0 and '24 images predicted' in result.stdout, result.stderr
    (predicted,) = (folder / 'predict').iterdir()
    names = {row.split(',')[2] for row in (predicted / 'predictions.csv').read_text().splitlines()[1:]}
    assert names <= set(CLASSES)


def test_linked_folders_are_followed_once_by_training_and_predict(photos, tmp_path):
    """Class folders and subfolders that are symbolic links count (they were skipped without a word), a
    link back up the tree is read once, hidden files are left out and .jfif is a JPEG."""
    from data.image_io import find_images
    from data.list_dataset import read_class_folders

    source = os.path.join(photos, 'val')
    val = tmp_path / 'val'
    (val / 'cat').mkdir(parents=True)
    first_cat = sorted(os.listdir(os.path.join(source, 'cat')))[0]
    shutil.copy(os.path.join(source, 'cat', first_cat), val / 'cat' / 'own.jfif')
    os.symlink(os.path.join(source, 'cat'), val / 'cat' / 'more')  # a linked subfolder
    os.symlink(val, val / 'cat' / 'loop')  # a link back up the tree
    (val / 'cat' / '._own.jpg').write_bytes(b'macOS metadata, not an image')
    for name in [name for name in CLASSES if name != 'cat']:
        os.symlink(os.path.join(source, name), val / name)  # linked class folders
    samples, names = read_class_folders(str(val))
    assert names == CLASSES
    counts = {name: sum(label == names.index(name) for _, label, _ in samples) for name in CLASSES}
    assert counts == {name: 5 if name == 'cat' else 4 for name in CLASSES}, counts
    assert len(find_images(str(val))) == 6 * 4 + 1

    result = run_script('train.py', *_args(photos, tmp_path / 'ck', '--epochs', '1'))
    assert result.returncode == 0, result.stderr
    folder = tmp_path / 'ck' / 'small_cnn_photos_default'
    result = run_script('predict.py', '--load_model_path', folder, '--input', val, '--cpu', '--no-progress_bar')
    assert result.returncode == 0 and '25 images predicted' in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize('damage', ['empty', 'extra'])
def test_a_validation_folder_whose_classes_differ_is_one_line(photos, tmp_path, damage):
    """An empty class folder, or one that is no class of training (a folder lacking a class is numbered
    by name: test_train_eval.py)."""
    val = tmp_path / 'val'
    shutil.copytree(os.path.join(photos, 'val'), val)
    if damage == 'empty':
        for file in (val / 'coffee').iterdir():
            file.unlink()
    else:
        shutil.copytree(val / 'cat', val / 'dog')
    args = _args(photos, tmp_path / 'ck', '--epochs', '1')
    args[args.index('--val_list') + 1] = str(val)
    needle = {'empty': 'coffee holds no images', 'extra': 'has 1 class folder that'}[damage]
    _one_error_line(run_script('train.py', *args), needle)
    assert not (tmp_path / 'ck' / 'small_cnn_photos_default').exists()  # nothing left behind


def test_a_photo_that_fails_to_decode_mid_run_is_one_line_and_the_run_ends(photos, tmp_path):
    """With DataLoader workers (which ignore stop signals), the process must still exit."""
    train = tmp_path / 'train'
    shutil.copytree(os.path.join(photos, 'train'), train)
    damaged = sorted((train / 'cat').glob('*.jpg'))[0]
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # its header still checks out
    args = _args(photos, tmp_path / 'ck', '--epochs', '1')
    args[args.index('--train_list') + 1], args[args.index('--num_workers') + 1] = str(train), '2'
    result = subprocess.run(
        [sys.executable, 'train.py', *args], cwd=REPO, capture_output=True, text=True, timeout=timeout(120)
    )
    _one_error_line(result, f'cannot read image {damaged}')


# --- resize modes and the decoder -------------------------------------------------------------------


def _reference(path, size, resize):
    """What decode_image should give, computed the plain way with Pillow on the full image; and whether
    the fast decoder may take a reduced DCT scale for it (a JPEG whose box is twice the size or more)."""
    from data.image_io import image_box

    with Image.open(path) as image:
        jpeg = image.format == 'JPEG'
        upright = ImageOps.exif_transpose(image).convert('RGB')
    box = image_box(upright.width, upright.height, resize)
    upright = upright.crop([round(value) for value in box])
    reduced = jpeg and min(upright.size) >= 2 * size
    return np.asarray(upright.resize((size, size), Image.BILINEAR)).astype(int), reduced


def test_a_dataset_that_does_not_say_how_it_resized_gets_whole_images_in_predict(tmp_path):
    """A checkpoint of a dataset without a `resize` kept None, which predict.py read as a centred crop of
    every image that training and eval.py had seen whole (26 of 60 predictions agreed with eval.py)."""
    from data.image_io import decode_image, image_box

    assert image_box(80, 40, None) == image_box(80, 40, 'squash') == (0.0, 0.0, 80.0, 40.0)
    pixels = np.zeros((40, 80, 3), np.uint8)
    pixels[:, :8] = 255  # a bright band at the left edge, which a crop cuts away
    Image.fromarray(pixels).save(tmp_path / 'band.png')
    image = decode_image(str(tmp_path / 'band.png'), 16, resize=None)
    assert image[:, :, 0].float().mean() > 100  # the band is there


def test_a_state_dict_of_a_photo_model_is_read_as_the_dataset_reads_photos(tmp_path):
    """A checkpoint that does not say how images were resized (a state dict) left --resize None: eval.py
    read photos through the dataset (a centred crop), predict.py squashed them (11 of 12 predictions
    differed), and both recorded `resize: None`. Both now take the dataset's way."""
    from eval import load_for_inference
    from options import given_options, parse_args, parse_predict_args, parse_test_args

    path = tmp_path / 'bare.pth'
    torch.save({'weight': torch.zeros(6, 3 * 8 * 8), 'bias': torch.zeros(6)}, path)
    for add_args in (parse_test_args, parse_predict_args):
        argv = ['--load_model_path', str(path), '--model_type', 'linear', '--num_classes', '6', '--img_size', '8']
        for data_type, resize in (('photos', 'crop'), ('list', 'squash')):
            words = [*argv, '--data_type', data_type] + (
                ['--input', str(tmp_path)] if add_args is parse_predict_args else []
            )
            options, _, _ = load_for_inference(parse_args(add_args, words), given_options(add_args, words), str(path))
            assert options.resize == resize, (add_args.__name__, data_type)


@pytest.mark.parametrize('resize', ['squash', 'crop'])
def test_the_fast_decoder_gives_what_pillow_gives(photos, resize):
    from data.image_io import decode_image

    paths = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(photos)
        for name in names
        if name[-4:] in ('.jpg', '.png')
    )
    assert any(path.endswith('.png') for path in paths) and sum(path.endswith('.jpg') for path in paths) > 40
    reduced_count = 0
    for path in paths:
        decoded = decode_image(path, 32, resize=resize).permute(1, 2, 0).numpy().astype(int)
        reference, reduced = _reference(path, 32, resize)
        difference = decoded - reference
        if not reduced:  # the same pixels, box and filter (torch's uint8 bilinear rounds some pixels the other way)
            assert np.abs(difference).max() <= 1, path
            continue
        # decoded at 1/2 to 1/8 scale, then resized: another low-pass filter than Pillow's, but no shift of
        # colour, brightness or place (which a wrong box, turn or conversion would make)
        reduced_count += 1
        assert np.abs(difference).mean() < 12 and np.abs(difference.mean(axis=(0, 1))).max() < 2.5, path
    assert 10 < reduced_count < len(paths) - 10  # both cases are tested


@pytest.mark.parametrize('resize', ['squash', 'crop'])
def test_training_crops_are_drawn_in_the_frame_evaluation_shows(tmp_path, resize):
    """A resized crop's aspect ratio (torchvision's 3/4 to 4/3) is drawn on the image as evaluation shows it:
    the photo itself where its aspect ratio is kept, the squashed square with --resize squash (as the
    in-memory datasets crop theirs). Drawn on the photo under squash, a 2:1 photo's crops were squeezed
    0.75 to 1.34 wide where evaluation squeezes it 2, in list datasets but not in mem_list."""
    from data.augment import RandomResizedCrop
    from data.image_io import decode_image

    Image.fromarray(np.zeros((200, 400, 3), np.uint8)).save(tmp_path / 'wide.png')
    crop, ratios = RandomResizedCrop(32), []
    for seed in range(200):
        torch.manual_seed(seed)
        _, (x0, y0, x1, y1), (width, height) = decode_image(
            str(tmp_path / 'wide.png'), 32, resize=resize, crop=crop, with_box=True
        )
        squeeze = width / height if resize == 'squash' else 1  # evaluation's picture squeezes x by this
        ratios.append((x1 - x0) / (y1 - y0) / squeeze)
    lowest, highest = min(ratios), max(ratios)
    assert 0.73 < lowest < 0.85 and 1.2 < highest < 1.37, (resize, lowest, highest)


@pytest.mark.parametrize('suffix', ['jpg', 'png', 'webp', 'tif'])
@pytest.mark.parametrize('orientation', range(1, 9))
def test_every_exif_orientation_comes_out_upright(tmp_path, orientation, suffix):
    """Once upright, in every format (Pillow turns TIFFs upright itself as it loads them)."""
    from data.image_io import decode_image

    upright = np.zeros((24, 40, 3), np.uint8)
    upright[:, :20] = (220, 30, 30)  # red left half, blue bottom right quarter
    upright[12:, 20:] = (30, 30, 220)
    inverse = {
        2: 'FLIP_LEFT_RIGHT',
        3: 'ROTATE_180',
        4: 'FLIP_TOP_BOTTOM',
        5: 'TRANSPOSE',
        6: 'ROTATE_90',
        7: 'TRANSVERSE',
        8: 'ROTATE_270',
    }
    stored = Image.fromarray(upright)
    if orientation > 1:
        stored = stored.transpose(getattr(Image.Transpose, inverse[orientation]))
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / f'o{orientation}.{suffix}'
    stored.save(path, quality=95, exif=exif.tobytes())
    with Image.open(path) as reopened:
        assert ImageOps.exif_transpose(reopened).size == (40, 24)  # Pillow agrees on what upright is
    decoded = decode_image(str(path), 16).permute(1, 2, 0).numpy().astype(int)
    assert np.abs(decoded[8, 3] - (220, 30, 30)).max() < 40 and np.abs(decoded[13, 13] - (30, 30, 220)).max() < 40


@pytest.mark.parametrize('suffix', ['jpg', 'png', 'webp'])
@pytest.mark.parametrize(
    'exif', [b'Exif\x00\x00' + b'\xff' * 40, b'Exif\x00\x00MM\x00*', b'Exif\x00\x00' + b'\x00' * 8]
)
def test_an_image_with_malformed_exif_decodes_as_upright(tmp_path, suffix, exif):
    """A PNG or WebP whose EXIF Pillow cannot parse passed the header check and then stopped training
    ('cannot read image ...: not a TIFF file'); Pillow reads such a JPEG's pixels, and so does Kiln now."""
    from data.image_io import check_image, decode_image

    pixels = np.zeros((24, 40, 3), np.uint8)
    pixels[:, :20] = (220, 30, 30)
    path = tmp_path / f'bad_exif.{suffix}'
    Image.fromarray(pixels).save(path, quality=95, exif=exif)
    assert check_image(str(path)) is None
    decoded = decode_image(str(path), 16).permute(1, 2, 0).numpy().astype(int)
    assert np.abs(decoded[8, 3] - (220, 30, 30)).max() < 40, exif  # as stored: orientation 1


def test_gray_and_cmyk_jpegs(tmp_path):
    from data.image_io import decode_image

    gray = np.tile(np.arange(0, 256, 8, dtype=np.uint8), (32, 1))
    Image.fromarray(gray).save(tmp_path / 'gray.jpg', quality=95)
    decoded = decode_image(str(tmp_path / 'gray.jpg'), 32)
    assert (decoded[0] == decoded[1]).all() and (np.abs(decoded[0].numpy().astype(int) - gray).max() <= 4)
    Image.new('CMYK', (32, 32), (0, 255, 255, 0)).save(tmp_path / 'cmyk.jpg')  # red in CMYK
    assert np.abs(decode_image(str(tmp_path / 'cmyk.jpg'), 8)[:, 4, 4].numpy().astype(int) - (255, 0, 0)).max() < 10


# --- RandomResizedCrop ---------------------------------------------------------------------------------


def test_resized_crop_boxes_follow_scale_and_ratio():
    from data.augment import RandomResizedCrop

    seed = 5
    crop = RandomResizedCrop(32, scale=(0.25, 0.5), ratio=(0.5, 2.0))
    generator = torch.Generator().manual_seed(seed)
    widths = torch.tensor([640, 300, 200] * 300)
    heights = torch.tensor([480, 300, 400] * 300)
    boxes = crop.draw_boxes(widths, heights, generator).double()
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= widths).all() and (boxes[:, 3] <= heights).all(), seed
    share, ratio = w * h / (widths * heights), w / h
    assert share.min() > 0.23 and share.max() < 0.52, seed  # rounding to whole pixels
    assert ratio.min() > 0.48 and ratio.max() < 2.05, seed
    assert (share > 0.45).any() and (ratio > 1.8).any() and (ratio < 0.55).any(), seed  # the whole range is used
    again = crop.draw_boxes(widths, heights, torch.Generator().manual_seed(seed))
    assert torch.equal(boxes.float(), again)
    # no try fits a thin image: its whole width, at the lowest allowed ratio, in the middle
    assert crop.draw_boxes(torch.tensor([10]), torch.tensor([400]), generator).tolist() == [[0, 190, 10, 210]]


@pytest.mark.parametrize('seed', [0, 1])
def test_resized_crops_of_in_memory_images_take_their_share_of_the_picture(seed):
    """The in-memory draw worked on a 1x1 picture: every box rounded to the whole image, so
    --augment resized_crop did nothing on shapes and mem_list. Boxes now cover 8% to 100% of the
    --img_size square, in whole pixels, given in units of its side."""
    from data.augment import BatchTransform

    transform = BatchTransform(['resized_crop'], 32)
    boxes = transform.draw(2000, torch.Generator().manual_seed(seed))[(0, 'box')]
    share = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    assert share.min() < 0.1 and share.max() == 1 and (share < 0.5).float().mean() > 0.3, f'seed {seed}'
    assert torch.equal((boxes * 32).round(), boxes * 32), f'seed {seed}'  # whole pixels
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    cropped = transform({'image': images.clone()}, {(0, 'box'): boxes[:8]}, torch.arange(8))['image']
    plain = BatchTransform([], 32)({'image': images.clone()})['image']
    assert all(not torch.equal(a, b) for a, b, s in zip(cropped, plain, share) if s < 1), f'seed {seed}'


def test_resized_crop_on_the_device_moves_masks_and_boxes_with_the_pixels():
    from data.augment import RandomResizedCrop

    image = torch.zeros(1, 3, 16, 16, dtype=torch.uint8)
    image[:, :, 4:8, 8:12] = 200  # a square, its mask and its box
    mask = (image[:, 0] > 0).to(torch.uint8)
    batch = {
        'image': image,
        'mask': mask,
        'boxes': torch.tensor([[[8.0, 4.0, 12.0, 8.0]]]),
        'box_labels': torch.tensor([[1]]),
    }
    RandomResizedCrop(16).apply(batch, {'box': torch.tensor([[0.5, 0.0, 1.0, 0.5]])})  # the top right quarter, 2x
    assert torch.equal(batch['image'][0, 0] > 100, batch['mask'][0] > 0)
    assert batch['mask'][0].nonzero().min(0).values.tolist() == [8, 0] and batch['mask'].sum() == 64
    assert batch['boxes'].tolist() == [[[0.0, 8.0, 8.0, 16.0]]] and batch['box_labels'].tolist() == [[1]]


def _batches(dataset_args, workers, batch_size, epoch=1):
    from data.augment import AUGMENTATIONS
    from data.data_entry import select_dataset
    from data.loader import Batches
    from options import parse_args, parse_train_args, resolve

    options = resolve(parse_args(parse_train_args, dataset_args))
    dataset = select_dataset(options, 'train')
    dataset.decode_crops(AUGMENTATIONS['resized_crop'](options.img_size, options))
    batches = Batches(
        dataset, torch.device('cpu'), batch_size=batch_size, shuffle=True, seed=3, augment=('hflip',), workers=workers
    )
    try:
        return torch.cat([batch['image'] for batch in batches.epoch(epoch)])
    finally:
        batches.close()


def test_resized_crops_at_decode_time_are_the_same_whatever_the_workers_and_batch_size(photos):
    args = ['--data_type', 'photos', '--train_list', os.path.join(photos, 'train'), '--img_size', '24']
    alone = _batches(args, workers=0, batch_size=8)
    assert torch.equal(alone, _batches(args, workers=2, batch_size=8))
    assert torch.equal(alone[:40], _batches(args, workers=2, batch_size=5)[:40])  # 48 images: 6 vs 9 full batches
    assert not torch.equal(alone, _batches(args, workers=0, batch_size=8, epoch=2))  # new crops every epoch


@pytest.mark.parametrize('data_type', ['photos', 'mem_list'])  # cropped at decode time / on the device
def test_a_resumed_photo_run_ends_with_the_weights_of_an_uninterrupted_one(photos, tmp_path, data_type):
    extra = ['--deterministic', '--augment', 'resized_crop,hflip', '--resize', 'crop', '--data_type', data_type]
    extra += ['--scheduler', 'none']  # a resume may lengthen the run: a flat schedule does not depend on its length
    whole = _args(photos, tmp_path / 'whole', *extra, '--epochs', '3')
    assert run_script('train.py', *whole).returncode == 0
    split = _args(photos, tmp_path / 'split', *extra, '--epochs', '1', '--num_workers', '2')
    assert run_script('train.py', *split).returncode == 0
    result = run_script('train.py', *split, '--resume', '--epochs', '3')
    assert result.returncode == 0, result.stderr
    folder = f'small_cnn_{data_type}_default'
    final = [
        torch.load(root / folder / 'last.pth', weights_only=True, map_location='cpu')
        for root in (tmp_path / 'whole', tmp_path / 'split')
    ]
    assert final[0]['position'] == final[1]['position']
    for name, tensor in final[0]['model'].items():
        assert torch.equal(tensor, final[1]['model'][name]), name


def test_the_photo_set_is_the_same_from_its_seed(tmp_path):
    from data.photo_set import make_photo_set

    first, second = (
        make_photo_set(str(tmp_path / name), 2, 1, sizes=(40, 80), seed=random.Random(1).randrange(99)) for name in 'ab'
    )
    files = sorted(
        os.path.relpath(os.path.join(root, name), first) for root, _, names in os.walk(first) for name in names
    )
    assert len(files) == 6 * 3 + 2 and all(  # the photos, photo_set.json and .made.json
        (tmp_path / 'a' / f).read_bytes() == (tmp_path / 'b' / f).read_bytes() for f in files
    )


def test_a_photo_set_made_again_with_other_settings_keeps_a_class_folder_of_yours(tmp_path):
    """It was moved aside and removed whole, with a class folder added to it, without a word."""
    from data.photo_set import make_photo_set
    from utils.errors import KilnError

    root = tmp_path / 'set'
    make_photo_set(str(root), 1, 1, sizes=(40, 60))
    mine = root / 'train' / 'my_cat'
    mine.mkdir()
    (mine / '0000.jpg').write_bytes(b'precious')
    with pytest.raises(KilnError, match='but train/my_cat/, train/my_cat/0000.jpg differ from what the generator made'):
        make_photo_set(str(root), 2, 1, sizes=(40, 60))
    assert (mine / '0000.jpg').read_bytes() == b'precious'
    assert os.listdir(tmp_path) == ['set']
