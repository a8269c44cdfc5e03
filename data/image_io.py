"""Image decoding that is right for every mode Pillow opens, and a fast check of image files.

Pillow's own `convert('RGB')` clips 16-bit and 32-bit pixels at 255, which turns 16-bit PNGs
and TIFFs white; `to_rgb` scales them instead, composites transparency over white, and refuses
pixel values it cannot map to 0..255 rather than guessing.
"""

import io
import math
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from utils.errors import KilnError

try:
    import simplejpeg  # libjpeg-turbo with DCT-domain scaling: see README "Dependencies"
except ImportError:  # then Pillow decodes JPEGs too, at about half the speed
    simplejpeg = None

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


IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg', '.bmp', '.gif', '.tif', '.tiff', '.webp')  # what folders are searched for
CROP_PCT = 0.875  # --resize crop: the centred square is this share of the shorter side (ImageNet's 224 of 256)
ORIENTATION = 0x0112  # the EXIF tag
TRANSPOSES = {  # EXIF orientation -> the transpose that shows the image upright (as ImageOps.exif_transpose)
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def image_box(width, height, resize='squash', crop_pct=CROP_PCT):
    """The part (x0, y0, x1, y1) of a width x height image that becomes the square picture: all of it
    ('squash', the aspect ratio lost) or a centred square of `crop_pct` of the shorter side ('crop',
    the aspect ratio kept; ImageNet's resize to 256 then centre crop of 224)."""
    if resize == 'squash':
        return (0.0, 0.0, float(width), float(height))
    side = min(width, height) * crop_pct
    return ((width - side) / 2, (height - side) / 2, (width + side) / 2, (height + side) / 2)


def _jpeg_pixels(data, box, size, width, height, transposed):
    """A JPEG's pixels decoded by libjpeg-turbo (simplejpeg), at the smallest of its DCT scales (1/8 to
    8/8) that keeps `box` at least `size` pixels wide and high: decoding a quarter of the pixels takes
    about a quarter of the time. Returns (RGB array as stored, its scale)."""
    needed = (math.ceil(width * size / (box[2] - box[0])), math.ceil(height * size / (box[3] - box[1])))
    min_width, min_height = needed[::-1] if transposed else needed
    pixels = simplejpeg.decode_jpeg(data, colorspace='RGB', min_width=min_width, min_height=min_height)
    return pixels, pixels.shape[0 if transposed else 1] / width


def decode_image(path, size, where='', *, resize='squash', crop=None, crop_pct=CROP_PCT, with_box=False):
    """Decode an image file into a uint8 RGB tensor (3, size, size).

    The part of the image that becomes the square is `image_box(resize, crop_pct)`, or with `crop` (a
    training `data.augment.RandomResizedCrop`) a random box drawn from torch's default generator (which
    data/sampler.SeededDataset seeds per sample). With `with_box`, also returns that box (x0, y0, x1, y1)
    in the upright image's pixels, to move boxes and masks alike.

    EXIF orientation is applied, multi-frame files (GIF, TIFF) give their first frame, every mode is
    converted by `to_rgb` (alpha over white, 16-bit scaled, not clipped), and the box is resized with
    Pillow's antialiased bilinear filter. Colour and gray JPEGs are decoded by libjpeg-turbo at a
    reduced DCT scale when the box allows (see _jpeg_pixels). Any failure raises a one-line KilnError
    naming the file; `where` (e.g. ' (list.txt:12)') says where it was listed.
    """
    try:
        with open(path, 'rb') as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as image:
            orientation = image.getexif().get(ORIENTATION, 1)
            transpose = TRANSPOSES.get(orientation)
            transposed = orientation in (5, 6, 7, 8)
            width, height = image.size[::-1] if transposed else image.size  # as shown upright
            if crop is not None:
                box = tuple(crop.draw_boxes(torch.tensor([width]), torch.tensor([height]))[0].tolist())
            else:
                box = image_box(width, height, resize, crop_pct)
            if image.format == 'JPEG' and image.mode in ('RGB', 'L') and simplejpeg is not None:
                pixels, scale = _jpeg_pixels(data, box, size, width, height, transposed)
                picture = Image.fromarray(pixels)
            else:
                picture, scale = to_rgb(image), 1.0
            if transpose is not None:
                picture = picture.transpose(transpose)
            scaled = tuple(value * scale for value in box)
            if picture.size != (size, size) or scaled != (0.0, 0.0, *map(float, picture.size)):
                picture = picture.resize((size, size), Image.BILINEAR, box=scaled)
            array = np.asarray(picture)
    except IMAGE_ERRORS as error:
        reason = ' '.join(str(error).split()) or type(error).__name__
        raise KilnError(f'cannot read image {path}{where}: {reason}; fix or remove it from the list') from None
    image = torch.from_numpy(array.copy()).permute(2, 0, 1)
    return (image, box) if with_box else image


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
