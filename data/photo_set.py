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

import contextlib
import errno
import json
import os
import random
import shutil
import tempfile

from PIL import Image

from data.shapes import record_made, refuse_added_by_hand, staging_folder
from utils.errors import KilnError, file_in_the_way, is_a_file, run_cli

MANIFEST = 'photo_set.json'  # the settings a set was made with: what marks a folder as one this command made
SOURCES = {  # class -> the photographs of scikit-image's data folder it is cut from
    'astronaut': ('astronaut.png',),
    'cat': ('chelsea.png',),
    'coffee': ('coffee.png',),
    'rocket': ('rocket.jpg',),
    # not motorcycle_right.png too: a stereo pair, its training part shows the left's validation part
    'motorcycle': ('motorcycle_left.png',),
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


def _read_settings(root):
    """The settings in `root`'s manifest (photo_set.json) when this command made it, else None."""
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            settings = json.load(f)
    except (OSError, ValueError):
        return None
    ours = isinstance(settings, dict) and {'per_class', 'val_per_class', 'seed'} <= settings.keys()
    return settings if ours else None


def make_photo_set(root, per_class=60, val_per_class=20, sizes=(64, 320), seed=0):
    """Write the photo set into `root` (train/ and val/, a folder per class) unless a complete copy with
    these settings is there; returns `root`. Written into a temporary folder beside it and renamed, so an
    interrupted run leaves no half set. Only a photo set this made (its manifest) is replaced: anything
    else there but an empty folder is refused before anything is written, and never touched."""
    # version 2: the motorcycle class without the stereo pair's right photograph (a set of version 1 is remade)
    settings = {
        'per_class': per_class,
        'val_per_class': val_per_class,
        'sizes': list(sizes),
        'seed': seed,
        'version': 2,
    }
    found = _read_settings(root)
    if found == settings:
        return root
    if found is None and os.path.lexists(root) and not (os.path.isdir(root) and not os.listdir(root)):
        raise KilnError(_not_a_photo_set(root))
    if found is not None:  # files of yours in it: not replaced
        refuse_added_by_hand(root, 'move it away, or choose another DEST')
    blocker = file_in_the_way(root)
    if blocker is not None:
        raise KilnError(f'{blocker} {is_a_file(blocker)}; give a folder as DEST')
    photographs = _photographs()
    parent = os.path.dirname(os.path.abspath(root))
    staging = staging_folder(parent, '.photo_set-', 'DEST')
    try:
        rng = random.Random(seed)
        for name, photos in photographs.items():
            for split, count in (('train', per_class), ('val', val_per_class)):
                folder = os.path.join(staging, split, name)
                os.makedirs(folder)
                for index in range(count):
                    photo = _region(rng.choice(photos), split)
                    _save(_sample(photo, rng, sizes), os.path.join(folder, f'{index:04d}'), rng)
        with open(os.path.join(staging, MANIFEST), 'w') as f:
            json.dump(settings, f)
        record_made(staging)
        if _read_settings(root) != settings:  # (else another process finished the same set first: kept)
            _move_into_place(staging, root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def _not_a_photo_set(root):
    return (
        f'{root} exists and is not a photo set made by this command (no {MANIFEST}); '
        f'move it away or choose another DEST'
    )


def _move_into_place(staging, root):
    """Rename `staging` to `root`; an older photo set there (its manifest) is moved aside first and
    removed once the new one is in place. Anything else that appeared there meanwhile is refused (a
    rename replaces only an empty folder)."""
    aside = None
    if _read_settings(root) is not None:
        refuse_added_by_hand(root, 'move it away, or choose another DEST')  # (added since the start)
        aside = tempfile.mkdtemp(prefix='.photo_set-old-', dir=os.path.dirname(os.path.abspath(root)))
        os.rename(root, os.path.join(aside, 'set'))
    try:
        os.rename(staging, root)
    except OSError as error:
        if aside is not None:  # the older set goes back where it was, if that is still free
            with contextlib.suppress(OSError):
                os.rename(os.path.join(aside, 'set'), root)
                os.rmdir(aside)
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
            raise
        raise KilnError(_not_a_photo_set(root)) from None
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def main(argv=None):
    """Command line: write the photo set into DEST."""
    from options import KilnArgumentParser, count_at_least  # (a mistake: one line)

    parser = KilnArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('dest', metavar='DEST', help='folder to create')
    parser.add_argument('--per_class', type=count_at_least(1), default=60, help='training images per class')
    parser.add_argument('--val_per_class', type=count_at_least(1), default=20, help='validation images per class')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument(
        '--sizes', type=count_at_least(8), nargs=2, default=(64, 320), metavar=('MIN', 'MAX'), help='longer sides'
    )
    parser.add_argument('--debug', action='store_true', help='show full tracebacks on errors')
    args = parser.parse_args(argv)
    if args.sizes[0] > args.sizes[1]:
        parser.error(f'--sizes {args.sizes[0]} {args.sizes[1]}: give the smaller side first (MIN MAX)')
    root = make_photo_set(args.dest, args.per_class, args.val_per_class, tuple(args.sizes), args.seed)
    print(f'{root}: train/ and val/ with {len(SOURCES)} class folders ({", ".join(SOURCES)})')


if __name__ == '__main__':
    run_cli(main)
