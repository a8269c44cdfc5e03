"""The embedded default dataset: coloured shapes drawn offline from a seed.

Each image shows one shape (the class) of random colour, size, position and rotation on a
noisy background with distracting lines and dots. The generator writes real PNG files plus
`train.txt`, `val.txt` and `classes.txt`, so the default run reads data exactly the way a
user's own list files are read. For segmentation it also writes a mask per image (0 for the
background, 1 + class on the shape's pixels), `seg_train.txt`/`seg_val.txt` of
`image_path mask_path` lines, and `seg_classes.txt`. The detection variant
(`generate_shape_boxes`) draws 1 to 4 shapes per image and lists their boxes as
`image_path x1,y1,x2,y2,class ...` lines. Run `python -m data.shapes --help` to generate a copy by hand.
"""

import argparse
import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from utils.errors import KilnError, file_in_the_way, is_a_file, listed, run_cli

CLASS_NAMES = ('circle', 'square', 'triangle', 'star', 'cross', 'ring')
GENERATOR_VERSION = 2
SUPERSAMPLE = 4  # shapes are drawn 4x larger, then shrunk, for anti-aliased edges


def _polygon(center, radius, angle, corners, inner_ratio=None):
    """Vertices of a regular polygon (or a star when inner_ratio is given)."""
    points = []
    steps = corners * 2 if inner_ratio else corners
    for k in range(steps):
        r = radius * (inner_ratio if inner_ratio and k % 2 else 1.0)
        a = angle + 2 * math.pi * k / steps
        points.append((center[0] + r * math.cos(a), center[1] + r * math.sin(a)))
    return points


def _cross(center, radius, angle, arm):
    """Vertices of a plus sign with arms of half-width `arm`."""
    outline = [
        (arm, radius),
        (arm, arm),
        (radius, arm),
        (radius, -arm),
        (arm, -arm),
        (arm, -radius),
        (-arm, -radius),
        (-arm, -arm),
        (-radius, -arm),
        (-radius, arm),
        (-arm, arm),
        (-arm, radius),
    ]
    cos, sin = math.cos(angle), math.sin(angle)
    return [(center[0] + x * cos - y * sin, center[1] + x * sin + y * cos) for x, y in outline]


def _contrasting_colour(rng, background):
    """A random colour far enough from the background to stay visible."""
    while True:
        colour = rng.integers(0, 256, size=3)
        if np.abs(colour - background).sum() > 200:
            return tuple(int(c) for c in colour)


def _background(rng, big, clutter=(1, 4)):
    """A `big`-pixel canvas of random colour with a few thin lines and small dots as clutter;
    returns (image, its ImageDraw, the background colour)."""
    background = rng.integers(0, 256, size=3)
    image = Image.new('RGB', (big, big), tuple(int(c) for c in background))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(*clutter)):
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            xy = [tuple(rng.uniform(0, big, size=2)) for _ in range(2)]
            draw.line(xy, fill=colour, width=SUPERSAMPLE)
        else:
            x, y = rng.uniform(0, big, size=2)
            r = rng.uniform(1, 2.5) * SUPERSAMPLE
            draw.ellipse([x - r, y - r, x + r, y + r], fill=colour)
    return image, draw, background


def _draw_shape(canvas, name, center, radius, angle, fill):
    """Draw shape `name` inside the circle (center, radius) on an ImageDraw canvas."""
    box = [center[0] - radius, center[1] - radius, center[0] + radius, center[1] + radius]
    if name == 'circle':
        canvas.ellipse(box, fill=fill)
    elif name == 'ring':
        canvas.ellipse(box, outline=fill, width=max(1, int(radius * 0.3)))
    elif name == 'square':
        canvas.polygon(_polygon(center, radius, angle, 4), fill=fill)
    elif name == 'triangle':
        canvas.polygon(_polygon(center, radius, angle, 3), fill=fill)
    elif name == 'star':
        canvas.polygon(_polygon(center, radius, angle, 5, inner_ratio=0.45), fill=fill)
    else:
        canvas.polygon(_cross(center, radius, angle, radius * 0.3), fill=fill)


def _shrink_with_noise(image, rng, size):
    """The supersampled image shrunk to `size` (anti-aliasing the edges) with Gaussian pixel noise."""
    pixels = np.asarray(image.resize((size, size), Image.BILINEAR), dtype=np.int16)
    noise = rng.normal(0, 8, size=pixels.shape)
    return Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))


def draw_shape_image(label, rng, size=32):
    """One RGB image of class `label` drawn with the random generator `rng`, and its mask
    (an 'L' image: 0 background, label + 1 on the shape)."""
    big = size * SUPERSAMPLE
    image, draw, background = _background(rng, big)
    mask = Image.new('L', (big, big), 0)
    radius = rng.uniform(0.22, 0.42) * big
    center = rng.uniform(radius, big - radius, size=2)
    angle = rng.uniform(0, 2 * math.pi)
    colour = _contrasting_colour(rng, background)
    name = CLASS_NAMES[label]
    for canvas, fill in ((draw, colour), (ImageDraw.Draw(mask), label + 1)):
        _draw_shape(canvas, name, center, radius, angle, fill)
    return _shrink_with_noise(image, rng, size), mask.resize((size, size), Image.NEAREST)


def _overlap(a, b):
    """Intersection of boxes a and b over the smaller one's area (an upper bound on their IoU)."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    return w * h / min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))


def draw_boxes_image(rng, size=64, max_shapes=4, radius_range=(0.094, 0.22), max_overlap=0.3, tries=30):
    """One RGB image with 1 to `max_shapes` shapes, and their boxes as [(x1, y1, x2, y2, label)] in
    pixels (x2, y2 exclusive, tight around the drawn pixels).

    Shapes are inscribed in circles of radius `radius_range` times `size` (box sides ~12-28 px at
    64 px), placed fully inside the image. A shape whose box would cover more than `max_overlap`
    of a smaller box already placed (so their IoU is below it too) is placed again, up to `tries`
    times, then dropped: later shapes are drawn over earlier ones, and this keeps every shape
    mostly visible.
    """
    big = size * SUPERSAMPLE
    image, draw, background = _background(rng, big, clutter=(2, 8))  # more clutter: 4x the area of a 32 px image
    boxes = []
    for _ in range(rng.integers(1, max_shapes + 1)):
        label = int(rng.integers(len(CLASS_NAMES)))
        for _ in range(tries):
            radius = rng.uniform(*radius_range) * big
            center = rng.uniform(radius, big - radius, size=2)
            angle = rng.uniform(0, 2 * math.pi)
            # the tight box of the drawn pixels, from the shape drawn alone on a blank mask
            mask = Image.new('L', (big, big), 0)
            _draw_shape(ImageDraw.Draw(mask), CLASS_NAMES[label], center, radius, angle, 255)
            box = mask.getbbox()
            if box and all(_overlap(box, other) < max_overlap for *other, _ in boxes):
                break
        else:
            continue
        _draw_shape(draw, CLASS_NAMES[label], center, radius, angle, _contrasting_colour(rng, background))
        boxes.append((*box, label))
    scaled = [tuple(round(v / SUPERSAMPLE, 1) for v in box[:4]) + (box[4],) for box in boxes]
    return _shrink_with_noise(image, rng, size), scaled


def _write_split(root, split, count, seed, size, progress):
    lines, seg_lines = [], []
    os.makedirs(os.path.join(root, 'images', split))
    os.makedirs(os.path.join(root, 'masks', split))
    for index in range(count):
        # one generator per image: the dataset is the same whatever order it is written in
        rng = np.random.default_rng([seed, 0 if split == 'train' else 1, index])
        label = index % len(CLASS_NAMES)
        image_path, mask_path = f'images/{split}/{index:05d}.png', f'masks/{split}/{index:05d}.png'
        image, mask = draw_shape_image(label, rng, size)
        image.save(os.path.join(root, image_path))
        mask.save(os.path.join(root, mask_path))
        lines.append(f'{image_path} {label}\n')
        seg_lines.append(f'{image_path} {mask_path}\n')
        progress.update()
    with open(os.path.join(root, f'{split}.txt'), 'w') as f:
        f.writelines(lines)
    with open(os.path.join(root, f'seg_{split}.txt'), 'w') as f:
        f.writelines(seg_lines)


def _write_box_split(root, split, count, seed, size, progress):
    lines = []
    os.makedirs(os.path.join(root, 'images', split))
    for index in range(count):
        # the trailing 1 keeps these images independent of the classification ones with the same seed
        rng = np.random.default_rng([seed, 0 if split == 'train' else 1, index, 1])
        image_path = f'images/{split}/{index:05d}.png'
        image, boxes = draw_boxes_image(rng, size)
        image.save(os.path.join(root, image_path))
        fields = [image_path] + [f'{x1:g},{y1:g},{x2:g},{y2:g},{label}' for x1, y1, x2, y2, label in boxes]
        lines.append(' '.join(fields) + '\n')
        progress.update()
    with open(os.path.join(root, f'{split}.txt'), 'w') as f:
        f.writelines(lines)


def _read_manifest(path):
    """The manifest of a copy this module generated, or None where there is none, it is damaged or it is
    not one of ours (a manifest.json of the user's own data); PermissionError where it cannot be read."""
    try:
        with open(path) as f:
            manifest = json.load(f)
    except PermissionError:  # (the file, or a folder on its way): a dataset there, but not readable to this user
        raise
    except (OSError, ValueError):
        return None
    ours = isinstance(manifest, dict) and {'version', 'train_size', 'val_size', 'seed'} <= manifest.keys()
    return manifest if ours else None


MADE = '.made.json'  # in a generated copy: the digest of each file as the generator left it


def _files(root):
    """{path under `root`: sha256 of its bytes, 'folder' (named with a / at its end), or where it links to}
    of everything in `root` (MADE aside; links are not followed)."""
    found = {}
    for folder, folders, names in os.walk(root):
        for name in names + folders:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, root)
            if os.path.islink(path):
                found[relative] = f'link to {os.readlink(path)}'
            elif name in folders:
                found[relative + '/'] = 'folder'
            elif relative != MADE:
                try:
                    with open(path, 'rb') as f:
                        found[relative] = hashlib.file_digest(f, 'sha256').hexdigest()
                except OSError:  # (not readable to this user: not as the generator left it)
                    found[relative] = 'unreadable'
    return found


def record_made(staging):
    """Write what the generator made into `staging` (its MADE file), for `refuse_added_by_hand`."""
    with open(os.path.join(staging, MADE), 'w') as f:
        json.dump({'files': _files(staging)}, f)


def refuse_added_by_hand(generated, what_to_do):
    """A KilnError when the generated copy `generated` is no longer what its generator made (its MADE
    record): a file of one's own added, one edited (a label mended) or one removed (a bad image). Such a
    copy is not replaced when made again with other settings; nor is one without the record (made by an
    earlier Kiln, or copied without its hidden files), which may hold anything."""
    try:
        with open(os.path.join(generated, MADE)) as f:
            made = json.load(f).get('files')
    except (OSError, ValueError, AttributeError):
        made = None
    if not isinstance(made, dict):
        raise KilnError(
            f'{generated} was generated with other settings, but keeps no digests of what the generator made '
            f"there ({MADE}: none, copied without its hidden files, or an earlier Kiln's, of names only), so "
            f'files of yours may be in it; move it away (or delete it, if nothing in it is yours)'
        )
    now = _files(generated)
    changed = sorted(name for name in set(now) | set(made) if now.get(name) != made.get(name))
    if changed:
        raise KilnError(
            f'{generated} was generated with other settings, but {listed(changed, 3)} '
            f'{"differs" if len(changed) == 1 else "differ"} from what the generator made (added, edited or '
            f'removed since); {what_to_do}'
        )


def staging_folder(parent, prefix, where_option):
    """A new hidden folder in `parent` (made if need be) to write a dataset into before renaming it into
    place, with the permissions a plain mkdir gives (tempfile's are the owner's alone: a shared dataset
    stayed unreadable), the set-group-ID bit of a shared parent included (its files then take its group).
    A KilnError naming `where_option` where `parent` cannot be written."""
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=prefix, dir=parent)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):  # a full disk: utils/errors.py's advice
            raise
        raise KilnError(
            f'cannot write a dataset into {parent} ({error.strerror}); give a folder you can write to as {where_option}'
        ) from None
    umask = os.umask(0o022)  # read by setting it: there is no other way
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask | os.stat(staging).st_mode & stat.S_ISGID)
    return staging


def _not_ours(root, where_option):
    """The KilnError for a `root` that exists and is no generated shapes dataset."""
    return KilnError(
        f'{root} exists and is not a generated shapes dataset (no manifest.json of the generator); '
        f'move it away or choose another {where_option}'
    )


def _generate(root, manifest, write, total, where_option):
    """Run `write(folder, progress)` to generate a dataset into `root` unless a complete copy with
    this `manifest` is there; `total` is the number of images, for the progress bar.

    Files are written into a temporary sibling folder and renamed into place at the end, so an
    interrupted generation never leaves a half-written dataset, and concurrent processes (one
    per DDP rank) simply keep whichever copy finished first. A copy made by another generator
    version or with other settings (its manifest.json says so) is replaced; anything else there
    but an empty folder is refused before generating (a KilnError naming `where_option`, the
    option or argument that named `root`) and never touched. Returns `root`.
    """
    manifest_path = os.path.join(root, 'manifest.json')
    try:
        found = _read_manifest(manifest_path)
    except PermissionError as error:  # a shared copy of another user's: not "no dataset of ours"
        raise KilnError(
            f'cannot read {manifest_path} ({error.strerror}): ask its owner to open the dataset and the folders '
            f'above it to you (chmod g+rX, or a+rX), or choose another {where_option}'
        ) from None
    if found == manifest:
        return root
    if found is None and os.path.lexists(root) and not (os.path.isdir(root) and not os.listdir(root)):
        raise _not_ours(root, where_option)
    if found is not None:  # made by another generator version or with other settings: replaced (below)
        refuse_added_by_hand(root, f'move it away, or choose another {where_option}')  # files of yours
        print(f'{root} was generated with other settings; generating it again', flush=True)
    parent = os.path.dirname(os.path.abspath(root))
    blocker = file_in_the_way(root)
    if blocker is not None:
        raise KilnError(f'{blocker} {is_a_file(blocker)}; give a folder as {where_option}')
    staging = staging_folder(parent, '.shapes-', where_option)
    try:
        # disable=None: no bar when stderr is not a terminal (CI logs, tests)
        with tqdm(
            total=total,
            desc=f'generating {os.path.basename(os.path.abspath(root))}',
            unit='img',
            disable=None,
            leave=False,
        ) as progress:
            write(staging, progress)
        with open(os.path.join(staging, 'manifest.json'), 'w') as f:
            json.dump(manifest, f, indent=1)
        record_made(staging)
        if _read_manifest(manifest_path) == manifest:  # another process (a DDP rank) finished first: keep it
            return root
        stale = f'{root}.stale-{os.getpid()}'
        if found is not None:
            try:
                refuse_added_by_hand(root, f'move it away, or choose another {where_option}')  # (added since)
            except KilnError:  # or another process (a DDP rank) replaced it while it was read: keep that one
                if _read_manifest(manifest_path) == manifest:
                    return root
                raise
            with contextlib.suppress(FileNotFoundError):  # another process (DDP rank) may have moved it already
                os.rename(root, stale)
        try:
            os.rename(staging, root)
        except OSError:
            if _read_manifest(manifest_path) != manifest:  # not a concurrent writer that won the race
                raise _not_ours(root, where_option) from None  # (an older copy moved aside stays there)
        shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def _write_classes(folder, file_name, names):
    with open(os.path.join(folder, file_name), 'w') as f:
        f.write('\n'.join(names) + '\n')


def generate_shapes(root, train_size=6000, val_size=1200, seed=0, size=32, where_option='--data_root'):
    """Write the shapes dataset (one shape per image, with masks) into `root` unless a complete
    copy with these settings is there; see `_generate` for how copies are made safely (`where_option`:
    what named `root`, for its errors). Returns `root`."""
    manifest = {
        'version': GENERATOR_VERSION,
        'train_size': train_size,
        'val_size': val_size,
        'seed': seed,
        'size': size,
        'classes': list(CLASS_NAMES),
    }

    def write(folder, progress):
        _write_split(folder, 'train', train_size, seed, size, progress)
        _write_split(folder, 'val', val_size, seed, size, progress)
        _write_classes(folder, 'classes.txt', CLASS_NAMES)
        _write_classes(folder, 'seg_classes.txt', ('background',) + CLASS_NAMES)

    return _generate(root, manifest, write, train_size + val_size, where_option)


def generate_shape_boxes(root, train_size=4000, val_size=800, seed=0, size=64, where_option='--data_root'):
    """Write the detection variant into `root` unless a complete copy with these settings is there:
    images with 1 to 4 shapes and `train.txt`/`val.txt` lines of `image_path x1,y1,x2,y2,class ...`
    (pixels, x2/y2 exclusive; class indexes classes.txt); `where_option` as in `generate_shapes`.
    Returns `root`."""
    manifest = {
        'version': GENERATOR_VERSION,
        'task': 'detection',
        'train_size': train_size,
        'val_size': val_size,
        'seed': seed,
        'size': size,
        'classes': list(CLASS_NAMES),
    }

    def write(folder, progress):
        _write_box_split(folder, 'train', train_size, seed, size, progress)
        _write_box_split(folder, 'val', val_size, seed, size, progress)
        _write_classes(folder, 'classes.txt', CLASS_NAMES)

    return _generate(root, manifest, write, train_size + val_size, where_option)


def main(argv=None):
    """Command line: generate the shapes dataset into DEST."""
    parser = argparse.ArgumentParser(description='Generate the shapes dataset as PNG files and list files.')
    parser.add_argument('root', metavar='DEST', help='folder to create')
    parser.add_argument(
        '--detection',
        action='store_true',
        help='the detection variant: several shapes per image, with boxes in the list files',
    )
    parser.add_argument('--train_size', type=int, help='default 6000 (4000 with --detection)')
    parser.add_argument('--val_size', type=int, help='default 1200 (800 with --detection)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--size', type=int, help='image side in pixels, default 32 (64 with --detection)')
    parser.add_argument('--debug', action='store_true', help='show full tracebacks on errors')
    args = parser.parse_args(argv)
    generate = generate_shape_boxes if args.detection else generate_shapes
    options = {
        name: value for name in ('train_size', 'val_size', 'size') if (value := getattr(args, name)) is not None
    }  # the rest: the generator's defaults
    generate(args.root, seed=args.seed, where_option='DEST', **options)
    print(f'shapes dataset in {args.root}: train.txt, val.txt, classes.txt')


if __name__ == '__main__':
    run_cli(main)
