"""A dataset read from a list file of `image_path label` lines (see data/list_file.py for the format:
paths relative to the list file, comments, quotes, tabs, CSV, any common encoding), or from a folder
with a subfolder of images per class.

A `classes.txt` beside the list file (one class name per line) names the classes and fixes their
number; without it the number of classes is the largest label + 1 (see count_classes). A folder's classes are its
subfolders' names, in sorted order (saved with the run), and its images are every file below them
in a format Kiln decodes, at any depth. Validation and evaluation data are numbered as the training
classes by name (match_classes). Class names are compared in Unicode's composed form (NFC): macOS
writes file names decomposed.
"""

import contextlib
import hashlib
import numbers
import os
import re
import unicodedata
from stat import S_ISREG

import numpy as np
import torch
from torch.utils.data import Dataset

from data.image_io import CROP_PCT, IMAGE_EXTENSIONS, check_images, decode_image, find_images
from data.list_file import collections_paused, not_a_file, read_lines, read_list_file, resolve_path
from utils.checkpoint import atomic_write_bytes, remove_abandoned_temporaries
from utils.errors import KilnError, listed

# `<data_root>/.cache`: what reading the data found out (decoded images, passed header checks); hidden, so
# that a --data_root that is itself a folder of class folders does not read it as a class
CACHE_FOLDER = '.cache'


SPLIT_NAMES = ('train', 'val', 'valid', 'validation', 'test')  # folders of a data set's splits


def read_class_folders(folder):
    """(samples [(path, label, path relative to `folder`)], class names) of a folder holding a subfolder
    per class: classes in sorted order, each subfolder's images (any depth) in sorted order. A class
    folder without images is a KilnError."""
    folders = sorted(
        (unicodedata.normalize('NFC', name), name)
        for name in os.listdir(folder)
        if not name.startswith('.') and os.path.isdir(os.path.join(folder, name))
    )
    if not folders:
        raise KilnError(f'{folder} holds no class folders; put the images of each class in a folder of its own')
    splits = {name.lower(): os.path.join(folder, name) for _, name in folders}
    if 'train' in splits and set(splits) <= set(SPLIT_NAMES):  # the folder above the splits: it trained train vs val
        validation = next((f' --val_list {splits[name]}' for name in SPLIT_NAMES[1:] if name in splits), '')
        raise KilnError(
            f'{folder} holds the folders {", ".join(name for name, _ in folders)}, the splits of a data set, not '
            f'classes; give --train_list {splits["train"]}{validation} (classes named so: rename them)'
        )
    twice = first_repeated([name for name, _ in folders])  # composed and decomposed: macOS and Linux copies merged
    if twice is not None:
        raise KilnError(
            f'{folder} has two class folders named {twice!r}, spelled in different Unicode forms (composed and '
            f'decomposed); merge them into one'
        )
    samples = []
    for label, (_, name) in enumerate(folders):
        found = find_images(os.path.join(folder, name))
        if not found:
            raise KilnError(
                f'{os.path.join(folder, name)} holds no images ({", ".join(IMAGE_EXTENSIONS)}); add some or '
                f'remove the folder'
            )
        samples += [(path, label, os.path.relpath(path, folder)) for path in found]
    return samples, [name for name, _ in folders]


def classes_only_validated(train_set, val_set):
    """The class labels that `val_set` has samples of and `train_set` none (list datasets of class labels;
    else none): the model never learns them, and every such validation sample counts as wrong. Labels
    counted from 1 in one list and from 0 in the other, say."""
    if not all(
        hasattr(dataset, 'targets_are_labels') and dataset.targets_are_labels() for dataset in (train_set, val_set)
    ):
        return []
    trained = {label for _, label, _ in train_set.samples}
    return sorted({label for _, label, _ in val_set.samples} - trained)


def match_classes(dataset, class_names, source):
    """Number `dataset`'s classes as `class_names` (those of `source`: the training data or the checkpoint)
    by their names: a validation folder may lack a class, a classes.txt may order them otherwise. A class
    that `source` lacks is a KilnError, and so is any difference for a dataset that cannot renumber its
    labels (masks, boxes): labels are positions in the names, so a difference let through would mix
    classes up without a word."""
    found = getattr(dataset, 'class_names', None)
    reference = [unicodedata.normalize('NFC', name) for name in class_names or ()]
    numbered = [int(name) if name.isdecimal() else None for name in reference]
    in_order = sorted(numbered) if None not in numbered else numbered
    if not found and numbered != in_order and hasattr(dataset, 'list_path'):
        # class folders named 0, 1, 2, ..., 10 sort as text: label 2 of a list would be the folder '10'
        moved = next(label for label, number in enumerate(numbered) if number != in_order[label])
        raise KilnError(
            f'{dataset.list_path} gives classes by label number alone, but {source} has classes named by numbers '
            f'in another order ({listed(reference, 4)}): label {moved} would be the class {reference[moved]!r}; '
            f'give the list a classes.txt naming its labels in order (one name per line), or use class folders'
        )
    if not found or not reference or found == reference[: len(found)]:
        return  # the same classes (a list may number more classes than it names)
    renumber = getattr(dataset, 'renumber_classes', None)
    if renumber is not None and set(found) <= set(reference):
        renumber(reference)
        return
    named = list(reference)
    while named and named[-1] == str(len(named) - 1):  # numbered, not named (tasks/task.py)
        named.pop()
    folders = getattr(dataset, 'from_folder', False)
    if not named and folders:  # the folders' order would number them: a silent mix-up
        raise KilnError(
            f'{dataset.list_path} has class folders {listed(found)}, but {source} knows its classes by label '
            f'number alone (0 to {len(reference) - 1}); name the folders by those numbers, or give the training '
            f'list a classes.txt naming its labels in order'
        )
    if not named:
        return  # trained on label numbers alone: labels are those numbers here too
    if folders:
        extra = [name for name in found if name not in reference]
        raise KilnError(
            f'{dataset.list_path} has {len(extra)} class folder{"s" if len(extra) > 1 else ""} that {source} '
            f'does not know ({listed(extra)}); give it class folders among {listed(named)}'
        )
    raise KilnError(
        f'{dataset.list_path}: its classes.txt names the classes {listed(found)}, {source} has '
        f'{listed(named)}; labels are positions in that list, so give it the same classes.txt'
    )


def read_class_names(list_path, file_names=('classes.txt',)):
    """Class names from the first of `file_names` found beside the list file, or None: each line that is
    not blank is one name, whole (`C# code`, `#1 rated`, `"quoted"`: no quoting). A name given twice, or
    a line that reads as a comment (`# names`), is a KilnError (classes would share a name, or every label
    would be named by the next line)."""
    for name in file_names:
        path = os.path.join(os.path.dirname(os.path.abspath(list_path)), name)
        if os.path.isfile(path):
            lines = [(number, line.strip()) for number, line in enumerate(read_lines(path), 1) if line.strip()]
            comment = next(((n, line) for n, line in lines if re.fullmatch(r'#(\s.*)?', line)), None)
            if comment is not None:  # a class named so would take label 0 from the first real name, and so on
                raise KilnError(
                    f'{path}:{comment[0]}: {comment[1]!r} reads as a comment, but every line of it names a class, '
                    f'in label order; remove the line'
                )
            names = [unicodedata.normalize('NFC', line) for _, line in lines]
            if not names:
                raise KilnError(f'{path} names no class; give one class name per line, in label order')
            twice = first_repeated(names)
            if twice is not None:
                raise KilnError(f'{path} names the class {twice!r} twice; give each class its own name')
            return names
    return None


def first_repeated(names):
    """The first name that comes a second time, or None."""
    seen = set()  # (a set: 30,000 names took 5 s as a list)
    return next((n for n in names if n in seen or seen.add(n)), None)


class ListDataset(Dataset):
    """Images and labels from a list file, decoded from disk on every access (by DataLoader workers).

    Built as `ListDataset(args, split)` with split 'train' or 'val'; the list comes from
    `--train_list` / `--val_list`, or from `default_list` for datasets that ship their own. A sample
    is a dict {'image': uint8 (3, S, S), 'label': int64}; the training augmentation that fits the
    data is declared in `augment` (flips only where mirrored images keep their label).
    """

    targets = ('label',)  # what a sample holds besides 'image' (tasks check it)
    columns = 2  # fields per line: the image path and its label
    augment = ('crop',)  # default training augmentation (data/augment.py); --augment overrides it
    resize = 'squash'  # default --resize: the whole image to a square ('crop': keep the aspect ratio)
    class_files = ('classes.txt',)  # where class names are looked for, beside the list file

    def __init__(self, args, split):
        root = getattr(args, 'data_root', None)
        self.cache_folder = os.path.join(root, CACHE_FOLDER) if root else None  # what reading the data found out
        self._files_digest = None
        self.list_path = getattr(args, f'{split}_list', None) or self.default_list(args, split)
        self.size = args.img_size
        self.resize = getattr(args, 'resize', None) or self.resize
        self.crop_pct = getattr(args, 'crop_pct', None) or CROP_PCT
        self.crop = None  # a RandomResizedCrop done at decode time (see decode_crops)
        self.from_folder = os.path.isdir(self.list_path)
        if self.from_folder:
            if self.targets != ('label',):
                raise KilnError(f'{self.list_path} is a folder: --data_type {args.data_type} reads list files')
            self.samples, self.class_names = read_class_folders(self.list_path)
        else:
            self.samples = self.read_samples()
            self.class_names = read_class_names(self.list_path, self.class_files)
        self.check_files()
        self.num_classes = args.num_classes or self.count_classes()
        # (fewer names: the task numbers the other classes; other splits: match_classes compares the names)
        if split == 'train' and self.class_names and len(self.class_names) > self.num_classes:
            raise KilnError(
                f'{self.list_path}: {len(self.class_names)} classes are named but --num_classes is '
                f'{self.num_classes}; drop --num_classes, or name only the classes the model has'
            )
        if not self.from_folder:  # a folder's labels are its classes (match_classes compares them)
            self.check_targets()

    def renumber_classes(self, names):
        """Make the labels positions in `names`, which hold every class name of this dataset (a label beyond
        the named ones goes by its number, which must be one of `names` too)."""
        where = {name: index for index, name in reversed(list(enumerate(names)))}  # the first of each name
        position = {label: where[name] for label, name in enumerate(self.class_names)}
        for _, label, number in self.samples:
            if label not in position:
                if str(label) not in where:
                    raise KilnError(
                        f'{self.list_path}:{number}: label {label} has no name in classes.txt and is no class '
                        f'of {listed(names)}; name it in classes.txt'
                    )
                position[label] = where[str(label)]
        self.samples = [(path, position[label], number) for path, label, number in self.samples]
        self.class_names, self.num_classes = list(names), max(self.num_classes, len(names))

    def decode_crops(self, crop):
        """From now on, read every image through `crop` (a data.augment.RandomResizedCrop): the training
        crop made at decode time from the full-resolution image, not on the device after."""
        self.crop = crop

    def read_samples(self):
        """(image path, target, line number) per entry of the list file `self.list_path`, whose lines are
        "image_path target fields" (data/list_file.py). Override it for another layout, e.g. a CSV with
        named columns: paths relative to the list's folder go through `resolve_path(self.list_path, path)`."""
        with collections_paused():
            return [
                (resolve_path(self.list_path, fields[0]), self.parse_target(fields[1:], number), number)
                for number, fields in read_list_file(self.list_path, columns=self.columns)
            ]

    def parse_target(self, fields, number):
        """The target of one line from its fields after the image path: an integer label >= 0. Override it
        for other targets (a float for a regression, several labels): a target that is no int is not
        counted or checked as a class label (`count_classes`, `check_targets`), so such a run gives
        --num_classes (its number of outputs), or the dataset overrides count_classes."""
        (field,) = fields
        if not field.isdecimal():
            named = (  # a class name where its number goes
                '; a label is a class number, and classes.txt beside the list names them (a name per line, '
                'the first for label 0)'
                if field.isidentifier()
                else ''
            )
            raise KilnError(
                f'{self.list_path}:{number}: expected "image_path label" with a label >= 0, got label {field!r}{named}'
            )
        return int(field)

    def check_files(self):
        """Stop before training at the first listed file that is missing or not a readable image. The
        header check takes about 60 us an image, over a minute for a million: images that passed it
        before, unchanged since (the same list, sizes and times: see `files_digest`), are not checked again
        (`<data_root>/.cache/checked_<list>_<hash of its path>` keeps the `files_digest` that passed)."""
        digest, passed = self.files_digest(), self.cache_file('checked', '.txt')
        if passed:
            try:
                with open(passed) as f:
                    if f.read() == digest:
                        return
            except (OSError, ValueError):  # none yet, or unreadable: check them
                pass
        for index, path, reason in check_images([path for path, _, _ in self.samples])[:1]:
            raise KilnError(
                f'cannot read image {path} ({self.list_path}:{self.samples[index][2]}): {reason}; '
                f'fix or remove it{"" if self.from_folder else " from the list"}'
            )
        if passed:
            with contextlib.suppress(OSError):  # a read-only disk: they are checked again next time
                os.makedirs(self.cache_folder, exist_ok=True)
                remove_abandoned_temporaries(self.cache_folder)
                atomic_write_bytes(digest.encode(), passed)

    def cache_file(self, kind, suffix):
        """`<data_root>/.cache/<kind>_<list name>_<hash of the list's path><suffix>`: one file per list and
        kind, so the cache does not grow as lists change (None without a data root)."""
        if not self.cache_folder:
            return None
        stem = os.path.splitext(os.path.basename(os.path.normpath(self.list_path)))[0]
        where = hashlib.sha256(os.fsencode(os.path.abspath(self.list_path))).hexdigest()[:12]
        return os.path.join(self.cache_folder, f'{kind}_{stem}_{where}{suffix}')

    def files_digest(self):
        """A digest of the list file (its bytes; a folder: its path) and of every file it names (path,
        size, modification and change times: a file rewritten with its size and modification time kept,
        by `cp -p`, `rsync -a` or an archive, has a new change time, which no tool sets); a KilnError names
        the first listed file that does not exist."""
        if self._files_digest is None:
            digest = hashlib.sha256()
            if self.from_folder:
                digest.update(os.fsencode(os.path.abspath(self.list_path)))
            else:
                with open(self.list_path, 'rb') as f:
                    digest.update(f.read())
            for path, target, number in self.samples:
                for file in (path, target) if isinstance(target, str) else (path,):
                    try:
                        stat = os.stat(file)
                    except OSError:
                        stat = None
                    if stat is None or not S_ISREG(stat.st_mode):
                        kind = 'image' if file == path else 'file'
                        raise KilnError(f'{self.list_path}:{number}: {kind} {file} {not_a_file(self.list_path, file)}')
                    times = f'{stat.st_mtime_ns} {stat.st_ctime_ns}'
                    digest.update(os.fsencode(file) + f' {stat.st_size} {times}'.encode())
            self._files_digest = digest.hexdigest()
        return self._files_digest

    def count_classes(self):
        """The number of classes when --num_classes is not given: classes.txt's, else the largest label + 1,
        refused where most of those classes would have no sample (a typo such as 100000 made a model of
        100001 outputs and ended in 'out of memory')."""
        if self.class_names:
            return len(self.class_names)
        if not self.targets_are_labels():
            raise KilnError(
                f"{self.list_path}: its targets are no class labels, so the model's outputs cannot be counted "
                f'from them; give --num_classes (the number of outputs: 1 for one value), or override '
                f'count_classes in the dataset'
            )
        return self.classes_of_labels([(label, number) for _, label, number in self.samples])

    def classes_of_labels(self, labelled):
        """The number of classes that the (label, line number) pairs `labelled` make: the largest label + 1
        (1 for none), refused where most of them would have no sample (see count_classes)."""
        if not labelled:
            return 1
        largest, number = max(labelled)
        used = len({label for label, _ in labelled})
        if largest + 1 > max(10, 4 * used):
            raise KilnError(
                f'{self.list_path}:{number}: label {largest} makes {largest + 1} classes, but only {used} '
                f'different labels are used; fix the label, or give --num_classes (or a classes.txt) to keep it'
            )
        return largest + 1

    def targets_are_labels(self):
        """Whether every target is a class label (an integer, numpy's too), as the class counts and checks take them."""
        return all(isinstance(label, numbers.Integral) and not isinstance(label, bool) for _, label, _ in self.samples)

    def check_targets(self):
        """Stop with the list file line of the first label outside the class range, or the two lines of the
        first image listed with two labels (listed twice with one label, it is only seen more often). Targets
        that are no class labels (`parse_target` of a regression: floats) are the dataset's to check."""
        if not self.targets_are_labels():
            return
        for _, label, number in self.samples:
            if label >= self.num_classes:
                fix = 'the list or classes.txt (a name per class)' if self.class_names else 'the list or --num_classes'
                raise KilnError(
                    f'{self.list_path}:{number}: label {label} is outside 0..{self.num_classes - 1} '
                    f'(num_classes={self.num_classes}); fix {fix}'
                )
        self.refuse_two_targets('labels', 'remove one of the lines')

    def refuse_two_targets(self, what, advice):
        """Stop at the first image listed twice with different targets (`what`: their name), saying `advice`;
        listed twice with the same target, an image is only seen more often."""
        seen = {}  # path -> (target, line number) of its first line
        for path, target, number in self.samples:
            path = os.path.normpath(path)  # (./a.png is a.png)
            first, line = seen.setdefault(path, (target, number))
            if line == number:
                continue
            if isinstance(target, tuple):  # arrays (boxes and their labels)
                same = len(first) == len(target) and all(np.array_equal(a, b) for a, b in zip(first, target))
            else:
                same = first == target
            if not same:
                values = '' if isinstance(target, tuple) else f', {first} and {target}'
                raise KilnError(
                    f'{self.list_path}:{line} and line {number} give image {path} two {what}{values}; {advice}'
                )

    def default_list(self, args, split):
        """The list file used when no --<split>_list is given."""
        kind = 'a list file or a folder of class folders' if self.targets == ('label',) else 'a list file'
        raise KilnError(
            f'--data_type {args.data_type} reads {kind}: give --{split}_list PATH (or give the dataset a default_list)'
        )

    def image_paths(self):
        """Paths of all samples, in dataset order."""
        return [path for path, _, _ in self.samples]

    def read(self, index, with_box=False):
        """The uint8 image tensor (3, S, S) of sample `index` (with `with_box`, and the part of the image it
        shows and the image's size: see data/image_io.decode_image)."""
        path, _, number = self.samples[index]
        return decode_image(
            path,
            self.size,
            f' ({self.list_path}:{number})',
            resize=self.resize,
            crop=self.crop,
            crop_pct=self.crop_pct,
            with_box=with_box,
        )

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return {'image': self.read(index), 'label': torch.tensor(self.samples[index][1])}
