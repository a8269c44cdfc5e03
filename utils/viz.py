"""Pictures for TensorBoard and evaluation results: labelled image grids and confusion matrices.

Everything returns an HxWx3 uint8 numpy array (save it with `save_png`).
"""

import contextlib
import functools
import struct
import zlib

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

GOOD = (40, 170, 60)
BAD = (210, 40, 40)


# Fonts for text that Pillow's own font lacks glyphs for (it has ASCII only: class names such as "élan" or
# "猫" came out as boxes), by file name in the system's font folders: wide Latin, Greek and Cyrillic
# first, then Chinese, Japanese and Korean; Linux, Windows and macOS names.
FONTS = (
    'DejaVuSans.ttf',
    'NotoSans-Regular.ttf',
    'arial.ttf',
    'Arial Unicode.ttf',
    'NotoSansCJK-Regular.ttc',
    'wqy-microhei.ttc',
    'msyh.ttc',
    'PingFang.ttc',
)


@functools.cache  # loading a font takes longer than drawing a grid with it
def _default_font(size):
    return ImageFont.load_default(size=size)


@functools.cache  # looked for only when a text needs them
def _system_fonts(size):
    found = []
    for name in FONTS:
        with contextlib.suppress(OSError):
            found.append(ImageFont.truetype(name, size))
    return found


def _has_glyphs(font, text):
    """Whether `font` draws every character of `text` (a missing one is drawn as the font's box, the
    glyph of a code point no font has)."""
    missing = bytes(font.getmask('\U000ffffd'))
    return all(character.isspace() or bytes(font.getmask(character)) != missing for character in set(text))


@functools.lru_cache(maxsize=4096)
def font_for(text, size=11):
    """The first font that has every character of `text`: Pillow's own, else one of FONTS (Pillow's own
    when none has them all)."""
    default = _default_font(size)
    if text.isascii():
        return default
    return next((font for font in [default, *_system_fonts(size)] if _has_glyphs(font, text)), default)


def tiles(images, tile):
    """Float images (N, 3, H, W) in [0, 1], a tensor or an array, as uint8 tiles (N, T, T, 3) of side
    about `tile`: small images enlarged by a whole factor (pixels stay sharp), larger ones shrunk by
    averaging. In numpy, on one thread: pictures are drawn on the writer thread beside the training
    step, whose torch ops would wait for a second team of torch threads on the same cores."""
    pixels = np.clip(images.detach().cpu().float().numpy() if torch.is_tensor(images) else images, 0, 1)
    side = pixels.shape[-1]
    if side > tile:
        pixels = area_resize(pixels, tile)
    pixels = np.rint(pixels * 255).astype(np.uint8).transpose(0, 2, 3, 1)
    factor = tile // side
    if factor > 1:  # enlarged as bytes after rounding: a ninth of the work of enlarging the floats
        pixels = pixels.repeat(factor, axis=1).repeat(factor, axis=2)
    return pixels


def area_resize(images, size):
    """Images (N, C, H, W) shrunk to (N, C, size, size): each new pixel the mean of the old pixels its
    area covers, as torch's interpolate(mode='area') computes it (window [floor(i*H/size), ceil((i+1)*H/size)))."""
    for axis in (2, 3):
        length = images.shape[axis]
        starts = np.arange(size) * length // size
        ends = -(-np.arange(1, size + 1) * length // size)
        sums = np.cumsum(images, axis=axis, dtype=np.float64)
        sums = np.concatenate([np.zeros_like(sums.take([0], axis)), sums], axis)
        widths = (ends - starts).reshape([-1 if dim == axis else 1 for dim in range(4)])
        images = (sums.take(ends, axis) - sums.take(starts, axis)) / widths
    return images.astype(np.float32)


def labeled_grid(images, predicted, true, class_names=None, columns=8, tile=96):
    """Grid of images under a line saying how to read it, each captioned 'predicted / true' in green when
    right, red when wrong: on one line where every caption fits the tile, else the two names on two lines
    (a name too long for one ends in '…'). Tiles are at least `tile` wide, smaller images centred in them.

    `images` is a float tensor (N, 3, H, W) in [0, 1]; `predicted` and `true` are label lists.
    """
    name = (lambda i: class_names[i]) if class_names else str
    pixels = tiles(images, tile)
    count, size = len(pixels), pixels.shape[1]
    side, margin = max(size, tile), (max(size, tile) - size) // 2
    texts = [f'{name(p)} / {name(t)}' for p, t in zip(predicted, true)]
    if any(text_width(text) > side - 4 for text in texts):
        texts = [f'{name(p)} /\n{name(t)}' for p, t in zip(predicted, true)]
    height = CAPTION * (1 + texts[0].count('\n')) if texts else CAPTION
    columns = min(columns, count)
    rows = (count + columns - 1) // columns
    grid = np.full((rows * (side + height), columns * side, 3), 255, np.uint8)
    for i in range(count):
        x, y = (i % columns) * side, (i // columns) * (side + height)
        grid[y + margin : y + margin + size, x + margin : x + margin + size] = pixels[i]
        colour = GOOD if predicted[i] == true[i] else BAD
        grid[y + side : y + side + height, x : x + side] = caption(texts[i], colour, side)
    return np.concatenate([caption('predicted / true', (0, 0, 0), grid.shape[1]), grid])


CAPTION = 16  # pixels of caption under a tile, per line


@functools.lru_cache(maxsize=4096)  # a run's captions repeat
def text_width(text):
    """Pixels that `text` (one line) takes in its caption font."""
    return font_for(text).getlength(text)


def fitted(text, width):
    """`text`, cut short to end in '…' where it takes more than `width` pixels."""
    while text_width(text) > width and len(text) > 1:
        text = text[:-2] + '…'
    return text


@functools.lru_cache(maxsize=4096)  # a run's captions repeat: drawing text is the slow part of a grid
def caption(text, colour, width):
    """`text` in `colour` on white, as a (CAPTION x lines, width, 3) uint8 array; a line too long for
    `width` is cut short, ending in '…'."""
    lines = [fitted(line, width - 4) for line in text.split('\n')]
    image = Image.new('RGB', (width, CAPTION * len(lines)), 'white')
    draw = ImageDraw.Draw(image)
    for index, line in enumerate(lines):
        draw.text((2, 1 + CAPTION * index), line, fill=colour, font=font_for(line))
    return np.asarray(image)


# colours told apart at a glance (Tableau's ten), for the classes of masks and boxes
DISTINCT = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
)  # fmt: skip


def mask_colours(num_classes):
    """A fixed colour per class: black for class 0 (background), DISTINCT for the next ten, then random."""
    rng = np.random.default_rng(7)
    colours = rng.integers(60, 256, size=(max(num_classes, 1), 3)).astype(np.uint8)
    distinct = min(len(DISTINCT), len(colours) - 1)
    colours[1 : 1 + distinct] = np.array(DISTINCT[:distinct], np.uint8).reshape(-1, 3)
    colours[0] = 0
    return colours


VOID_COLOUR = (224, 224, 192)  # a mask value that is no class: Pascal VOC's colour for its void


def segmentation_grid(images, predicted, true, num_classes, tile=96, class_names=None):
    """Rows of image | predicted mask | true mask under a header naming the columns, over a key of each
    class's colour (HxWx3 uint8); `images` in [0, 1], masks (N, H, W)."""
    # a value that is no class (--ignore_index: the void) in Pascal VOC's colour for it, named in the key
    colours = np.concatenate([mask_colours(num_classes), np.array([VOID_COLOUR], np.uint8)])
    shares = colours.astype(np.float32) / 255  # numpy: see `tiles`
    predicted, true = (m.cpu().numpy().clip(0, num_classes) for m in (predicted, true))
    masks = [shares[m].transpose(0, 3, 1, 2) for m in (predicted, true)]
    pixels = [tiles(picture, tile) for picture in (images, *masks)]  # (N, T, T, 3) each
    side = pixels[0].shape[2]
    header = np.concatenate([caption(name, (0, 0, 0), side) for name in ('image', 'predicted', 'true')], axis=1)
    rows = [np.concatenate(row, axis=1) for row in zip(*pixels)]
    names = [str(name) for name in (class_names or range(num_classes))] + ['void'] * bool((true == num_classes).any())
    return np.concatenate([header, *rows, colour_key(names, colours, 3 * side)], axis=0)


def colour_key(names, colours, width):
    """Each name beside a square of its colour, in lines of `width` pixels (HxWx3 uint8)."""
    entries = [(fitted(name, width - 20), colour) for name, colour in zip(names, colours)]
    lines, line, used = [], [], 0
    for name, colour in entries:
        size = 18 + int(text_width(name)) + 10
        if line and used + size > width:
            lines.append(line)
            line, used = [], 0
        line.append((used, name, colour))
        used += size
    lines.append(line)
    key = Image.new('RGB', (width, CAPTION * len(lines)), 'white')
    draw = ImageDraw.Draw(key)
    for row, line in enumerate(lines):
        for x, name, colour in line:
            y = row * CAPTION
            draw.rectangle((x + 2, y + 2, x + 14, y + 13), fill=tuple(int(c) for c in colour), outline='gray')
            draw.text((x + 18, y + 1), name, fill='black', font=font_for(name))
    return np.asarray(key)


def compact_count(count):
    """`count` in at most 5 characters, to fit a cell: 14497110 as '14.5M' (a segmentation's pixels)."""
    if count < 100_000:
        return str(count)
    for suffix, scale in (('k', 1e3), ('M', 1e6), ('G', 1e9)):
        text = f'{count / scale:.3g}'
        if 'e' not in text and float(text) < 1000:
            return text + suffix
    return f'{count / 1e12:.3g}T'


def _turned(text, font):
    """`text` in black on white, turned to read upwards, as an L image (a column's name)."""
    image = Image.new('L', (int(font.getlength(text)) + 4, CAPTION), 255)
    ImageDraw.Draw(image).text((2, 1), text, fill=0, font=font)
    return image.transpose(Image.Transpose.ROTATE_90)


def confusion_matrix_image(matrix, class_names=None, cell=44, longest=150, largest=2000):
    """A confusion matrix under a line saying how to read it: rows the true class, columns the predicted
    one (names written upwards), each cell shaded by its share of its row (the recall of the row's class
    on the diagonal) and showing its count (k, M above 99999). Names longer than `longest` pixels end in
    '…'. Cells shrink so that the matrix stays within `largest` pixels (1000 classes: 2 pixels each); too
    small for it, a cell shows no count, and classes no name (the counts are in result.json); with more
    classes than `largest`, a pixel shows the sum of a square of cells (a block of classes on each axis)."""
    matrix = np.asarray(matrix.cpu() if hasattr(matrix, 'cpu') else matrix)
    block = -(-len(matrix) // largest)  # classes per pixel, on each axis
    if block > 1:
        padded = np.zeros((-(-len(matrix) // block) * block,) * 2, matrix.dtype)
        padded[: len(matrix), : len(matrix)] = matrix
        matrix = padded.reshape(len(padded) // block, block, -1, block).sum(axis=(1, 3))
    count = len(matrix)
    cell = max(1, min(cell, largest // max(count, 1)))
    named, counted = cell >= 12, cell >= 36
    given = list(class_names or ())[:count]
    names = [fitted(str(name), longest) for name in given + list(range(len(given), count))] if named else []
    margin = int(max(map(text_width, names))) + 8 if names else 4
    title = 'rows: true class; columns: predicted; shade: share of the row'
    if not named:
        title += "; classes in result.json's order"
    if block > 1:
        title += f'; a pixel: {block}x{block} classes'
    top = CAPTION + margin
    width = max(margin + count * cell + 4, int(text_width(title)) + 8)
    canvas = Image.new('RGB', (width, top + count * cell + 4), 'white')
    draw = ImageDraw.Draw(canvas)
    draw.text((2, 1), title, fill='black', font=font_for(title))
    shares = matrix / matrix.sum(axis=1, keepdims=True).clip(min=1)
    shades = (255 - 200 * shares).astype(np.uint8)  # the cells as one array, not a rectangle each (a million)
    cells = np.stack([shades, shades, np.full_like(shades, 255)], -1).repeat(cell, 0).repeat(cell, 1)
    if cell >= 4:  # grey lines between the cells
        cells[cell - 1 :: cell], cells[:, cell - 1 :: cell] = 128, 128
    canvas.paste(Image.fromarray(np.ascontiguousarray(cells)), (margin, top))
    for i, name in enumerate(names):
        column = _turned(name, font_for(name))
        canvas.paste(
            (0, 0, 0),
            (margin + i * cell + (cell - column.width) // 2, top - 4 - column.height),
            column.point(lambda v: 255 - v),
        )
        draw.text((2, top + i * cell + cell // 2 - 6), name, fill='black', font=font_for(name))
    for i in range(count if counted else 0):
        for j in range(count):
            draw.text(
                (margin + j * cell + 3, top + i * cell + cell // 2 - 6),
                compact_count(int(matrix[i, j])),
                fill='black' if shares[i, j] < 0.6 else 'white',
                font=_default_font(11),
            )
    return np.asarray(canvas)


PNG_COLOUR_TYPES = {1: 0, 3: 2, 4: 6}  # channels -> PNG colour type: grey, RGB, RGBA


def png_bytes(image, level=1):
    """An HxWx3 (or HxW, HxWx4) uint8 array as PNG bytes (zlib `level`: 1 is fast, 9 small). Written here
    rather than by Pillow, whose first save imports its image plugins: 12 ms on the writer thread at a
    run's end."""
    height, width = image.shape[:2]
    channels = image.shape[2] if image.ndim == 3 else 1
    rows = np.zeros((height, 1 + width * channels), np.uint8)  # each row starts with its filter type, 0: none
    rows[:, 1:] = image.reshape(height, -1)

    def chunk(kind, data):
        return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))

    header = struct.pack('>IIBBBBB', width, height, 8, PNG_COLOUR_TYPES[channels], 0, 0, 0)  # 8 bits, no interlace
    pixels = zlib.compress(rows, level)
    return b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header) + chunk(b'IDAT', pixels) + chunk(b'IEND', b'')


def save_png(image, path):
    """Write an HxWx3 (or HxW, HxWx4) uint8 array as a PNG file."""
    with open(path, 'wb') as f:
        f.write(png_bytes(image, level=6))
