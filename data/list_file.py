"""The one parser for the text list files that train, eval and predict read.

A line holds an image path and what goes with it: `images/001.png 3`, `img.png mask.png`, or
for detection `img.png 2,3,20,21,0 5,5,10,12,3`. Fields are separated by tabs when the line has
one, else by whitespace; "double" or 'single' quotes keep spaces in a field; `#` at the start of
a line or after whitespace (outside quotes) starts a comment; blank lines are skipped. Files
ending in .csv are read as CSV instead (see read_list_file).
"""

import codecs
import contextlib
import csv
import functools
import gc
import os
import re

from data.image_io import image_format, special_file
from utils.errors import KilnError

# checked in this order: the UTF-32 LE mark starts with the UTF-16 LE one
BOMS = (
    (codecs.BOM_UTF32_LE, 'utf-32-le'),
    (codecs.BOM_UTF32_BE, 'utf-32-be'),
    (codecs.BOM_UTF8, 'utf-8'),
    (codecs.BOM_UTF16_LE, 'utf-16-le'),
    (codecs.BOM_UTF16_BE, 'utf-16-be'),
)
HEADER_WORDS = {'image', 'image_path', 'path', 'file', 'filename', 'file_name', 'filepath', 'file_path', 'img'}


def _decode(path, data):
    """The text of a list file: a byte-order mark picks the encoding, else UTF-8 with undecodable
    bytes kept as surrogates, so non-UTF-8 file names map back to the same bytes (os.fsencode). An image
    given as the list is one line saying so."""
    for bom, encoding in BOMS:
        if data.startswith(bom):
            try:
                return data[len(bom) :].decode(encoding, 'surrogateescape' if encoding == 'utf-8' else 'strict')
            except UnicodeDecodeError as error:
                raise KilnError(
                    f'list file {path} is not valid {encoding.upper()} ({error.reason} at byte '
                    f'{error.start + len(bom)}); save it as UTF-8'
                ) from None
    if b'\0' in data:
        if kind := image_format(path):
            raise KilnError(f'{path} is an image ({kind}), not a list file: give a list file or a folder')
        if data.startswith(b'PK\x03\x04'):
            raise KilnError(
                f'{path} is a zip archive (as a checkpoint is), not a list file: give a list file or a folder'
            )
        if _wide_text(data[:4096]):
            raise KilnError(
                f'list file {path} looks like UTF-16 or UTF-32 text without a byte-order mark; save it as UTF-8'
            )
        raise KilnError(f'{path} is a binary file, not a list file: give a list file or a folder')
    return data.decode('utf-8', 'surrogateescape')


def _wide_text(head):
    """Whether `head` (a file's first bytes, with zero bytes) reads as text in UTF-16 or UTF-32: lines of
    printable characters, not numbers or a format's bytes."""
    for encoding, width in (('utf-16-le', 2), ('utf-16-be', 2), ('utf-32-le', 4), ('utf-32-be', 4)):
        text = head[: len(head) // width * width].decode(encoding, 'ignore')
        if len(text) >= 4 and sum(c.isprintable() or c in '\t\r\n' for c in text) >= 0.95 * len(head) / width:
            return True
    return False


# a field of a line without quotes or comments: a run of non-space characters, or with tabs, what lies
# between two tabs less the spaces around it
PLAIN_FIELD = {False: re.compile(r'\S+'), True: re.compile(r'[^\t\s](?:[^\t]*[^\t\s])?')}


COMMENT = re.compile(r'(?<!\S)#')  # a comment starts a line or follows whitespace


def _split(line, tabs):
    """(fields, spans, quoted) of one line, its comment cut off; `spans` are the fields' (start, end)
    in the line. Fields end at tabs when `tabs`, else at any whitespace. ValueError on a bad quote."""
    if '"' not in line and "'" not in line and '#' not in line:  # most lines: a regular expression is 5x faster
        matches = list(PLAIN_FIELD[tabs].finditer(line))
        return [match.group() for match in matches], [match.span() for match in matches], False
    fields, spans, quoted, i, n = [], [], False, 0, len(line)
    while True:
        while i < n and line[i].isspace():
            i += 1
        if i == n or line[i] == '#':  # at a line's start or after whitespace: a comment
            return fields, spans, quoted
        if line[i] in '"\'':
            end = line.find(line[i], i + 1)
            if end < 0:
                raise ValueError(f'the quote at column {i + 1} is never closed')
            if end + 1 < n and not line[end + 1].isspace():
                raise ValueError(f'text follows the closing quote at column {end + 1}')
            fields.append(line[i + 1 : end])
            spans.append((i, end + 1))
            quoted, i = True, end + 1
            continue
        end = i
        while end < n and not (line[end] == '\t' if tabs else line[end].isspace()):
            if line[end] == '#' and line[end - 1].isspace():
                break
            end += 1
        field = line[i:end].rstrip()
        fields.append(field)
        spans.append((i, i + len(field)))
        i = end


def _csv_rows(lines):
    """(line_number, fields) of a CSV list file: comma or semicolon delimiter (sniffed from the
    first lines), fields stripped, trailing empty fields dropped, blank and `#` lines skipped,
    and a first row that starts with a header word (image, path, filename, ...) skipped."""
    content = [
        (number, line)
        for number, line in enumerate(lines, start=1)
        if line.strip() and not line.lstrip().startswith('#')
    ]
    try:  # only the delimiter is taken from the sniffer: its guessed quote character can be wrong
        delimiter = csv.Sniffer().sniff('\n'.join(line for _, line in content[:20]), delimiters=',;').delimiter
    except csv.Error:  # a single column, or nothing to go on
        delimiter = ','
    rows = []
    for index, (number, line) in enumerate(content):
        fields = [field.strip() for field in next(csv.reader([line], delimiter=delimiter))]
        while fields and not fields[-1]:
            fields.pop()
        if fields and not (index == 0 and fields[0].lower() in HEADER_WORDS):
            rows.append((number, fields))
    return rows


@contextlib.contextmanager
def collections_paused():
    """Python's cyclic garbage collector off for a while: reading a list of a million images makes
    millions of small lists and tuples, and the collections they set off (which free nothing) took
    half the time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _entries(path, columns=None):
    """(line_number, fields, text) of each entry of a list file; `text` is the line from its first field
    to its last, comment and surrounding quotes cut off (None for CSV files). See read_list_file."""
    if not os.path.isfile(path):
        problem = not_open_to_you(path) or 'does not exist; check --train_list / --val_list / --input'
        raise KilnError(f'{_missing_kind(path)} {path} {problem}')
    lines = read_lines(path)
    if path.lower().endswith('.csv'):
        entries = [(number, fields, None) for number, fields in _csv_rows(lines)]
    else:
        entries = []
        for number, line in enumerate(lines, start=1):
            tabs = '\t' in COMMENT.split(line, maxsplit=1)[0].strip()  # between fields: not one a spreadsheet left last
            try:
                fields, spans, quoted = _split(line, tabs)
            except ValueError as error:
                raise KilnError(f'{path}:{number}: {error}: {line.strip()!r}') from None
            if columns and not quoted and not tabs and len(fields) > columns:
                extra = len(fields) - columns
                fields = [line[spans[0][0] : spans[extra][1]]] + fields[extra + 1 :]
            if fields:
                entries.append((number, fields, None if quoted else line[spans[0][0] : spans[-1][1]]))
    if columns:
        for number, fields, _ in entries:
            if len(fields) != columns:
                raise KilnError(
                    f'{path}:{number}: expected {columns} fields, got {len(fields)}: {lines[number - 1].strip()!r}'
                )
    if not entries:
        raise KilnError(f'list file {path} lists no images')
    return entries


def read_lines(path):
    """The lines of a text file (any line ending), decoded as list files are (see _decode)."""
    with open(path, 'rb') as f:
        return re.split(r'\r\n|\r|\n', _decode(path, f.read()))


def open_names_file(path):
    """A text file opened for writing names that came from the file system (paths, class folders): bytes
    that are no UTF-8, which reading kept as surrogates (see _decode, os.listdir), are written back as
    they were, as `ls` and `find` would print them."""
    return open(path, 'w', newline='', errors='surrogateescape')


def _missing_kind(path):
    """What a missing list path was meant to be: a folder when it ends with a slash, either when it has no
    extension, else a list file."""
    if path.endswith(('/', os.sep)):
        return 'folder'
    return 'list file' if os.path.splitext(path)[1] else 'list file or folder'


@collections_paused()
def read_list_file(path, columns=None):
    """The entries of a list file as (line_number, fields) pairs, `fields` a list of strings.

    With `columns`, each line must have that many fields, except that an unquoted,
    whitespace-separated line with more fields keeps the extra leading ones in its first field
    (`my image.png 3` -> ['my image.png', '3']: a path with spaces). .csv files are read with the
    csv module (see _csv_rows). Missing, empty and malformed files raise a KilnError.
    """
    return [(number, fields) for number, fields, _ in _entries(path, columns)]


@collections_paused()
def read_image_paths(path):
    """The image paths of a list file whose first field is an image (predict.py's --input), absolute;
    what follows it (a label, a mask, boxes) is ignored, so every list that train.py and eval.py read
    works here. A line whose whole text names an existing file is that file (a plain path with
    spaces, one per line, as `find images -name '*.png' > list.txt` writes it); an unquoted path with
    spaces before a label is the shortest start of the line that names a file; otherwise a first field
    that names no file is one line saying to quote it. A listed file that is not there (or is a folder)
    stops it in one line, with or without a label after it; unreadable.txt is for files that are there."""
    paths = []
    for number, fields, text in _entries(path):
        first = image = resolve_path(path, fields[0])
        if text and len(fields) > 1:
            whole = resolve_path(path, text)
            if os.path.isfile(whole):
                image = whole
            elif not os.path.isfile(first):
                starts = (resolve_path(path, text[: space.start()]) for space in re.finditer(r'\s+', text))
                image = next((name for name in starts if os.path.isfile(name)), None)
            if image is None:
                spaces = '; put quotes around a path with spaces ("my photos/cat 1.jpg" 3)' if len(fields) > 2 else ''
                raise KilnError(f'{path}:{number}: image {first} {not_a_file(path, first)}{spaces}')
        elif not os.path.isfile(image):  # as with a label after it: a list names files that are there
            raise KilnError(f'{path}:{number}: image {image} {not_a_file(path, image)}')
        paths.append(image)
    return paths


def not_a_file(list_path, file):
    """Why the listed `file` is no file to read: it is a folder, a named pipe, ..., or it does not exist (and
    what to check)."""
    kind = special_file(file)
    if kind is not None:
        return f'is {kind}, not a file'
    return not_open_to_you(file) or f'does not exist{missing_file_hint(list_path, file)}'


def not_open_to_you(path):
    """Why `path` cannot be reached where a folder on its way is not open to this user (os.path.isfile
    says False, as for a file that does not exist), else None."""
    try:
        os.stat(path)
    except PermissionError as error:
        return (
            f'cannot be reached ({error.strerror}: a folder on its way is not open to you); ask its owner to open '
            f'it to you (chmod g+rx, or a+rx), or copy the data to a place of yours'
        )
    except OSError:
        pass
    return None


def missing_file_hint(list_path, file):
    """What to check when the listed `file` does not exist: a broken link, the list's encoding (a name
    that is not UTF-8), else where relative paths are read from (for a list file, not a class folder)."""
    if os.path.islink(file):
        return f': it is a link to {os.readlink(file)}, which does not exist'
    try:
        file.encode('utf-8')
    except UnicodeEncodeError:  # bytes the list's decoding kept as they were
        return '; its name is not UTF-8: if the list was saved as Latin-1 or cp1252, save it as UTF-8'
    if os.path.isdir(list_path):
        return ''
    if '\\' in file and os.path.exists(file.replace('\\', '/')):  # a list written on Windows
        return '; a \\ separates folders on Windows only: write the paths with /'
    return f" (a relative path is read from the list file's folder, {_folder_of(list_path, os.getcwd())})"


def resolve_path(list_path, field):
    """The absolute path of a list file's `field`: `~` expanded, relative paths taken from the list file's folder
    (not normalized: `link/..` is the folder above the link's target)."""
    return os.path.join(_folder_of(list_path, os.getcwd()), os.path.expanduser(field) if field[:1] == '~' else field)


@functools.lru_cache(maxsize=16)  # asked once per line: a list of a million images asked a million times
def _folder_of(list_path, working_folder):
    return os.path.dirname(os.path.abspath(list_path))  # `working_folder` keys the cache: abspath reads it
