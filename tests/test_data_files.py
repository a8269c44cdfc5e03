"""Unit tests for data/image_io.py (decoding every image mode, checking files) and data/list_file.py."""

import codecs
import os
import re

import numpy as np
import PIL
import pytest
import torch
from PIL import Image

from data.image_io import check_image, check_images, decode_image, to_rgb
from data.list_file import read_list_file, resolve_path
from utils.errors import KilnError

RED, GREEN, BLUE, WHITE, BLACK = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (0, 0, 0)


def save(image, path, expect_mode=None, **options):
    """Save `image`, check the file reopens in `expect_mode` (default: the image's), return the path."""
    image.save(path, **options)
    with Image.open(path) as reopened:
        assert reopened.mode == (expect_mode or image.mode)
    return str(path)


def decoded(path, size=None):
    """decode_image at the file's own size (no resize), as an (H, W, 3) uint8 array."""
    with Image.open(path) as image:
        size = size or image.width
    tensor = decode_image(path, size)
    assert tensor.dtype == torch.uint8 and tensor.shape == (3, size, size)
    return tensor.permute(1, 2, 0).numpy()


def rgb_of(image):
    """to_rgb of an in-memory image as an (H, W, 3) array (for modes no file format keeps)."""
    out = to_rgb(image)
    assert out.mode == 'RGB'
    return np.asarray(out)


def assert_close(pixel, expected, tolerance=0):
    assert np.abs(np.asarray(pixel, dtype=int) - np.asarray(expected)).max() <= tolerance, (pixel, expected)


def gradient16(width=256):
    return np.tile(np.linspace(0, 65535, width).round().astype(np.uint16), (width, 1))


# ---- image modes ---------------------------------------------------------------------------------


def test_mode_1(tmp_path):
    bits = np.indices((8, 8)).sum(0) % 2 == 0
    out = decoded(save(Image.fromarray(bits), tmp_path / 'a.png'))
    assert (out[bits] == 255).all() and (out[~bits] == 0).all()


def test_mode_l(tmp_path):
    gray = np.tile(np.arange(0, 256, 4, dtype=np.uint8), (64, 1))
    out = decoded(save(Image.fromarray(gray), tmp_path / 'a.png'))
    assert (out == gray[..., None]).all()


def test_mode_la_over_white(tmp_path):
    image = Image.new('LA', (4, 4), (0, 255))
    image.putpixel((0, 0), (0, 0))  # transparent black: white
    image.putpixel((1, 0), (0, 128))  # half-transparent black: mid gray
    out = decoded(save(image, tmp_path / 'a.png'))
    assert_close(out[0, 0], WHITE)
    assert_close(out[0, 1], (127, 127, 127), 1)
    assert_close(out[1, 1], BLACK)


def palette_image(mode='P'):
    image = Image.new(mode, (4, 4))
    image.putpalette([*RED, *GREEN, *BLUE] + [0] * 3 * 253)
    for x in range(4):
        for y in range(4):
            image.putpixel((x, y), x % 3 if mode == 'P' else (x % 3, 255))
    return image


def test_mode_p(tmp_path):
    out = decoded(save(palette_image(), tmp_path / 'a.png'))
    assert_close(out[0, 0], RED) and assert_close(out[0, 1], GREEN) and assert_close(out[0, 2], BLUE)


def test_mode_p_transparent_index_is_white(tmp_path):
    out = decoded(save(palette_image(), tmp_path / 'a.png', transparency=1))
    assert_close(out[2, 0], RED)
    assert_close(out[2, 1], WHITE)  # index 1 (green) is transparent
    assert_close(out[2, 2], BLUE)


def test_mode_pa(tmp_path):
    image = palette_image('PA')
    image.putpixel((1, 1), (0, 0))  # transparent
    out = decoded(save(image, tmp_path / 'a.tif'))
    assert_close(out[0, 0], RED) and assert_close(out[0, 2], BLUE)
    assert_close(out[1, 1], WHITE)


def test_mode_rgb(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    assert (decoded(save(Image.fromarray(pixels), tmp_path / 'a.png')) == pixels).all()


def test_mode_rgba_over_white(tmp_path):
    pixels = np.zeros((4, 4, 4), np.uint8)
    pixels[..., 0], pixels[..., 3] = 255, 255  # opaque red
    pixels[0, 0] = (255, 0, 0, 0)  # transparent red: white
    pixels[0, 1] = (0, 0, 0, 128)  # half-transparent black: gray
    out = decoded(save(Image.fromarray(pixels), tmp_path / 'a.png'))
    assert_close(out[0, 0], WHITE)
    assert_close(out[0, 1], (127, 127, 127), 1)
    assert_close(out[2, 2], RED)


def test_mode_rgba_premultiplied():
    image = Image.new('RGBa', (2, 2), (0, 0, 0, 0))
    image.putpixel((0, 0), (128, 0, 0, 128))  # premultiplied: half-transparent full red
    out = rgb_of(image)
    assert_close(out[0, 0], (255, 127, 127), 2)
    assert_close(out[1, 1], WHITE)


@pytest.mark.parametrize('fmt', ['TIFF', 'JPEG'])
def test_mode_cmyk(tmp_path, fmt):
    image = Image.new('CMYK', (8, 8), (0, 255, 255, 0))  # red
    image.paste((0, 0, 0, 255), (0, 0, 8, 4))  # top half black
    out = decoded(save(image, tmp_path / f'a.{fmt.lower()}', quality=95))
    assert_close(out[6, 4], RED, 8)
    assert_close(out[1, 4], BLACK, 8)


def test_mode_ycbcr(tmp_path):
    image = Image.new('RGB', (8, 8), RED)
    image.paste(BLUE, (0, 0, 8, 4))
    path = tmp_path / 'a.tif'
    image.convert('YCbCr').save(path)
    try:  # some Pillow builds read it back as RGB (the colours must be right either way), some not at all
        with Image.open(path) as reopened:
            reopened.load()
    except OSError as error:
        pytest.skip(f'this Pillow ({PIL.__version__}) cannot read the YCbCr TIFF it wrote: {error}')
    out = decoded(path)
    assert_close(out[1, 4], BLUE, 3)
    assert_close(out[6, 4], RED, 3)


def test_mode_lab(tmp_path):
    image = Image.new('LAB', (8, 8), (255, 128, 128))  # L=100, a=b=0: white
    image.paste((0, 128, 128), (0, 0, 4, 8))  # L=0: black
    image.paste((138, 209, 198), (0, 0, 8, 2))  # sRGB red in CIELAB
    out = decoded(save(image, tmp_path / 'a.tif'))
    assert_close(out[4, 6], WHITE, 3)
    assert_close(out[4, 1], BLACK, 3)
    assert_close(out[0, 4], RED, 12)


def test_mode_hsv():
    image = Image.new('HSV', (2, 1), (0, 255, 255))  # red
    image.putpixel((1, 0), (85, 255, 255))  # hue 120 degrees: green
    out = rgb_of(image)
    assert_close(out[0, 0], RED, 1)
    assert_close(out[0, 1], GREEN, 3)


def test_16bit_png_stays_a_gradient(tmp_path):
    values = gradient16()
    out = decoded(save(Image.fromarray(values), tmp_path / 'a.png', 'I;16'))
    expected = np.rint(values / 257).astype(np.uint8)
    assert (out == expected[..., None]).all()
    assert out[0, 0, 0] == 0 and out[0, -1, 0] == 255 and 120 <= out[0, 128, 0] <= 135
    assert len(np.unique(out)) == 256  # not clipped to white


def test_16bit_big_endian_tiff(tmp_path):
    values = gradient16(64)
    image = Image.frombytes('I;16B', (64, 64), values.astype('>u2').tobytes())
    out = decoded(save(image, tmp_path / 'a.tif'))
    assert (out == np.rint(values / 257).astype(np.uint8)[..., None]).all()


@pytest.mark.parametrize('mode', ['I;16', 'I;16L', 'I;16N', 'I;16B'])
def test_16bit_modes_in_memory(mode):
    values = np.array([[0, 257, 32768, 65535]])
    dtype = '>u2' if mode == 'I;16B' else '<u2'  # I;16N is native order, little-endian on x86 and ARM
    out = rgb_of(Image.frombytes(mode, (4, 1), values.astype(dtype).tobytes()))
    assert out[0, :, 0].tolist() == [0, 1, 128, 255]


def test_mode_i_16bit_range(tmp_path):
    values = gradient16(32).astype(np.int32)
    out = decoded(save(Image.fromarray(values), tmp_path / 'a.tif'))
    assert (out == np.rint(values / 257).astype(np.uint8)[..., None]).all()


@pytest.mark.parametrize('bad', [-1, 70000])
def test_mode_i_outside_16_bits_is_refused(tmp_path, bad):
    values = np.zeros((4, 4), np.int32)
    values[0, 0] = bad
    path = save(Image.fromarray(values), tmp_path / 'a.tif')
    with pytest.raises(KilnError, match='do not fit 16 bits'):
        decode_image(path, 4)


@pytest.mark.parametrize('scale', [1.0, 255.0])
def test_mode_f(tmp_path, scale):
    values = np.tile(np.linspace(0, scale, 16, dtype=np.float32), (16, 1))
    out = decoded(save(Image.fromarray(values), tmp_path / 'a.tif'))
    assert (out == np.rint(values * (255 / scale)).astype(np.uint8)[..., None]).all()


@pytest.mark.parametrize('bad', [1000.0, -0.5, float('nan')])
def test_mode_f_out_of_range_is_refused(tmp_path, bad):
    values = np.zeros((4, 4), np.float32)
    values[1, 1] = bad
    path = save(Image.fromarray(values), tmp_path / 'a.tif')
    with pytest.raises(KilnError, match=r'^cannot read image .*floating-point pixels'):
        decode_image(path, 4)


def test_exif_rotated_jpeg_comes_out_upright(tmp_path):
    stored = Image.new('RGB', (40, 20), BLUE)
    stored.paste(RED, (0, 0, 20, 20))  # stored: left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation 6: turn 90 degrees clockwise to view
    out = decoded(save(stored, tmp_path / 'a.jpg', exif=exif, quality=95), size=40)
    assert_close(out[5, 20], RED, 10)  # viewed: top half red
    assert_close(out[35, 20], BLUE, 10)  # and bottom half blue


@pytest.mark.parametrize('fmt', ['GIF', 'TIFF'])
def test_multi_frame_uses_first_frame(tmp_path, fmt):
    frames = [Image.new('RGB', (8, 8), color) for color in (RED, BLUE, GREEN)]
    path = tmp_path / f'a.{fmt.lower()}'
    frames[0].save(path, save_all=True, append_images=frames[1:])
    with Image.open(path) as image:
        assert image.n_frames == 3
    assert_close(decoded(str(path))[4, 4], RED, 2)


def test_resize(tmp_path):
    image = Image.new('RGB', (64, 32), RED)
    image.paste(BLUE, (32, 0, 64, 32))
    out = decoded(save(image, tmp_path / 'a.png'), size=16)
    assert_close(out[8, 2], RED) and assert_close(out[8, 13], BLUE)
    out16 = decoded(save(Image.fromarray(gradient16()), tmp_path / 'b.png', 'I;16'), size=32)
    assert out16[0, 0, 0] < 10 and out16[0, -1, 0] > 245 and 100 < out16[0, 16, 0] < 155


# ---- unreadable files ----------------------------------------------------------------------------

ONE_LINE = r'^cannot read image {} \(list\.txt:12\): [^\n]+; fix or remove it$'


def truncated(tmp_path, name, **options):
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    path = tmp_path / name
    Image.fromarray(pixels).save(path, **options)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return str(path)


def written(tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    return str(tmp_path / name)


@pytest.mark.parametrize(
    'make',
    [
        lambda tmp: truncated(tmp, 'cut.png'),
        lambda tmp: truncated(tmp, 'cut.jpg', quality=95),
        lambda tmp: written(tmp, 'text.png', b'not an image\n'),
        lambda tmp: written(tmp, 'zero.jpg', b''),
        lambda tmp: written(tmp, 'sig.png', b'\x89PNG\r\n\x1a\n' + bytes(range(64))),
        lambda tmp: str(tmp / 'missing.png'),
    ],
    ids=['truncated-png', 'truncated-jpeg', 'text', 'empty', 'garbage-after-signature', 'missing'],
)
def test_bad_files_give_one_line_error(tmp_path, make):
    path = make(tmp_path)
    with pytest.raises(KilnError) as caught:
        decode_image(path, 32, ' (list.txt:12)')
    assert re.match(ONE_LINE.format(re.escape(path)), str(caught.value)), str(caught.value)
    assert 'BytesIO' not in str(caught.value)  # Pillow names the buffer it read, not the file


def test_check_image(tmp_path):
    good = save(Image.new('RGB', (8, 8)), tmp_path / 'good.png')
    assert check_image(good) is None
    assert check_image(save(Image.new('L', (8, 8)), tmp_path / 'good.jpg')) is None
    cut = truncated(tmp_path, 'cut.png')
    text = tmp_path / 'text.png'
    text.write_text('hello')
    for bad in (cut, str(text), str(tmp_path / 'missing.png')):
        reason = check_image(bad)
        assert isinstance(reason, str) and reason and '\n' not in reason


def test_check_images(tmp_path):
    good = save(Image.new('RGB', (8, 8)), tmp_path / 'good.png')
    cut = truncated(tmp_path, 'cut.png')
    text = tmp_path / 'text.png'
    text.write_text('hello')
    bad = check_images([good, cut, good, str(text), good])
    assert [(index, path) for index, path, _ in bad] == [(1, cut), (3, str(text))]
    assert all(reason for _, _, reason in bad)
    assert check_images([]) == []


def test_images_that_passed_the_header_check_are_not_checked_again_until_they_change(tmp_path, monkeypatch):
    """The header check costs about 60 us an image (over a minute for a million); a second run on the same,
    unchanged files skips it, and any change to the list or a file brings it back."""
    import argparse
    import time

    import data.list_dataset
    from data.list_dataset import ListDataset

    checked, real_check = [], data.list_dataset.check_images

    def counting(paths):
        checked.append(len(paths))
        return real_check(paths)

    monkeypatch.setattr(data.list_dataset, 'check_images', counting)
    images = [save(Image.new('RGB', (8, 8), (i, 0, 0)), tmp_path / f'{i}.png') for i in range(3)]
    listed = tmp_path / 'train.txt'
    listed.write_text(''.join(f'{os.path.basename(image)} {i}\n' for i, image in enumerate(images)))
    args = argparse.Namespace(train_list=str(listed), img_size=8, num_classes=None, data_root=str(tmp_path / 'root'))

    ListDataset(args, 'train')
    ListDataset(args, 'train')
    assert checked == [3], 'unchanged images were checked again'
    time.sleep(0.01)
    truncated_bytes = open(images[1], 'rb').read()[:30]  # damaged after it passed: a new size and time
    with open(images[1], 'wb') as f:
        f.write(truncated_bytes)
    with pytest.raises(KilnError, match='cannot read image .*1.png'):
        ListDataset(args, 'train')
    assert checked == [3, 3]
    listed.write_text(f'{os.path.basename(images[0])} 0\n')  # another list: checked, once
    ListDataset(args, 'train')
    ListDataset(args, 'train')
    assert checked == [3, 3, 1]
    assert len(os.listdir(tmp_path / 'root' / '.cache')) == 1, 'one record per list, whatever its versions'
    os.remove(images[0])
    with pytest.raises(KilnError, match='train.txt:1: image .*0.png does not exist'):
        ListDataset(args, 'train')


def test_an_image_name_that_is_not_utf8_is_read_and_cached(tmp_path):
    """A Latin-1 file name in a list (bytes that are no UTF-8): listed, checked, decoded and cached (the
    cache's digest hashed such a name as text and failed with UnicodeEncodeError)."""
    import argparse

    from data.list_dataset import ListDataset
    from data.mem_list_dataset import MemListDataset

    image = os.fsencode(tmp_path) + b'/caf\xe9.png'
    try:
        save(Image.new('RGB', (8, 8), (200, 10, 10)), os.fsdecode(image))
    except OSError:
        pytest.skip('this file system takes UTF-8 file names only')
    (tmp_path / 'train.txt').write_bytes(b'caf\xe9.png 0\n')
    args = argparse.Namespace(
        train_list=str(tmp_path / 'train.txt'), img_size=8, num_classes=None, data_root=str(tmp_path / 'root')
    )
    assert ListDataset(args, 'train')[0]['image'][0].float().mean() > 150
    for _ in range(2):  # decoded, then from the cache
        assert MemListDataset(args, 'train').tensors()['image'][0, 0].float().mean() > 150


def test_results_keep_file_and_class_names_that_are_not_utf8(tmp_path):
    """Folders and images named in Latin-1 bytes (old zip archives) trained, but eval.py and predict.py
    failed after the whole evaluation, writing the names into result.txt and predictions.csv, with
    advice to change the locale that did not help. The names are now written back as the same bytes; and
    a run folder so named failed printing its path, writing args.txt and TensorBoard's text."""
    from tests.conftest import run_script

    root = os.fsencode(tmp_path) + b'/d\xe9ta'

    try:
        for split in (b'train', b'val'):
            for shade, name in enumerate((b'plain', b'caf\xe9')):
                os.makedirs(root + b'/' + split + b'/' + name)
                for number in range(2):
                    Image.new('RGB', (8, 8), (120 * shade, 60 * number, 0)).save(
                        os.fsdecode(root + b'/' + split + b'/' + name + b'/n\xe9%d.png' % number)
                    )
    except OSError:
        pytest.skip('this file system takes UTF-8 file names only')
    data, checkpoints = os.fsdecode(root), os.fsdecode(os.fsencode(tmp_path) + b'/ck\xe9')
    trained = run_script(
        'train.py', '--data_type', 'list', '--train_list', f'{data}/train', '--val_list', f'{data}/val',
        '--img_size', '8', '--max_iteration', '1', '--no-progress_bar', '--num_workers', '0', '--cpu',
        '--checkpoints_dir', checkpoints, isolated=True,  # (its own standard output, as from a terminal)
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    run = os.path.join(checkpoints, os.listdir(checkpoints)[0])
    evaluated = run_script('eval.py', '--load_model_path', run, '--no-progress_bar', '--cpu')
    assert evaluated.returncode == 0, evaluated.stderr
    results = os.path.join(run, 'eval', 'best_val_default')
    with open(os.path.join(results, 'result.txt'), 'rb') as f:
        assert b'recall/caf\xe9: ' in f.read()
    with open(os.path.join(results, 'predictions.csv'), 'rb') as f:
        assert b'/val/caf\xe9/n\xe91.png,0,' in f.read()  # (the class that sorts first)
    predicted = run_script('predict.py', '--load_model_path', run, '--input', f'{data}/val', '--cpu')
    assert predicted.returncode == 0, predicted.stderr
    with open(os.path.join(run, 'predict', 'best_val_default', 'predictions.csv'), 'rb') as f:
        written = f.read()
    assert b'/val/caf\xe9/n\xe90.png,' in written and written.count(b'\n') == 5, written


def test_class_folders_spelled_in_two_unicode_forms_are_refused(tmp_path):
    """`élan` composed and decomposed (macOS and Linux copies merged) were two classes, one of them
    named '2' in the results: validation could never label its images. Now one line says to merge them."""
    from data.list_dataset import read_class_folders

    for name in ('élan', 'élan', 'zebra'):
        os.makedirs(tmp_path / name)
        Image.new('RGB', (8, 8)).save(tmp_path / name / 'a.png')
    with pytest.raises(KilnError, match="two class folders named 'élan', spelled in different Unicode forms"):
        read_class_folders(str(tmp_path))


def test_the_folder_above_the_splits_a_class_name_as_a_label_and_a_windows_path_are_told_so(tmp_path):
    """--train_list my_photos (the folder holding train/ and val/) trained a model of two classes, "train"
    and "val"; `a.png cat` was refused without a word of classes.txt; `images\\a.png` (a list written on
    Windows) was said not to exist."""
    import argparse

    from data.list_dataset import ListDataset, read_class_folders

    for split in ('train', 'val'):
        os.makedirs(tmp_path / 'photos' / split / 'cat')
        Image.new('RGB', (8, 8)).save(tmp_path / 'photos' / split / 'cat' / 'a.png')
    with pytest.raises(KilnError) as caught:
        read_class_folders(str(tmp_path / 'photos'))
    folder = tmp_path / 'photos'
    assert str(caught.value) == (
        f'{folder} holds the folders train, val, the splits of a data set, not classes; give --train_list '
        f'{folder / "train"} --val_list {folder / "val"} (classes named so: rename them)'
    )
    assert read_class_folders(str(folder / 'train'))[1] == ['cat']
    os.rename(folder / 'val', folder / 'Valid')  # the suggestion names the folders as they are
    with pytest.raises(
        KilnError, match=re.escape(f'give --train_list {folder / "train"} --val_list {folder / "Valid"} (')
    ):
        read_class_folders(str(folder))
    options = argparse.Namespace(img_size=8, num_classes=None)
    for line, said in (
        ('photos/train/cat/a.png cat', "got label 'cat'; a label is a class number, and classes.txt beside"),
        ('photos\\train\\cat\\a.png 0', 'does not exist; a \\ separates folders on Windows only: write the paths'),
    ):
        options.train_list = list_file(tmp_path, line + '\n')
        with pytest.raises(KilnError, match=re.escape(said)):
            ListDataset(options, 'train')


def test_classes_named_by_numbers_keep_their_names_and_a_list_of_numbers_for_them_is_refused(tmp_path):
    """Class folders 0 to 11 sort as text (0, 1, 10, 11, 2, ...). eval.py on a validation folder holding
    only the first of them named the other classes by their positions ('3' for the class '11'); a list
    file without classes.txt had its label 10 taken as the class '8', without a word (val acc 0.17 where
    the folder gave 1.0); and a refusal listed every one of a thousand classes on one line."""
    import json

    from tests.conftest import run_script

    for split, classes in (('train', range(12)), ('val', range(2)), ('odd', range(20, 32))):
        for number in classes:
            os.makedirs(tmp_path / split / str(number))
            Image.new('RGB', (8, 8), (20 * number, 0, 0)).save(tmp_path / split / str(number) / 'a.png')
    trained = run_script(
        'train.py', '--data_type', 'list', '--train_list', tmp_path / 'train', '--val_list', tmp_path / 'val',
        '--model_type', 'linear', '--img_size', '8', '--max_iteration', '1', '--no-progress_bar', '--num_workers',
        '0', '--cpu', '--checkpoints_dir', tmp_path / 'ck', '--no-log_images',
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    run, names = tmp_path / 'ck' / 'linear_list_default', sorted(map(str, range(12)))
    evaluated = run_script('eval.py', '--load_model_path', run, '--no-progress_bar', '--cpu')
    assert evaluated.returncode == 0, evaluated.stderr
    with open(run / 'eval' / 'best_val_default' / 'result.json') as f:
        assert json.load(f)['class_names'] == names
    (tmp_path / 'val.txt').write_text('val/0/a.png 0\nval/1/a.png 1\n')
    refused = run_script('eval.py', '--load_model_path', run, '--val_list', tmp_path / 'val.txt', '--save_prefix', 'l')
    assert refused.returncode == 2 and refused.stderr.count('\n') == 1, refused.stderr
    assert "label 2 would be the class '10'; give the list a classes.txt" in refused.stderr
    (tmp_path / 'classes.txt').write_text('\n'.join(map(str, range(12))))  # names its labels: now it is clear
    listed = run_script('eval.py', '--load_model_path', run, '--val_list', tmp_path / 'val.txt', '--save_prefix', 'l')
    assert listed.returncode == 0, listed.stderr
    strange = run_script('eval.py', '--load_model_path', run, '--val_list', tmp_path / 'odd', '--save_prefix', 'o')
    assert strange.returncode == 2 and strange.stderr.count('\n') == 1, strange.stderr
    assert '12 class folders that' in strange.stderr and '20, 21, 22' in strange.stderr
    assert strange.stderr.count(', ') < 25 and 'and 2 more' in strange.stderr
    from types import SimpleNamespace

    from data.list_dataset import match_classes

    for names in (['3', '7'], ['1', '2', '3'], ['2019', '2020']):  # a classes.txt naming numbers, in order: no mix-up
        match_classes(SimpleNamespace(class_names=None, list_path='val.txt'), names, 'train.txt')
    match_classes(SimpleNamespace(class_names=None), ['0', '1', '10', '2'], 'train.txt')  # yours, with no list


def test_class_names_files_take_each_line_whole(tmp_path):
    """classes.txt went through the list-file reader, where `#` starts a comment: `#1 rated` vanished (its
    label then showed the next class's name) and `item #2` became `item`, without a word."""
    from data.list_dataset import read_class_names

    (tmp_path / 'classes.txt').write_text('C# code\n#1 rated\n\n  item #2  \r\n"quoted"\n\u00e9t\u00e9\n')
    names = read_class_names(str(tmp_path / 'train.txt'))
    assert names == ['C# code', '#1 rated', 'item #2', '"quoted"', '\u00e9t\u00e9'], names
    (tmp_path / 'classes.txt').write_text('\n \n')
    with pytest.raises(KilnError, match='classes.txt names no class; give one class name per line'):
        read_class_names(str(tmp_path / 'train.txt'))
    (tmp_path / 'classes.txt').write_text('circle\n  # shapes, in label order\nsquare\n')  # it would shift them
    with pytest.raises(KilnError, match="classes.txt:2: '# shapes, in label order' reads as a comment, but every"):
        read_class_names(str(tmp_path / 'train.txt'))


# ---- list files ----------------------------------------------------------------------------------


def list_file(tmp_path, content, name='list.txt'):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def test_plain_lines(tmp_path):
    path = list_file(tmp_path, 'images/001.png 3\nimg.png mask.png\nimg.png 2,3,20,21,0 5,5,10,12,3\n')
    assert read_list_file(path) == [
        (1, ['images/001.png', '3']),
        (2, ['img.png', 'mask.png']),
        (3, ['img.png', '2,3,20,21,0', '5,5,10,12,3']),
    ]


@pytest.mark.parametrize(
    'bom,encoding',
    [
        (codecs.BOM_UTF8, 'utf-8'),
        (codecs.BOM_UTF16_LE, 'utf-16-le'),
        (codecs.BOM_UTF16_BE, 'utf-16-be'),
        (codecs.BOM_UTF32_LE, 'utf-32-le'),
        (codecs.BOM_UTF32_BE, 'utf-32-be'),
    ],
)
def test_byte_order_marks(tmp_path, bom, encoding):
    path = list_file(tmp_path, bom + 'café.png 3\r\nb.png 4\r\n'.encode(encoding))
    assert read_list_file(path, columns=2) == [(1, ['café.png', '3']), (2, ['b.png', '4'])]


def test_utf16_without_bom_is_refused(tmp_path):
    path = list_file(tmp_path, 'a.png 3\n'.encode('utf-16-le'))
    with pytest.raises(KilnError, match='save it as UTF-8'):
        read_list_file(path)


@pytest.mark.parametrize('name', ['café.png'.encode('latin-1'), '图像.png'.encode('gbk')], ids=['latin1', 'gbk'])
def test_non_utf8_file_name_maps_back_to_disk(tmp_path, name):
    on_disk = os.path.join(os.fsencode(tmp_path), name)
    Image.new('RGB', (4, 4), RED).save(on_disk, 'PNG')
    path = list_file(tmp_path, name + b' 3\n')
    [(number, [field, label])] = read_list_file(path, columns=2)
    assert (number, label) == (1, '3') and os.fsencode(field) == name
    image_path = resolve_path(path, field)
    assert os.path.isfile(image_path) and os.fsencode(image_path) == on_disk
    assert_close(decode_image(image_path, 4)[:, 0, 0].tolist(), RED)


@pytest.mark.parametrize('ending', ['\n', '\r\n', '\r'], ids=['lf', 'crlf', 'cr'])
def test_line_endings_and_blank_lines(tmp_path, ending):
    path = list_file(tmp_path, ending.join(['a.png 1', '', '  ', 'b.png 2', '']))
    assert read_list_file(path) == [(1, ['a.png', '1']), (4, ['b.png', '2'])]


def test_comments(tmp_path):
    path = list_file(
        tmp_path, '# a header comment\na.png 1  # why\nimg#1.png 3\n   # indented\nb.png 2 #tight\n"c #2.png" 4\n'
    )
    assert read_list_file(path) == [
        (2, ['a.png', '1']),
        (3, ['img#1.png', '3']),
        (5, ['b.png', '2']),
        (6, ['c #2.png', '4']),
    ]


def test_tabs(tmp_path):
    path = list_file(tmp_path, 'my image.png\t3\na b.png\t\t4  # note\n  c.png \t 5 \n')
    assert read_list_file(path, columns=2) == [(1, ['my image.png', '3']), (2, ['a b.png', '4']), (3, ['c.png', '5'])]
    # a tab a spreadsheet or an editor left at an end, or before a comment, is no field separator: it read one field
    path = list_file(tmp_path, 'a.png 0\t\n\tb.png 1\nc.png 2\t# note\n')
    assert read_list_file(path, columns=2) == [(1, ['a.png', '0']), (2, ['b.png', '1']), (3, ['c.png', '2'])]


def test_quotes(tmp_path):
    path = list_file(tmp_path, '"my image.png" 3\n\'my image.png\' 3\n"it\'s.png" 1\nit\'s.png 2\n')
    expected = [(1, ['my image.png', '3']), (2, ['my image.png', '3']), (3, ["it's.png", '1']), (4, ["it's.png", '2'])]
    assert read_list_file(path) == expected
    assert read_list_file(path, columns=2) == expected


@pytest.mark.parametrize('line', ['"a.png 3', '"a.png"x 3'])
def test_bad_quotes(tmp_path, line):
    path = list_file(tmp_path, 'ok.png 1\n' + line + '\n')
    with pytest.raises(KilnError, match=f'^{re.escape(path)}:2: .*quote'):
        read_list_file(path)


def test_unquoted_spaces_with_columns(tmp_path):
    path = list_file(tmp_path, 'my image.png 3\nmy  big image.png 4\nplain.png 5\n')
    assert read_list_file(path, columns=2) == [
        (1, ['my image.png', '3']),
        (2, ['my  big image.png', '4']),
        (3, ['plain.png', '5']),
    ]
    assert read_list_file(path)[0] == (1, ['my', 'image.png', '3'])  # no columns: no joining


def test_too_few_fields(tmp_path):
    path = list_file(tmp_path, 'a.png 1\nb.png\n')
    with pytest.raises(KilnError) as caught:
        read_list_file(path, columns=2)
    assert str(caught.value) == f"{path}:2: expected 2 fields, got 1: 'b.png'"


def test_too_many_quoted_fields(tmp_path):
    path = list_file(tmp_path, '"a.png" 1 2\n')
    with pytest.raises(KilnError, match=r':1: expected 2 fields, got 3'):
        read_list_file(path, columns=2)


@pytest.mark.parametrize(
    'content',
    [
        'image,label\na.png,1\n"b, c.png",2\n',
        'Image_Path;label\r\na.png;1\r\nb, c.png;2\r\n',
        '# exported\nFILENAME , label\na.png, 1,,\n\n"b, c.png" ,2\n',
    ],
    ids=['comma', 'semicolon-crlf', 'spaces-comment-trailing'],
)
def test_csv_with_header(tmp_path, content):
    rows = read_list_file(list_file(tmp_path, content, 'list.csv'), columns=2)
    assert [fields for _, fields in rows] == [['a.png', '1'], ['b, c.png', '2']]
    assert rows[0][0] == content.count('\n', 0, content.index('a.png')) + 1  # real line numbers


def test_csv_without_header_and_with_bom(tmp_path):
    path = list_file(tmp_path, codecs.BOM_UTF8 + b'a.png,"2,3,20,21,0"\nmy image.png,"1,1,4,4,0"\n', 'boxes.CSV')
    assert read_list_file(path) == [(1, ['a.png', '2,3,20,21,0']), (2, ['my image.png', '1,1,4,4,0'])]
    single = list_file(tmp_path, 'path\nimg #1.png\n', 'single.csv')
    assert read_list_file(single) == [(2, ['img #1.png'])]


def test_missing_and_empty_lists(tmp_path):
    missing = str(tmp_path / 'nope.txt')
    with pytest.raises(KilnError) as caught:
        read_list_file(missing)
    assert str(caught.value) == f'list file {missing} does not exist; check --train_list / --val_list / --input'
    for name, content in [('empty.txt', ''), ('comments.txt', '# nothing\n\n  \n'), ('header.csv', 'image,label\n')]:
        path = list_file(tmp_path, content, name)
        with pytest.raises(KilnError) as caught:
            read_list_file(path)
        assert str(caught.value) == f'list file {path} lists no images'


def test_resolve_path(tmp_path, monkeypatch):
    path = list_file(tmp_path, 'a.png 1\n')
    assert resolve_path(path, 'images/a.png') == os.path.join(str(tmp_path), 'images/a.png')
    assert resolve_path(path, '/data/a.png') == '/data/a.png'
    monkeypatch.setenv('HOME', '/home/someone')
    assert resolve_path(path, '~/a.png') == '/home/someone/a.png'
    monkeypatch.chdir(tmp_path)
    assert resolve_path('list.txt', 'a.png') == os.path.join(str(tmp_path), 'a.png')


@pytest.mark.parametrize('scale', [2, 0.5])
def test_a_mask_of_another_size_than_its_image_is_one_line(tmp_path, scale):
    """A larger mask trained on its top-left corner without a word; a smaller one failed in Pillow's words."""
    import argparse

    from data.seg_list_dataset import SegListDataset

    save(Image.new('RGB', (64, 48), 'white'), tmp_path / 'a.png')
    save(Image.new('L', (int(64 * scale), int(48 * scale)), 1), tmp_path / 'a_mask.png')
    (tmp_path / 'train.txt').write_text('a.png a_mask.png\n')
    (tmp_path / 'seg_classes.txt').write_text('background\nthing\n')
    options = argparse.Namespace(train_list=str(tmp_path / 'train.txt'), img_size=32, num_classes=None)
    dataset = SegListDataset(options, 'train')
    with pytest.raises(KilnError) as caught:
        dataset[0]
    size = f'{int(64 * scale)}x{int(48 * scale)}'
    assert f'train.txt:1: mask {tmp_path / "a_mask.png"} is {size} pixels but its image' in str(caught.value)
    assert '64x48' in str(caught.value) and '\n' not in str(caught.value)


def test_an_image_with_two_masks_or_a_mask_pillow_refuses_is_one_line(tmp_path, monkeypatch):
    """An image listed with two masks trained on both without a word; a mask Pillow refused as too large
    (a damaged header) ended in a traceback."""
    import argparse

    from data.seg_list_dataset import SegListDataset

    save(Image.new('RGB', (64, 48), 'white'), tmp_path / 'a.png')
    for name in ('a_mask.png', 'b_mask.png'):
        save(Image.new('L', (64, 48), 1), tmp_path / name)
    (tmp_path / 'seg_classes.txt').write_text('background\nthing\n')
    (tmp_path / 'train.txt').write_text('a.png a_mask.png\na.png b_mask.png\n')
    options = argparse.Namespace(train_list=str(tmp_path / 'train.txt'), img_size=32, num_classes=None)
    with pytest.raises(KilnError, match=r'train.txt:1 and line 2 give image .*a.png two masks, .*a_mask.png and'):
        SegListDataset(options, 'train')
    (tmp_path / 'train.txt').write_text('a.png a_mask.png\n')
    dataset = SegListDataset(options, 'train')
    monkeypatch.setattr(Image, 'MAX_IMAGE_PIXELS', 1000)  # the mask's 3072 pixels: over twice the limit
    with pytest.raises(KilnError) as caught:
        dataset.read_mask(0, (0, 0, 64, 48), (64, 48))
    assert str(caught.value).startswith(f'cannot read mask {tmp_path / "a_mask.png"} (') and 'too many' in str(
        caught.value
    )


@pytest.mark.parametrize('mode', ['RGB', 'RGBA', 'LA', 'P', '1', 'I;16'])
def test_masks_in_any_mode_are_read_as_class_numbers_and_colour_masks_are_refused(tmp_path, mode):
    """An RGB mask was converted to brightness: class 1 in the red channel read as 0, 2 as 1, and the
    run trained on wrong labels without a word. Grey saved in another mode reads as its class numbers."""
    import argparse

    from data.seg_list_dataset import SegListDataset

    classes = np.zeros((48, 64), np.uint8)
    classes[8:24, 8:40] = 1
    grey = Image.fromarray(classes)
    save(Image.new('RGB', (64, 48), 'white'), tmp_path / 'a.png')
    if mode == 'I;16':
        mask = Image.fromarray(classes.astype(np.uint16))
    else:
        mask = grey.convert(mode) if mode != '1' else Image.fromarray(classes.astype(bool))
    assert mask.mode == mode
    save(mask, tmp_path / 'a_mask.png')
    (tmp_path / 'train.txt').write_text('a.png a_mask.png\n')
    (tmp_path / 'seg_classes.txt').write_text('background\nthing\nother\n')
    options = argparse.Namespace(train_list=str(tmp_path / 'train.txt'), img_size=32, num_classes=None)
    expected = torch.from_numpy(np.array(grey.resize((32, 32), Image.NEAREST)))
    assert torch.equal(SegListDataset(options, 'train')[0]['mask'], expected), mode
    if mode in ('RGB', 'RGBA'):  # a class in one channel only: refused, naming the file
        coloured = np.zeros((48, 64, len(mode)), np.uint8)
        coloured[..., 0] = classes * 2
        save(Image.fromarray(coloured, mode), tmp_path / 'a_mask.png')
        with pytest.raises(KilnError) as caught:
            SegListDataset(options, 'train')[0]
        assert f'train.txt:1: mask {tmp_path / "a_mask.png"} is a colour image ({mode})' in str(caught.value)


@pytest.mark.parametrize(
    'values, said',
    [
        ('corner', 'holds class 5, outside 0..1'),  # one pixel, which a resize to --img_size left out
        ('negative', 'holds class -1, outside 0..1'),  # an 'ignore' label: a traceback from the loss
        ('fraction', 'holds the value 0.6, not a class number'),  # trained as background without a word
    ],
)
def test_every_pixel_of_a_mask_is_checked_before_it_is_resized(tmp_path, values, said):
    """Mask values were checked after the resize to --img_size: a wrong class passed or failed by the crop."""
    import argparse

    from data.seg_list_dataset import SegListDataset

    classes = np.zeros((48, 80), np.float32)
    classes[10:30, 10:50] = 1
    if values == 'corner':
        classes[0, 0] = 5
    elif values == 'negative':
        classes[:4] = -1
    else:
        classes[10:30, 10:50] = 0.6
    mode = {'corner': 'L', 'negative': 'I', 'fraction': 'F'}[values]
    mask = Image.fromarray(classes.astype({'L': np.uint8, 'I': np.int32, 'F': np.float32}[mode]), mode)
    save(Image.new('RGB', (80, 48), 'white'), tmp_path / 'a.png')
    mask.save(tmp_path / 'a_mask.tif')
    (tmp_path / 'train.txt').write_text('a.png a_mask.tif\n')
    options = argparse.Namespace(train_list=str(tmp_path / 'train.txt'), img_size=8, num_classes=2)
    with pytest.raises(KilnError) as caught:
        SegListDataset(options, 'train')[0]
    assert str(caught.value).startswith(f'{tmp_path / "train.txt"}:1: mask {tmp_path / "a_mask.tif"} {said}')


@pytest.mark.parametrize('orientation', [1, 3, 6, 8])
def test_a_jpeg_decoded_at_a_reduced_scale_is_cut_where_its_box_says(tmp_path, orientation):
    """A JPEG decoded at 1/8 of its size (a side no multiple of 8) was mapped as if each decoded pixel
    covered side/decoded-side pixels, where libjpeg's each cover 8 from the stored image's first row and
    column: the picture was shifted against the box that moves boxes and masks by up to 0.25 pixels of
    the output, the other way once the EXIF orientation turns it upright."""
    width, height, edge = 523, 301, 203
    upright = np.zeros((height, width, 3), np.uint8)
    upright[:, edge:] = 255
    turn = {1: None, 3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}
    stored = (
        Image.fromarray(upright) if turn[orientation] is None else Image.fromarray(upright).transpose(turn[orientation])
    )
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(tmp_path / 'a.jpg', quality=95, exif=exif)
    picture, box, size = decode_image(str(tmp_path / 'a.jpg'), 32, with_box=True)
    assert size == (width, height)
    row = picture[0, 16].float().numpy()
    column = int(np.argmax(row > 127.5))  # where the row turns white, to a fraction of a pixel
    seen = column - 0.5 + (127.5 - row[column - 1]) / (row[column] - row[column - 1])
    assert seen == pytest.approx((edge - box[0]) / (box[2] - box[0]) * 32, abs=0.12), (box, orientation)


def test_a_jpeg_mask_is_refused_in_one_line(tmp_path):
    """A JPEG mask trained without a word on class numbers its compression had changed along the edges
    (3% of a small mask's pixels), all still within the classes."""
    import argparse

    from data.seg_list_dataset import SegListDataset

    classes = np.zeros((48, 64), np.uint8)
    classes[8:24, 8:40], classes[30:40, 20:60] = 1, 2
    save(Image.new('RGB', (64, 48), 'white'), tmp_path / 'a.png')
    Image.fromarray(classes).save(tmp_path / 'a_mask.jpg', quality=90)
    (tmp_path / 'train.txt').write_text('a.png a_mask.jpg\n')
    options = argparse.Namespace(train_list=str(tmp_path / 'train.txt'), img_size=32, num_classes=3)
    with pytest.raises(KilnError) as caught:
        SegListDataset(options, 'train')[0]
    assert f'train.txt:1: mask {tmp_path / "a_mask.jpg"} is a JPEG' in str(caught.value), caught.value
    assert 'save masks as PNG' in str(caught.value) and '\n' not in str(caught.value)


def test_a_missing_listed_file_says_what_to_check(tmp_path):
    """Where relative paths are read from; a Latin-1 list naming a UTF-8 file name: the encoding."""
    import argparse

    from data.list_dataset import ListDataset
    from data.list_file import read_image_paths

    save(Image.new('RGB', (8, 8)), tmp_path / 'café.png')
    (tmp_path / 'latin1.txt').write_bytes('café.png 0\n'.encode('latin-1'))
    with pytest.raises(KilnError, match='its name is not UTF-8: if the list was saved as Latin-1 or cp1252'):
        read_image_paths(str(tmp_path / 'latin1.txt'))
    (tmp_path / 'sub').mkdir()
    (tmp_path / 'sub' / 'train.txt').write_text('café.png 0\n')  # relative to the list's folder, not the cwd
    options = argparse.Namespace(train_list=str(tmp_path / 'sub' / 'train.txt'), img_size=8, num_classes=None)
    with pytest.raises(KilnError, match=f"read from the list file's folder, {tmp_path / 'sub'}"):
        ListDataset(options, 'train')
    # a broken link in a class folder: said as such (it blamed a list file's folder, and there is no list)
    for name in ('red', 'blue'):
        (tmp_path / 'folders' / name).mkdir(parents=True)
        save(Image.new('RGB', (8, 8)), tmp_path / 'folders' / name / 'a.png')
    os.symlink(tmp_path / 'gone.png', tmp_path / 'folders' / 'blue' / 'broken.png')
    options = argparse.Namespace(train_list=str(tmp_path / 'folders'), img_size=8, num_classes=None)
    with pytest.raises(KilnError) as caught:
        ListDataset(options, 'train').files_digest()
    assert str(caught.value).endswith(f'does not exist: it is a link to {tmp_path / "gone.png"}, which does not exist')


def test_a_label_far_beyond_the_others_is_refused_not_an_out_of_memory(tmp_path):
    """Labels 0, 1, 100000 made a model of 100001 outputs: 'out of memory; lower --batch_size'."""
    import argparse

    from data.list_dataset import ListDataset

    for name in ('a', 'b', 'c'):
        save(Image.new('RGB', (8, 8)), tmp_path / f'{name}.png')
    (tmp_path / 'typo.txt').write_text('a.png 0\nb.png 1\nc.png 100000\n')
    options = argparse.Namespace(train_list=str(tmp_path / 'typo.txt'), img_size=8, num_classes=None)
    with pytest.raises(KilnError, match=r'typo.txt:3: label 100000 makes 100001 classes, but only 3 different'):
        ListDataset(options, 'train')
    assert ListDataset(argparse.Namespace(**{**vars(options), 'num_classes': 100001}), 'train').num_classes == 100001
    (tmp_path / 'gaps.txt').write_text('a.png 0\nb.png 2\nc.png 5\n')  # a few unused classes are fine
    assert (
        ListDataset(
            argparse.Namespace(**{**vars(options), 'train_list': str(tmp_path / 'gaps.txt')}), 'train'
        ).num_classes
        == 6
    )


def test_a_list_of_values_not_classes_needs_only_parse_target(tmp_path):
    """A regression dataset (a float per image, as the README's "override parse_target" says) met the
    class checks: a traceback ('float' object cannot be interpreted as an integer), or a label outside
    0..0 with --num_classes 1. Targets that are no ints are left to the dataset; the outputs are counted
    by --num_classes, and without it one line says so."""
    import argparse

    from data.list_dataset import ListDataset

    class Sizes(ListDataset):
        def parse_target(self, fields, number):
            return float(fields[0])

    for name in ('a', 'b'):
        save(Image.new('RGB', (8, 8)), tmp_path / f'{name}.png')
    (tmp_path / 'sizes.txt').write_text('a.png 0.25\nb.png 356.5\n')
    options = argparse.Namespace(train_list=str(tmp_path / 'sizes.txt'), img_size=8, num_classes=1)
    dataset = Sizes(options, 'train')
    assert dataset.num_classes == 1 and [target for _, target, _ in dataset.samples] == [0.25, 356.5]
    with pytest.raises(KilnError, match='its targets are no class labels.*give --num_classes'):
        Sizes(argparse.Namespace(**{**vars(options), 'num_classes': None}), 'train')

    class NumpyLabels(ListDataset):  # (a parse_target that reads with numpy): labels still, and checked
        def parse_target(self, fields, number):
            return np.int64(fields[0])

    (tmp_path / 'labels.txt').write_text('a.png 0\nb.png 3\n')
    labelled = argparse.Namespace(**{**vars(options), 'train_list': str(tmp_path / 'labels.txt'), 'num_classes': None})
    assert NumpyLabels(labelled, 'train').num_classes == 4
    with pytest.raises(KilnError, match='label 3 is outside 0..2'):
        NumpyLabels(argparse.Namespace(**{**vars(labelled), 'num_classes': 3}), 'train')


def test_hidden_folders_inside_class_folders_are_left_out(tmp_path):
    """The thumbnails a NAS keeps in hidden folders (QNAP's .@__thumb, .thumbs) were read as more
    training images of the class, low-resolution copies of the real ones."""
    from data.image_io import find_images
    from data.list_dataset import read_class_folders

    for folder in ('cat', 'cat/more', 'cat/.thumbs', 'cat/.@__thumb/deeper', 'dog'):
        (tmp_path / folder).mkdir(parents=True)
        Image.new('RGB', (8, 8)).save(tmp_path / folder / 'a.png')
    assert find_images(str(tmp_path / 'cat')) == [
        str(tmp_path / 'cat' / 'a.png'),
        str(tmp_path / 'cat' / 'more' / 'a.png'),
    ]
    samples, names = read_class_folders(str(tmp_path))
    assert names == ['cat', 'dog'] and [label for _, label, _ in samples] == [0, 0, 1]


def test_very_large_images_decode_without_pillows_warning_and_larger_ones_are_one_line(tmp_path):
    """A 190-million-pixel panorama was refused as a 'decompression bomb' and one of 96 million printed
    Pillow's two-line warning from every worker; here Pillow's limit is shrunk to 100 pixels to try both."""
    import subprocess
    import sys

    from conftest import REPO, timeout

    for side in (12, 15):  # 144 pixels: over the limit, under twice it; 225: over twice
        Image.new('RGB', (side, side), 'red').save(tmp_path / f'{side}.png')
    probe = f"""
import sys
sys.path.insert(0, {REPO!r})
from PIL import Image
from data.image_io import decode_image
from utils.errors import KilnError
Image.MAX_IMAGE_PIXELS = 100
print(tuple(decode_image({str(tmp_path / '12.png')!r}, 8).shape))
try:
    decode_image({str(tmp_path / '15.png')!r}, 8)
except KilnError as error:
    print(error)
"""
    result = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True, timeout=timeout(120))
    assert result.returncode == 0 and result.stderr == '', result.stderr
    decoded, refused = result.stdout.splitlines()
    assert decoded == '(3, 8, 8)'
    assert refused.startswith('cannot read image') and 'more than 200 pixels, too many to decode safely' in refused


def test_a_list_of_another_layout_is_one_overridden_method(tiny_shapes, tmp_path):
    """A CSV "sample_id,label,filepath,fold" needed ListDataset's constructor copied; now a subclass reads
    it in `read_samples` and keeps the rest (class names, file checks, decoding)."""
    import argparse
    import csv as csv_module

    from data.list_dataset import ListDataset

    class CsvDataset(ListDataset):
        def read_samples(self):
            with open(self.list_path, newline='') as f:
                return [
                    (resolve_path(self.list_path, row['filepath']), int(row['label']), number)
                    for number, row in enumerate(csv_module.DictReader(f), start=2)
                ]

    entries = [line.split() for line in open(os.path.join(tiny_shapes, 'train.txt')).read().splitlines()[:5]]
    table = tmp_path / 'train.csv'
    with open(table, 'w', newline='') as f:
        writer = csv_module.writer(f)
        writer.writerow(['sample_id', 'label', 'filepath', 'fold'])
        writer.writerows([i, label, os.path.join(tiny_shapes, path), i % 2] for i, (path, label) in enumerate(entries))
    options = argparse.Namespace(train_list=str(table), img_size=16, num_classes=None, data_root=None, resize=None)
    dataset = CsvDataset(options, 'train')
    assert [int(dataset[i]['label']) for i in range(len(dataset))] == [int(label) for _, label in entries]
    assert dataset[0]['image'].shape == (3, 16, 16) and dataset.num_classes == max(int(e[1]) for e in entries) + 1


def test_predict_refuses_a_listed_image_that_is_not_there_with_or_without_a_label(tmp_path):
    """A list of paths alone predicted the others and put the missing one in unreadable.txt, while the same
    list with labels stopped at it: both stop now, as training and evaluation do. An --input that is a named
    pipe was said not to exist."""
    from data.list_file import read_image_paths
    from predict import images_to_predict

    save(Image.new('RGB', (8, 8)), tmp_path / 'a.png')
    for text in ('a.png 1\nnope.png 2\n', 'a.png\nnope.png\n'):
        listed = list_file(tmp_path, text, 'list.txt')
        with pytest.raises(KilnError) as caught:
            read_image_paths(listed)
        assert str(caught.value).startswith(f'{listed}:2: image {tmp_path / "nope.png"} does not exist'), text
    pipe = tmp_path / 'input'
    os.mkfifo(pipe)
    with pytest.raises(KilnError, match=f'^--input {re.escape(str(pipe))} is a named pipe, not a file or folder: give'):
        images_to_predict(str(pipe))


def test_an_image_without_a_known_extension_is_predicted_and_refused_as_a_list(tmp_path):
    """A JPEG named `photo_noext` or `img.jpe` was read as a list file: 'looks like UTF-16 or UTF-32 text
    without a byte-order mark'. predict.py now predicts it; as a training list it is one line saying what it is."""
    import argparse

    from data.list_dataset import ListDataset
    from data.list_file import read_image_paths
    from predict import images_to_predict

    for name in ('photo_noext', 'img.jpe'):
        image = save(Image.new('RGB', (8, 8), 'red'), tmp_path / name, format='JPEG')
        assert images_to_predict(image) == [image] and decode_image(image, 8).shape == (3, 8, 8)
        options = argparse.Namespace(train_list=image, img_size=8, num_classes=None)
        with pytest.raises(KilnError) as caught:
            ListDataset(options, 'train')
        assert str(caught.value) == f'{image} is an image (JPEG), not a list file: give a list file or a folder'
    listed = list_file(tmp_path, 'photo_noext 0\n', 'list_noext')  # a list without an extension is still a list
    assert images_to_predict(listed) == read_image_paths(listed) == [str(tmp_path / 'photo_noext')]
    utf16 = list_file(tmp_path, 'photo_noext 0\n'.encode('utf-16-le'), 'utf16.txt')
    with pytest.raises(KilnError, match='looks like UTF-16 or UTF-32 text without a byte-order mark'):
        read_list_file(utf16)
    wide = list_file(tmp_path, '照片/猫.png 0\n'.encode('utf-32-le'), 'utf32.txt')  # no ASCII in the names
    with pytest.raises(KilnError, match='looks like UTF-16 or UTF-32 text without a byte-order mark'):
        read_list_file(wide)
    checkpoint = tmp_path / 'last.pth'  # given as a list by mistake: it was said to be UTF-16 text
    torch.save({'weights': torch.zeros(64)}, checkpoint)
    with pytest.raises(KilnError) as caught:
        read_list_file(str(checkpoint))
    assert str(caught.value) == (
        f'{checkpoint} is a zip archive (as a checkpoint is), not a list file: give a list file or a folder'
    )
    labels = tmp_path / 'labels.npy'  # numbers, with zero bytes every 4: no UTF-32 text for all that
    labels.write_bytes(bytes(range(6)).replace(b'', b'\0\0\0')[3:] * 40)
    short = list_file(tmp_path, b'\x01\x00\xff', 'short.bin')
    for binary in (str(labels), short):
        with pytest.raises(KilnError, match='is a binary file, not a list file'):
            read_list_file(binary)


def test_an_image_listed_with_two_labels_is_refused_naming_both_lines(tmp_path):
    """`img/0.png 0` and `img/0.png 1` in one list trained without a word; the same line twice still oversamples."""
    import argparse

    from data.list_dataset import ListDataset

    (tmp_path / 'img').mkdir()
    for index in range(2):
        save(Image.new('RGB', (8, 8)), tmp_path / 'img' / f'{index}.png')
    options = argparse.Namespace(train_list=list_file(tmp_path, 'img/0.png 0\nimg/1.png 1\nimg/0.png 0\n'), img_size=8)
    assert len(ListDataset(argparse.Namespace(**vars(options), num_classes=None), 'train')) == 3
    os.makedirs(tmp_path / 'real' / 'sub')
    os.symlink(tmp_path / 'real' / 'sub', tmp_path / 'link')  # link/.. is real/, not tmp_path: paths stay as written
    save(Image.new('RGB', (8, 8)), tmp_path / 'real' / '2.png')
    linked = list_file(tmp_path, 'link/../2.png 0\nimg/1.png 1\n', 'linked.txt')
    assert len(ListDataset(argparse.Namespace(train_list=linked, img_size=8, num_classes=None), 'train')) == 2
    # (./img/0.png is img/0.png: spelt otherwise, its second label went unseen)
    contradicting = list_file(tmp_path, 'img/0.png 0\nimg/1.png 1\nimg/0.png 0\n./img//0.png 1\n', 'two.txt')
    with pytest.raises(KilnError) as caught:
        ListDataset(argparse.Namespace(train_list=contradicting, img_size=8, num_classes=None), 'train')
    assert str(caught.value) == (
        f'{contradicting}:1 and line 4 give image {tmp_path / "img" / "0.png"} two labels, 0 and 1; remove one of '
        f'the lines'
    )


def test_a_listed_folder_an_empty_image_and_a_missing_folder_say_what_they_are(tmp_path):
    """A listed folder was an image that 'does not exist', a 0-byte .jpg 'not an image in a format Pillow reads',
    and a missing folder a 'list file'."""
    import argparse

    from conftest import run_script
    from data.list_dataset import ListDataset
    from data.list_file import read_image_paths

    for name in ('red', 'blue'):
        (tmp_path / 'folders' / name).mkdir(parents=True)
        save(Image.new('RGB', (8, 8)), tmp_path / 'folders' / name / 'a.png')
    folder = tmp_path / 'folders' / 'red'
    listed = list_file(tmp_path, 'folders/blue/a.png 0\nfolders/red 1\n')
    with pytest.raises(KilnError) as caught:
        ListDataset(argparse.Namespace(train_list=listed, img_size=8, num_classes=None), 'train')
    assert str(caught.value) == f'{listed}:2: image {folder} is a folder, not a file'
    with pytest.raises(KilnError, match=f'^{re.escape(listed)}:2: image {re.escape(str(folder))} is a folder, not a'):
        read_image_paths(listed)
    (folder / 'empty.jpg').write_bytes(b'')
    with pytest.raises(KilnError) as caught:
        ListDataset(argparse.Namespace(train_list=str(tmp_path / 'folders'), img_size=8, num_classes=None), 'train')
    assert str(caught.value).startswith(f'cannot read image {folder / "empty.jpg"} (')
    assert str(caught.value).endswith('): the file is empty (0 bytes); fix or remove it')
    with pytest.raises(KilnError, match=r'empty.jpg: the file is empty \(0 bytes\); fix or remove it$'):
        decode_image(str(folder / 'empty.jpg'), 8)
    check = '; check --train_list / --val_list / --input'
    for name, kind in [('gone/', 'folder'), ('gone', 'list file or folder'), ('gone.txt', 'list file')]:
        with pytest.raises(KilnError) as caught:
            read_list_file(f'{tmp_path}/{name}')
        assert str(caught.value) == f'{kind} {tmp_path}/{name} does not exist{check}'
    result = run_script('train.py', '--data_type', 'list', '--train_list', tmp_path / 'gone', '--cpu')
    assert (
        result.returncode == 2
        and result.stderr == f'error: list file or folder {tmp_path / "gone"} does not exist{check}\n'
    )


PREDICT_A_PIPE = """
import argparse, sys
from predict import DecodedImages
print(DecodedImages([sys.argv[1]], argparse.Namespace(img_size=8, resize='squash', crop_pct=0.875))[0][1])
"""


@pytest.mark.skipif(not hasattr(os, 'mkfifo'), reason='no named pipes on this system')
def test_a_named_pipe_named_as_an_image_is_said_not_waited_for(tmp_path):
    """predict.py waited forever on a named pipe among the images of its --input (its open waits for a
    writer), and train.py said of one in a class folder that it 'does not exist'."""
    import argparse
    import subprocess
    import sys

    from conftest import REPO, timeout
    from data.list_dataset import ListDataset

    for name in ('red', 'blue'):
        (tmp_path / name).mkdir()
        save(Image.new('RGB', (8, 8)), tmp_path / name / 'a.png')
    pipe = tmp_path / 'red' / 'pipe.png'
    os.mkfifo(pipe)
    with pytest.raises(KilnError) as caught:
        ListDataset(argparse.Namespace(train_list=str(tmp_path), img_size=8, num_classes=None), 'train')
    assert str(caught.value) == f'{tmp_path}:red/pipe.png: image {pipe} is a named pipe, not a file'
    # predict.py's reading of each image, which lists the reason in unreadable.txt (in a process of its own:
    # a wait for a writer would never end)
    result = subprocess.run(
        [sys.executable, '-c', PREDICT_A_PIPE, str(pipe)], cwd=REPO, capture_output=True, text=True, timeout=timeout(60)
    )
    assert result.stdout.strip() == f'cannot read image {pipe}: it is a named pipe, not a file; remove it', (
        result.stderr
    )


def test_the_photo_set_command_refuses_a_folder_it_did_not_make_and_leaves_it_whole(tmp_path):
    """`python3 -m data.photo_set DEST` deleted an existing DEST and everything in it: one that is not a
    photo set it made (no photo_set.json) is now refused in one line, before anything is written."""
    import sys

    from conftest import run_script
    from data.photo_set import make_photo_set

    dest = tmp_path / 'mine'
    (dest / 'keep').mkdir(parents=True)
    (dest / 'keep' / 'a.txt').write_text('hi')
    result = run_script(sys.executable, '-m', 'data.photo_set', dest)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (
        f'error: {dest} exists and is not a photo set made by this command (no photo_set.json); '
        f'move it away or choose another DEST\n'
    )
    assert (dest / 'keep' / 'a.txt').read_text() == 'hi' and os.listdir(tmp_path) == ['mine']  # nothing staged
    (tmp_path / 'file.txt').write_text('x')
    with pytest.raises(KilnError, match=f'^{re.escape(str(tmp_path / "file.txt"))} is a file, not a folder; give'):
        make_photo_set(str(tmp_path / 'file.txt' / 'set'), 1, 1)
    # sizes the wrong way round were a traceback; a negative count made empty class folders, said made
    for options, said in (
        (['--sizes', '300', '64'], 'error: --sizes 300 64: give the smaller side first (MIN MAX)'),
        (['--per_class', '-2'], 'error: argument --per_class: must be a positive integer, got -2'),
        (['--sizes', '-5', '-1'], 'error: argument --sizes: must be an integer of 8 or more, got -5'),
    ):
        refused = run_script(sys.executable, '-m', 'data.photo_set', tmp_path / 'set', *options)
        assert refused.returncode == 2 and refused.stderr.startswith(said), refused.stderr
        assert len(refused.stderr.splitlines()) == 1 and not (tmp_path / 'set').exists()


def test_the_photo_set_fills_an_empty_folder_and_replaces_only_its_own_older_set(tmp_path):
    """What the refusal above leaves alone: an empty DEST is filled, and a set this command made with other
    settings is replaced, with no staging folder left beside it."""
    pytest.importorskip('skimage', reason="the photo set needs scikit-image (python3 -m pip install -e '.[dev]')")
    from data.photo_set import make_photo_set

    dest = tmp_path / 'set'
    dest.mkdir()
    make_photo_set(str(dest), 1, 1, sizes=(16, 24))
    make_photo_set(str(dest), 1, 1, sizes=(16, 24), seed=1)
    settings = '{"per_class": 1, "val_per_class": 1, "sizes": [16, 24], "seed": 1, "version": 2}'
    assert (dest / 'photo_set.json').read_text() == settings
    assert sorted(os.listdir(dest)) == ['.made.json', 'photo_set.json', 'train', 'val']
    assert os.listdir(tmp_path) == ['set']


def test_generated_datasets_get_the_permissions_of_a_plain_folder(tmp_path):
    """They were made in a temporary folder, which is its owner's alone, and renamed: a dataset made in a
    shared folder was unreadable by the others."""
    from data.shapes import generate_shapes

    umask = os.umask(0o022)
    try:
        shapes = generate_shapes(str(tmp_path / 'shapes'), train_size=2, val_size=2)
    finally:
        os.umask(umask)
    assert os.stat(shapes).st_mode & 0o777 == 0o755


def test_the_shapes_command_refuses_a_folder_it_did_not_make_in_one_line_before_generating(tmp_path, monkeypatch):
    """`python3 -m data.shapes DEST` into a folder that is no shapes dataset generated all 7,200 images, then
    printed a traceback naming --data_root, an option it does not have: now one line naming DEST, up front;
    train.py's own default copy still names --data_root."""
    import sys

    import data.shapes
    from conftest import run_script

    dest = tmp_path / 'x'
    (dest / 'mine').mkdir(parents=True)
    result = run_script(sys.executable, '-m', 'data.shapes', dest)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (
        f'error: {dest} exists and is not a generated shapes dataset (no manifest.json of the generator); '
        f'move it away or choose another DEST\n'
    )
    assert os.listdir(dest) == ['mine'] and os.listdir(tmp_path) == ['x']

    def no_images(*args):
        raise AssertionError('generated images before refusing')

    monkeypatch.setattr(data.shapes, '_write_split', no_images)
    with pytest.raises(KilnError, match='choose another DEST$'):
        data.shapes.main([str(dest)])
    with pytest.raises(KilnError, match='choose another --data_root$'):
        data.shapes.generate_shapes(str(dest))
    (tmp_path / 'file.txt').write_text('x')
    with pytest.raises(KilnError, match=f'^{re.escape(str(tmp_path / "file.txt"))} is a file, not a folder; give a'):
        data.shapes.generate_shapes(str(tmp_path / 'file.txt' / 'shapes'))


def test_a_validation_class_no_training_sample_has_is_noted(tiny_shapes, tmp_path):
    """Labels 1..3 in the training list and 0..2 in the validation list trained without a word: class 0 had
    no training sample, and every validation label meant another class."""
    from conftest import run_script

    entries = [line.split() for line in open(os.path.join(tiny_shapes, 'train.txt')).read().splitlines()]
    kept = [(os.path.join(tiny_shapes, path), int(label)) for path, label in entries if int(label) < 3]
    (tmp_path / 'train.txt').write_text(''.join(f'{path} {label + 1}\n' for path, label in kept))
    (tmp_path / 'val.txt').write_text(''.join(f'{path} {label}\n' for path, label in kept[:12]))
    lists = ['--train_list', tmp_path / 'train.txt', '--val_list', tmp_path / 'val.txt']
    common = ['--data_type', 'list', '--model_type', 'linear', '--cpu', '--max_iteration', '1', '--no-progress_bar']
    result = run_script('train.py', *common, *lists, '--checkpoints_dir', tmp_path / 'ck')
    notes = [line for line in result.stdout.splitlines() if line.startswith('note:')]
    assert result.returncode == 0 and len(notes) == 1, result.stdout + result.stderr
    assert notes[0].startswith('note: no training sample has label 0, which the validation list has'), notes
