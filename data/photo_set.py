"""A small set of real photos in class folders, cut from the photographs that scikit-image ships inside
its package (nothing is downloaded): `python -m data.photo_set DEST [--per_class N]`.

Each class is one photograph (an astronaut, a cat, coffee, a rocket, a motorcycle, a retina); each
image is a random crop of it (5% to 40% of its area, aspect ratio 1:2 to 2:1; training images from its
first 70%, validation images from the rest), resized to a random size, sometimes mirrored or turned,
and saved as a JPEG of random quality (some as PNG, some with an EXIF orientation). The result,
DEST/train/<class>/*.jpg and DEST/val/<class>/*.jpg, is laid out the way people bring their photos;
it is deterministic from the seed. It needs the dev extra (`python3 -m pip install -e '.[dev]'`:
scikit-image).
"""

import argparse
import json
import os
import random
import shutil

from PIL import Image

from utils.errors import KilnError, run_cli

SOURCES = {  # class -> the photographs of scikit-image's data folder it is cut from
    'astronaut': ('astronaut.png',),
    'cat': ('chelsea.png',),
    'coffee': ('coffee.png',),
    'rocket': ('rocket.jpg',),
    'motorcycle': ('motorcycle_left.png', 'motorcycle_right.png'),
    'retina': ('retina.jpg',),
}


def _photographs():
    """{class: [RGB Pillow images]} from scikit-image's data folder."""
    try:
        import skimage
    except ImportError:
        raise KilnError("data/photo_set.py needs scikit-image: python3 -m pip install -e '.[dev]'") from None
    folder = os.path.join(os.path.dirname(skimage.__file__), 'data')
    return {
        name: [Image.open(os.path.join(folder, file)).convert('RGB') for file in files]
        for name, files in SOURCES.items()
    }


def _region(photo, split):
    """The part of `photo` a split's crops come from: training's its first 70% along the longer side,
    validation's the rest, so validation photos show what training never saw."""
    cut = round(0.7 * max(photo.size))
    if photo.width >= photo.height:
        return photo.crop((0, 0, cut, photo.height) if split == 'train' else (cut, 0, photo.width, photo.height))
    return photo.crop((0, 0, photo.width, cut) if split == 'train' else (0, cut, photo.width, photo.height))


def _sample(photo, rng, sizes):
    """A random crop of `photo` (5% to 40% of its area), resized to a random longer side in `sizes`,
    maybe mirrored."""
    area = photo.width * photo.height * rng.uniform(0.05, 0.4)
    aspect = 2 ** rng.uniform(-1, 1)
    width = min(photo.width, round((area * aspect) ** 0.5))
    height = min(photo.height, round((area / aspect) ** 0.5))
    x, y = rng.randint(0, photo.width - width), rng.randint(0, photo.height - height)
    crop = photo.crop((x, y, x + width, y + height))
    longer = rng.randint(*sizes)
    scale = longer / max(width, height)
    crop = crop.resize((max(8, round(width * scale)), max(8, round(height * scale))), Image.BICUBIC)
    return crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else crop


def _save(image, path, rng):
    """Save as a JPEG of random quality (one in eight turned and tagged with an EXIF orientation that turns
    it back), or one in ten as PNG; returns the file name."""
    if rng.random() < 0.1:
        image.save(path + '.png')
        return path + '.png'
    options = {'quality': rng.randint(60, 95)}
    if rng.random() < 0.125:
        exif = Image.Exif()
        exif[0x0112] = 6  # shown turned 90 degrees clockwise: stored turned the other way
        image, options['exif'] = image.transpose(Image.Transpose.ROTATE_90), exif.tobytes()
    image.save(path + '.jpg', **options)
    return path + '.jpg'


def make_photo_set(root, per_class=60, val_per_class=20, sizes=(64, 320), seed=0):
    """Write the photo set into `root` (train/ and val/, a folder per class) unless a complete copy with
    these settings is there; returns `root`. Written into a temporary folder and renamed, so an
    interrupted run leaves no half set."""
    settings = {'per_class': per_class, 'val_per_class': val_per_class, 'sizes': list(sizes), 'seed': seed}
    manifest = os.path.join(root, 'photo_set.json')
    if os.path.isfile(manifest):
        with open(manifest) as f:
            if json.load(f) == settings:
                return root
    partial = f'{root}.partial{os.getpid()}'
    shutil.rmtree(partial, ignore_errors=True)
    rng = random.Random(seed)
    for name, photos in _photographs().items():
        for split, count in (('train', per_class), ('val', val_per_class)):
            folder = os.path.join(partial, split, name)
            os.makedirs(folder)
            for index in range(count):
                photo = _region(rng.choice(photos), split)
                _save(_sample(photo, rng, sizes), os.path.join(folder, f'{index:04d}'), rng)
    with open(os.path.join(partial, 'photo_set.json'), 'w') as f:
        json.dump(settings, f)
    shutil.rmtree(root, ignore_errors=True)
    os.replace(partial, root)
    return root


def main(argv=None):
    """Command line: write the photo set into DEST."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('dest')
    parser.add_argument('--per_class', type=int, default=60, help='training images per class')
    parser.add_argument('--val_per_class', type=int, default=20, help='validation images per class')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--sizes', type=int, nargs=2, default=(64, 320), metavar=('MIN', 'MAX'), help='sides in pixels')
    args = parser.parse_args(argv)
    root = make_photo_set(args.dest, args.per_class, args.val_per_class, tuple(args.sizes), args.seed)
    print(f'{root}: train/ and val/ with {len(SOURCES)} class folders ({", ".join(SOURCES)})')


if __name__ == '__main__':
    run_cli(main)
