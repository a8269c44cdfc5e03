"""The embedded default dataset: coloured shapes drawn offline from a seed.

Each image shows one shape (the class) of random colour, size, position and rotation on a
noisy background with distracting lines and dots. The generator writes real PNG files plus
`train.txt`, `val.txt` and `classes.txt`, so the default run reads data exactly the way a
user's own list files are read. For segmentation it also writes a mask per image (0 for the
background, 1 + class on the shape's pixels), `seg_train.txt`/`seg_val.txt` of
`image_path mask_path` lines, and `seg_classes.txt`. Run `python -m data.shapes --help` to generate a copy by hand.
"""
import argparse
import contextlib
import json
import math
import os
import shutil
import tempfile

import numpy as np
from PIL import Image, ImageDraw

from utils.errors import KilnError

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
    outline = [(arm, radius), (arm, arm), (radius, arm), (radius, -arm), (arm, -arm), (arm, -radius),
               (-arm, -radius), (-arm, -arm), (-radius, -arm), (-radius, arm), (-arm, arm), (-arm, radius)]
    cos, sin = math.cos(angle), math.sin(angle)
    return [(center[0] + x * cos - y * sin, center[1] + x * sin + y * cos) for x, y in outline]


def _contrasting_colour(rng, background):
    """A random colour far enough from the background to stay visible."""
    while True:
        colour = rng.integers(0, 256, size=3)
        if np.abs(colour - background).sum() > 200:
            return tuple(int(c) for c in colour)


def draw_shape_image(label, rng, size=32):
    """One RGB image of class `label` drawn with the random generator `rng`, and its mask
    (an 'L' image: 0 background, label + 1 on the shape)."""
    big = size * SUPERSAMPLE
    background = rng.integers(0, 256, size=3)
    image = Image.new('RGB', (big, big), tuple(int(c) for c in background))
    mask = Image.new('L', (big, big), 0)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(1, 4)):  # clutter: thin lines and small dots
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            xy = [tuple(rng.uniform(0, big, size=2)) for _ in range(2)]
            draw.line(xy, fill=colour, width=SUPERSAMPLE)
        else:
            x, y = rng.uniform(0, big, size=2)
            r = rng.uniform(1, 2.5) * SUPERSAMPLE
            draw.ellipse([x - r, y - r, x + r, y + r], fill=colour)

    radius = rng.uniform(0.22, 0.42) * big
    center = rng.uniform(radius, big - radius, size=2)
    angle = rng.uniform(0, 2 * math.pi)
    colour = _contrasting_colour(rng, background)
    box = [center[0] - radius, center[1] - radius, center[0] + radius, center[1] + radius]
    name = CLASS_NAMES[label]
    for canvas, fill in ((draw, colour), (ImageDraw.Draw(mask), label + 1)):
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

    pixels = np.asarray(image.resize((size, size), Image.BILINEAR), dtype=np.int16)
    noise = rng.normal(0, 8, size=pixels.shape)
    return Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8)), mask.resize((size, size), Image.NEAREST)


def _write_split(root, split, count, seed, size):
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
    with open(os.path.join(root, f'{split}.txt'), 'w') as f:
        f.writelines(lines)
    with open(os.path.join(root, f'seg_{split}.txt'), 'w') as f:
        f.writelines(seg_lines)


def _read_manifest(path):
    """The manifest of a generated copy, or None where there is none (or it is unreadable)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def generate_shapes(root, train_size=6000, val_size=1200, seed=0, size=32):
    """Write the shapes dataset into `root` unless a complete copy with these settings is there.

    Files are written into a temporary sibling folder and renamed into place at the end, so an
    interrupted generation never leaves a half-written dataset, and concurrent processes (one
    per DDP rank) simply keep whichever copy finished first. A copy made by another generator
    version or with other settings (its manifest.json says so) is replaced; a folder without a
    manifest is never touched. Returns `root`.
    """
    manifest = {'version': GENERATOR_VERSION, 'train_size': train_size, 'val_size': val_size,
                'seed': seed, 'size': size, 'classes': list(CLASS_NAMES)}
    manifest_path = os.path.join(root, 'manifest.json')
    found = _read_manifest(manifest_path)
    if found == manifest:
        return root
    if found is not None:  # made by another generator version or with other settings: replace it
        print(f'{root} was generated with other settings; generating it again', flush=True)
        stale = f'{root}.stale-{os.getpid()}'
        with contextlib.suppress(FileNotFoundError):  # another process (DDP rank) may have moved it already
            os.rename(root, stale)
        shutil.rmtree(stale, ignore_errors=True)
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix='.shapes-', dir=parent)
    try:
        _write_split(staging, 'train', train_size, seed, size)
        _write_split(staging, 'val', val_size, seed, size)
        with open(os.path.join(staging, 'classes.txt'), 'w') as f:
            f.write('\n'.join(CLASS_NAMES) + '\n')
        with open(os.path.join(staging, 'seg_classes.txt'), 'w') as f:
            f.write('\n'.join(('background',) + CLASS_NAMES) + '\n')
        with open(os.path.join(staging, 'manifest.json'), 'w') as f:
            json.dump(manifest, f, indent=1)
        try:
            os.rename(staging, root)
        except OSError:
            if _read_manifest(manifest_path) != manifest:  # not a concurrent writer that won the race
                raise KilnError(f'{root} exists and is not a generated shapes dataset (no manifest.json); '
                                f'move it away or choose another --data_root') from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def main(argv=None):
    parser = argparse.ArgumentParser(description='Generate the shapes dataset as PNG files and list files.')
    parser.add_argument('root', help='folder to create')
    parser.add_argument('--train_size', type=int, default=6000)
    parser.add_argument('--val_size', type=int, default=1200)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--size', type=int, default=32, help='image side in pixels')
    args = parser.parse_args(argv)
    generate_shapes(args.root, args.train_size, args.val_size, args.seed, args.size)
    print(f'shapes dataset in {args.root}: train.txt, val.txt, classes.txt')


if __name__ == '__main__':
    main()
