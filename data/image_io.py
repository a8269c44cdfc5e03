"""Image decoding that is right for every mode Pillow opens, and a fast check of image files.

Pillow's own `convert('RGB')` clips 16-bit and 32-bit pixels at 255, which turns 16-bit PNGs
and TIFFs white; `to_rgb` scales them instead, composites transparency over white, and refuses
pixel values it cannot map to 0..255 rather than guessing.
"""

import io
import math
import os
import stat
import struct
import warnings
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
# Pillow refuses images of more than twice MAX_IMAGE_PIXELS (a guard against files made to exhaust memory)
# and warns above it, in two raw lines per worker: scans and panoramas of 90 to 270 million pixels are
# decoded here without a word (they are the user's own data), larger ones are refused in one line
Image.MAX_IMAGE_PIXELS = max(Image.MAX_IMAGE_PIXELS or 0, 1 << 27)
warnings.simplefilter('ignore', Image.DecompressionBombWarning)


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


def special_file(path):
    """What `path` is when it exists but is no regular file, in words ('a named pipe', ...), else None.
    Reading a named pipe waits for a writer forever, and a device may never end."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    kinds = {stat.S_ISDIR: 'a folder', stat.S_ISFIFO: 'a named pipe', stat.S_ISSOCK: 'a socket'}
    return None if stat.S_ISREG(mode) else next((kind for test, kind in kinds.items() if test(mode)), 'a device')


# what folders are searched for
IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg', '.jfif', '.bmp', '.gif', '.tif', '.tiff', '.webp')


def image_format(path):
    """Pillow's name of the format of the image file `path` ('JPEG', 'PNG', ...), whatever its extension, or
    None. Only a file with a NUL byte in its first 4 KiB is tried: image headers hold one, text never does, so
    no list file reads as an image (some of Pillow's formats start with plain text, as PPM's 'P3')."""
    with open(path, 'rb') as f:
        if b'\0' not in f.read(4096):
            return None
        f.seek(0)
        try:
            with Image.open(f) as image:
                return image.format
        except IMAGE_ERRORS:
            return None


def find_images(folder):
    """The image files below `folder` (any depth, symbolic links followed, each folder once), sorted;
    hidden files and folders (.DS_Store, ._photo.jpg, the thumbnails a NAS keeps in .@__thumb) left out."""
    found, seen = [], {os.path.realpath(folder)}
    for root, folders, files in os.walk(folder, followlinks=True):
        here, kept = os.path.realpath(root), []
        for name in folders:  # a link to a folder read already, or to one above, would read images twice or forever
            target = os.path.realpath(os.path.join(root, name))
            if not name.startswith('.') and target not in seen and os.path.commonpath([target, here]) != target:
                seen.add(target)
                kept.append(name)
        folders[:] = kept
        found += [
            os.path.join(root, name)
            for name in files
            if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith('.')
        ]
    return sorted(found)


CROP_PCT = 0.875  # --resize crop: the centred square is this share of the shorter side (ImageNet's 224 of 256)
ORIENTATION = 0x0112  # the EXIF tag


def _upright(pixels, orientation):
    """An (H, W, 3) tensor as stored, turned the way its EXIF `orientation` says it is shown (as
    Pillow's ImageOps.exif_transpose)."""
    if orientation in (2, 3):
        pixels = pixels.flip(1)
    if orientation in (3, 4):
        pixels = pixels.flip(0)
    if orientation in (5, 6, 7, 8):
        pixels = pixels.transpose(0, 1)
        if orientation in (6, 7):
            pixels = pixels.flip(1)
        if orientation in (7, 8):
            pixels = pixels.flip(0)
    return pixels


def image_box(width, height, resize='squash', crop_pct=CROP_PCT):
    """The part (x0, y0, x1, y1) of a width x height image that becomes the square picture: all of it
    ('squash', the aspect ratio lost; also None, a checkpoint of a dataset that did not say) or a centred
    square of `crop_pct` of the shorter side ('crop', the aspect ratio kept; ImageNet's resize to 256
    then centre crop of 224)."""
    if resize != 'crop':
        return (0.0, 0.0, float(width), float(height))
    side = min(width, height) * crop_pct
    return ((width - side) / 2, (height - side) / 2, (width + side) / 2, (height + side) / 2)


def training_box(crop, width, height, resize='squash'):
    """A training crop's box (x0, y0, x1, y1) in a width x height image, drawn by `crop` (a
    data.augment.RandomResizedCrop) in the frame evaluation shows: the image itself where its aspect ratio
    is kept ('crop'), else the squashed square, mapped back, so that training sees shapes as squashed as
    evaluation does (and as the in-memory datasets, which crop their squares, do)."""
    if resize == 'crop':
        return tuple(crop.draw_boxes(torch.tensor([width]), torch.tensor([height]))[0].tolist())
    side = max(width, height)
    x0, y0, x1, y1 = (crop.draw_boxes(torch.tensor([side]), torch.tensor([side]))[0] / side).tolist()
    return (x0 * width, y0 * height, x1 * width, y1 * height)


def _jpeg_divisor(box, size):
    """The smallest of libjpeg-turbo's DCT scales 1/8, 1/4 and 1/2 (as its divisor) that keeps `box` at least
    `size` pixels wide and high, else 1 (its other scales, 3/8 to 7/8, decode slower than the full size)."""
    shrink = min((box[2] - box[0]) / size, (box[3] - box[1]) / size)
    return next((d for d in (8, 4, 2) if d <= shrink), 1)


def _jpeg_pixels(data, divisor, width, height, transposed):
    """A JPEG's pixels decoded by libjpeg-turbo (simplejpeg) at 1/`divisor` of its size: the RGB array
    (H, W, 3), as stored (not turned upright)."""
    min_width, min_height = math.ceil(width / divisor), math.ceil(height / divisor)
    if transposed:
        min_width, min_height = min_height, min_width
    return simplejpeg.decode_jpeg(data, colorspace='RGB', min_width=min_width, min_height=min_height)


# the upright axes (x, y) that run against the stored ones, by EXIF orientation (as Pillow's exif_transpose)
FLIPPED = {2: (True, False), 3: (True, True), 4: (False, True), 6: (True, False), 7: (True, True), 8: (False, True)}


def _pixel_box(box, divisor, width, height, orientation):
    """`box` moved to the nearest edges of whole decoded pixels: (the box, in the upright image's pixels, and
    the same in decoded pixels). A pixel decoded at 1/`divisor` covers `divisor` stored pixels from the
    stored image's first row and column, so where the upright image runs the other way and a side is no
    multiple of `divisor`, its first pixel covers fewer: the grid starts that much before 0."""
    upright, decoded = [], []
    for axis, limit in enumerate((width, height)):
        count = math.ceil(limit / divisor)
        shift = count * divisor - limit if FLIPPED.get(orientation, (False, False))[axis] else 0
        start, end = (min(count, max(0, round((box[side] + shift) / divisor))) for side in (axis, axis + 2))
        end = max(end, min(start + 1, count))
        start = min(start, end - 1)
        decoded += [start, end]
        upright += [max(0, start * divisor - shift), min(limit, end * divisor - shift)]
    return tuple(float(upright[i]) for i in (0, 2, 1, 3)), [decoded[i] for i in (0, 2, 1, 3)]


def decode_image(path, size, where='', *, resize='squash', crop=None, crop_pct=CROP_PCT, with_box=False):
    """Decode an image file into a uint8 RGB tensor (3, size, size).

    The part of the image that becomes the square is `image_box(resize, crop_pct)`, or with `crop` (a
    training `data.augment.RandomResizedCrop`) a random box drawn from torch's default generator (which
    data/sampler.SeededDataset seeds per sample). With `with_box`, also returns that box (x0, y0, x1, y1)
    in the upright image's pixels, to move boxes and masks alike, and the upright image's (width, height).

    EXIF orientation is applied, multi-frame files (GIF, TIFF) give their first frame, every mode is
    converted by `to_rgb` (alpha over white, 16-bit scaled, not clipped), and the box is resized with
    torch's antialiased bilinear filter on uint8 (several times faster than Pillow's). Colour and gray
    JPEGs are decoded by libjpeg-turbo at a reduced DCT scale when the box allows (see _jpeg_pixels).
    Any failure raises a one-line KilnError naming the file; `where` (e.g. ' (list.txt:12)') says
    where it was listed.
    """
    kind = special_file(path)
    if kind is not None:
        raise KilnError(f'cannot read image {path}{where}: it is {kind}, not a file; remove it')
    try:
        with open(path, 'rb') as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as image:
            fast_jpeg = image.format == 'JPEG' and image.mode in ('RGB', 'L') and simplejpeg is not None
            pixels = None if fast_jpeg else torch.from_numpy(np.array(to_rgb(image)))
            # read after the pixels: Pillow turns some formats (TIFF) upright as it loads them, and drops the tag
            orientation = exif_orientation(image)
            transposed = orientation in (5, 6, 7, 8)
            stored = image.size if pixels is None else (pixels.shape[1], pixels.shape[0])
            width, height = stored[::-1] if transposed else stored  # as shown upright
            box = (
                image_box(width, height, resize, crop_pct)
                if crop is None
                else training_box(crop, width, height, resize)
            )
            divisor = 1
            if pixels is None:
                divisor = _jpeg_divisor(box, size)
                pixels = torch.from_numpy(_jpeg_pixels(data, divisor, width, height, transposed))
    except IMAGE_ERRORS as error:
        raise KilnError(
            f'cannot read image {path}{where}: {unreadable_reason(error, path)}; fix or remove it'
        ) from None
    pixels = _upright(pixels, orientation)
    # the box on whole decoded pixels: what is cut is what the box (which moves boxes and masks) says
    box, (x0, y0, x1, y1) = _pixel_box(box, divisor, width, height, orientation)
    picture = pixels[y0:y1, x0:x1].permute(2, 0, 1)
    if picture.shape[1:] != (size, size):
        picture = torch.nn.functional.interpolate(
            picture[None].contiguous(memory_format=torch.channels_last), (size, size), mode='bilinear', antialias=True
        )[0]
    picture = picture.contiguous()
    return (picture, box, (width, height)) if with_box else picture


def exif_orientation(image):
    """The EXIF orientation of a Pillow `image` (1, upright, when it has none or its EXIF is malformed: the
    pixels are fine, as Pillow itself reads a JPEG's with such EXIF)."""
    try:
        orientation = image.getexif().get(ORIENTATION, 1)
    except IMAGE_ERRORS:
        return 1
    return orientation if orientation in range(1, 9) else 1


def check_image(path):
    """None when the file's header and structure look valid, else a short reason.

    Fast (no pixel decoding): Pillow's `verify()`, which checks PNG chunk checksums but for most
    other formats (JPEG among them) only the header, so some damage only shows when decoding.
    """
    try:
        with Image.open(path) as image:
            image.verify()
    except IMAGE_ERRORS as error:
        return unreadable_reason(error, path)
    return None


def unreadable_reason(error, path):
    """What went wrong reading the image file `path`, in one line."""
    if isinstance(error, Image.UnidentifiedImageError) and os.path.getsize(path) == 0:
        return 'the file is empty (0 bytes)'
    if isinstance(error, Image.UnidentifiedImageError):  # Pillow's text names the buffer it read, not the file
        return f'not an image in a format Pillow reads ({", ".join(IMAGE_EXTENSIONS)})'
    if isinstance(error, Image.DecompressionBombError):
        return (
            f'more than {2 * Image.MAX_IMAGE_PIXELS:,} pixels, too many to decode safely; cut it into tiles or '
            f'shrink it'
        )
    return ' '.join(str(error).split()) or type(error).__name__


def check_images(paths, workers=4):
    """(index, path, reason) for each of `paths` that `check_image` finds bad, in order."""
    paths = list(paths)
    # a future per 512 images, not per image (1.8 kB each: 1.8 GB for a million)
    chunks = [paths[start : start + 512] for start in range(0, len(paths), 512)]
    with ThreadPoolExecutor(workers) as pool:
        checked = pool.map(lambda chunk: [check_image(path) for path in chunk], chunks)
        reasons = [reason for chunk in checked for reason in chunk]
    return [(index, path, reason) for index, (path, reason) in enumerate(zip(paths, reasons)) if reason]
