"""Image decoding that is right for every mode Pillow opens, and a fast check of image files.

Pillow's own `convert('RGB')` clips 16-bit and 32-bit pixels at 255, which turns 16-bit PNGs
and TIFFs white; `to_rgb` scales them instead, composites transparency over white, and refuses
pixel values it cannot map to 0..255 rather than guessing.
"""

import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image, ImageOps

from utils.errors import KilnError

# what Pillow raises for unreadable, truncated, corrupt or unsupported files (SyntaxError and
# struct.error come out of some corrupt-file parsers)
IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)
ALPHA_MODES = ('LA', 'La', 'PA', 'RGBA', 'RGBa')


def _gray(values):
    """An RGB image from a 2-D array of gray values already in 0..255."""
    return Image.fromarray(np.rint(values).astype(np.uint8)).convert('RGB')


def to_rgb(image):
    """Convert a Pillow image of any mode to 'RGB' the way a person would see it.

    - alpha ('LA', 'PA', 'RGBA', 'RGBa', or a palette/gray/RGB image with a transparency entry)
      is composited over a white background;
    - 16-bit gray ('I;16', 'I;16B', 'I;16L', 'I;16N', and 'I' with values in 0..65535, which is
      how Pillow opens 16-bit PNGs) is scaled to 8 bits: value / 257, rounded;
    - 'I' with values outside 0..65535 is refused (ValueError);
    - 'F' in 0..1 is scaled by 255, in 0..255 taken as is (rounded); any other range, NaN or
      infinity is refused (ValueError);
    - every other mode ('1', 'L', 'P', 'CMYK', 'YCbCr', 'LAB', 'HSV', ...) uses Pillow's conversion.
    """
    mode = image.mode
    if mode.startswith('I;16'):
        return _gray(np.asarray(image).astype(np.float64) / 257)
    if mode == 'I':
        values = np.asarray(image)
        low, high = int(values.min()), int(values.max())
        if low < 0 or high > 65535:
            raise ValueError(
                f'32-bit integer pixels from {low} to {high} do not fit 16 bits; save it as an 8- or 16-bit image'
            )
        return _gray(values / 257)
    if mode == 'F':
        values = np.asarray(image).astype(np.float64)
        if not np.isfinite(values).all():
            raise ValueError('floating-point pixels include NaN or infinity')
        low, high = float(values.min()), float(values.max())
        if low >= 0 and high <= 1:
            return _gray(values * 255)
        if low >= 0 and high <= 255:
            return _gray(values)
        raise ValueError(
            f'floating-point pixels from {low:g} to {high:g} are in neither 0..1 nor 0..255; '
            'save it as an 8- or 16-bit image'
        )
    if mode in ALPHA_MODES or 'transparency' in image.info:
        rgba = image.convert('RGBA')
        white = Image.new('RGBA', rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert('RGB')
    return image.convert('RGB')


def decode_image(path, size, where='', with_size=False):
    """Decode an image file into a uint8 RGB tensor (3, size, size); with `with_size`, also the
    (width, height) it had as displayed (EXIF orientation applied), to scale boxes with it.

    EXIF orientation is applied, multi-frame files (GIF, TIFF) give their first frame, every mode
    is converted by `to_rgb` (alpha over white, 16-bit scaled, not clipped), and the result is
    resized with bilinear filtering. Any failure raises a one-line KilnError naming the file;
    `where` (e.g. ' (list.txt:12)') says where it was listed.
    """
    try:
        with Image.open(path) as image:
            rgb = to_rgb(ImageOps.exif_transpose(image))
        original = rgb.size
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.BILINEAR)
        array = np.asarray(rgb)
    except IMAGE_ERRORS as error:
        reason = ' '.join(str(error).split()) or type(error).__name__
        raise KilnError(f'cannot read image {path}{where}: {reason}; fix or remove it from the list') from None
    image = torch.from_numpy(array.copy()).permute(2, 0, 1)
    return (image, original) if with_size else image


def check_image(path):
    """None when the file's header and structure look valid, else a short reason.

    Fast (no pixel decoding): Pillow's `verify()`, which checks PNG chunk checksums but for most
    other formats (JPEG among them) only the header, so some damage only shows when decoding.
    """
    try:
        with Image.open(path) as image:
            image.verify()
    except IMAGE_ERRORS as error:
        return ' '.join(str(error).split()) or type(error).__name__
    return None


def check_images(paths, workers=4):
    """(index, path, reason) for each of `paths` that `check_image` finds bad, in order."""
    paths = list(paths)
    with ThreadPoolExecutor(workers) as pool:
        reasons = list(pool.map(check_image, paths))
    return [(index, path, reason) for index, (path, reason) in enumerate(zip(paths, reasons)) if reason]
