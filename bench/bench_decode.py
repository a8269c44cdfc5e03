"""How fast does Kiln turn photos into training pictures, per CPU core?
`python bench/bench_decode.py [--size 224] [--rounds 5] [--device cuda]`

Decodes the same JPEGs (real photos cut from scikit-image's, 400 to 600 pixels a side, made by
data/photo_set.py) into size x size uint8 pictures, one core, in alternating rounds, with:
- Kiln: data/image_io.decode_image (libjpeg-turbo through simplejpeg, at a reduced DCT scale);
- Kiln before: the decoder Kiln had before (Pillow decodes, turns, converts and resizes);
- Kiln on Pillow: today's function with simplejpeg switched off (its fallback);
- Pillow: open, convert, resize; and Pillow with draft (its own reduced DCT scale);
- torchvision: torchvision.io.decode_jpeg and an antialiased resize;
- on --device (nvJPEG on a GPU): the files' bytes read on one core, decoded by torchvision's
  decode_jpeg in batches of --batch on the device and resized there (what decoding on the GPU
  instead of in DataLoader workers would do; on the CPU, the same batched call on one core).
Prints the images/s of each (median of the rounds) and its ratio to Kiln's before.
"""

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import data.image_io as image_io
from data.photo_set import make_photo_set


def pillow(path, size, draft=False):
    """The plain way: Pillow decodes the whole image (or a reduced one with `draft`) and resizes it."""
    with Image.open(path) as image:
        if draft:
            image.draft('RGB', (size, size))
        return torch.from_numpy(np.array(image.convert('RGB').resize((size, size), Image.BILINEAR)))


def kiln_before(path, size):
    """Kiln's decoder before it used libjpeg-turbo directly (commit b2d456f's data/image_io.decode_image):
    Pillow decodes the whole image, turns it upright, converts it and resizes it."""
    with Image.open(path) as image:
        rgb = image_io.to_rgb(ImageOps.exif_transpose(image))
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.BILINEAR)
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1)


def torchvision_decode(path, size):
    """torchvision's libjpeg-turbo decoder and an antialiased bilinear resize."""
    from torchvision.io import decode_jpeg, read_file

    image = decode_jpeg(read_file(path))[None].float()
    return F.interpolate(image, (size, size), mode='bilinear', antialias=True)[0].round().byte()


def decode_on_device(paths, size, device, batch):
    """Read the files, decode them with torchvision's decode_jpeg on `device` in batches of `batch`
    and resize each there (antialiased bilinear) into a (batch, 3, size, size) uint8 tensor."""
    from torchvision.io import decode_jpeg, read_file

    for start in range(0, len(paths), batch):
        images = decode_jpeg([read_file(path) for path in paths[start : start + batch]], device=device)
        resized = [
            F.interpolate(image[None].float(), (size, size), mode='bilinear', antialias=True) for image in images
        ]
        torch.cat(resized).round().byte()
    if device.type == 'cuda':
        torch.cuda.synchronize()


def kiln_on_pillow(path, size, resize):
    """decode_image with simplejpeg switched off."""
    saved, image_io.simplejpeg = image_io.simplejpeg, None
    try:
        return image_io.decode_image(path, size, resize=resize)
    finally:
        image_io.simplejpeg = saved


def main():
    """Time each decoder over the photos and print images/s per core."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--size', type=int, default=224)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--per_class', type=int, default=30, help='photos per class (6 classes)')
    parser.add_argument('--device', default='cpu', help='where decode_jpeg decodes batches (cuda: nvJPEG)')
    parser.add_argument('--batch', type=int, default=64, help='files per decode_jpeg call on --device')
    options = parser.parse_args()
    device = torch.device(options.device)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        root = make_photo_set(os.path.join(scratch, 'photos'), options.per_class, 0, sizes=(400, 600))
        paths = sorted(path for path in glob.glob(os.path.join(root, 'train', '*', '*.jpg')))
        size = options.size
        decoders = {
            'Kiln (squash)': lambda path: image_io.decode_image(path, size),
            'Kiln (crop)': lambda path: image_io.decode_image(path, size, resize='crop'),
            'Kiln before (Pillow)': lambda path: kiln_before(path, size),
            'Kiln on Pillow (squash)': lambda path: kiln_on_pillow(path, size, 'squash'),
            'Kiln on Pillow (crop)': lambda path: kiln_on_pillow(path, size, 'crop'),
            'Pillow': lambda path: pillow(path, size),
            'Pillow with draft': lambda path: pillow(path, size, draft=True),
            'torchvision decode_jpeg': lambda path: torchvision_decode(path, size),
        }
        whole_list = {f'decode_jpeg on {device}, batches of {options.batch}': None}  # timed over every path at once
        decode_on_device(paths[: options.batch], size, device, options.batch)  # warm-up: nvJPEG's start, kernels
        speeds = {name: [] for name in [*decoders, *whole_list]}
        for round_number in range(options.rounds):
            order = list(speeds) if round_number % 2 == 0 else list(reversed(speeds))
            for name in order:
                start = time.perf_counter()
                if name in whole_list:
                    decode_on_device(paths, size, device, options.batch)
                else:
                    for path in paths:
                        decoders[name](path)
                speeds[name].append(len(paths) / (time.perf_counter() - start))
    print(
        f'{len(paths)} JPEGs of 400 to 600 pixels a side to {size}x{size}, one core '
        f'(torch {torch.__version__}, {os.cpu_count()} CPUs), median of {options.rounds} alternating rounds:'
    )
    base = statistics.median(speeds['Kiln before (Pillow)'])
    for name, values in speeds.items():
        print(f'  {name:32s} {statistics.median(values):6.0f} images/s  {statistics.median(values) / base:.2f}x')


if __name__ == '__main__':
    main()
