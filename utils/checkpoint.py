"""Checkpoint files: crash-safe writing, safe loading and loading model weights from them.

A checkpoint is a dict of tensors and plain Python values, written to a temporary file that is
fsynced and renamed; it is always read with `weights_only=True` onto the CPU (`map_location`), so
a file cannot run code when loaded and a checkpoint written on a GPU loads on any machine.
"""

import contextlib
import hashlib
import io
import json
import math
import os
import pickle
import re
import socket
import warnings
from dataclasses import dataclass, field

import torch

from utils.errors import KilnError
from utils.fault_points import fault_point


def atomic_write_bytes(data, path, sync_folder=True):
    """Write `data` (bytes, or a function that writes them to the file object it is given) to `path` so that
    a crash leaves either the old file or the new one, whole.

    The temporary file sits in the same folder (a rename across file systems is not atomic),
    is flushed to disk before the rename, and is removed if anything fails. `sync_folder=False`
    leaves the folder's fsync (which makes the rename survive a power cut) to a later write there.
    """
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f'.{os.path.basename(path)}.tmp{os.getpid()}@{socket.gethostname()}')
    try:
        with open(temporary, 'wb') as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fault_point('temporary_written')
        os.replace(temporary, path)
    except BaseException as error:
        if os.path.exists(temporary):
            os.remove(temporary)
        if isinstance(error, OSError) and error.filename is None:  # a full disk at write or fsync names no file
            raise OSError(error.errno, error.strerror, path) from error
        raise
    if sync_folder:
        sync_directory(folder)


def process_running(pid):
    """Whether process `pid` exists on this host (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # not ours to signal: it exists
        return True
    return True


# a file or folder being written, beside the name it gets once whole: .<name>.tmp<pid>@<host>
TEMPORARY = re.compile(r'\.(.+)\.tmp(\d+)@(.+)')


def remove_abandoned_temporaries(folder):
    """Remove the temporary files in `folder` of atomic_write_bytes calls of this host whose process is gone
    (killed while writing: an out-of-memory kill as a cache of decoded images is written, say), for a
    folder that several processes write without a lock (other hosts' are left: their processes cannot be
    seen)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        match = TEMPORARY.fullmatch(name)
        if not match or match.group(3) != socket.gethostname():
            continue
        if int(match.group(2)) != os.getpid() and not process_running(int(match.group(2))):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))


class SameFolder:
    """The folder a run writes into, as it was when the run began: `check()` refuses once that path names
    another folder or none (moved or removed while the run trains). Files written by path would otherwise
    land in whatever is there now: another run's folder, made at that path since, with a lock of its own.
    The folder is held open, so that file systems that number inodes as they are used (FUSE mounts) keep
    its number; it is never its lock file that is opened (closing that would drop the run's lock)."""

    def __init__(self, folder):
        self.folder, self.opened = folder, None
        self.opened = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)

    def check(self):
        """Raise a KilnError when the path no longer names the folder this run began in."""
        try:
            same = os.path.samestat(os.stat(self.folder), os.fstat(self.opened))
        except (FileNotFoundError, NotADirectoryError):  # gone, or a file where a folder on its path was
            same = False
        if not same:
            raise KilnError(
                f'{self.folder} was moved or removed while this run wrote into it, so nothing more is written '
                f'there (another run may use that path now); continue the run with --resume from where its '
                f'folder is now'
            )

    def __del__(self):
        if self.opened is not None:
            os.close(self.opened)


def sync_directory(folder):
    """fsync `folder`: the renames and links made in it survive a power cut (given a file, its bytes do)."""
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def json_text(data):
    """`data` as indented JSON that every reader takes: a non-finite number (NaN: the recall of a class
    without samples, a diverged loss) is written as null, for JSON has no NaN or Infinity. A list of
    numbers stays on one line (a confusion matrix: a row per line, not a line per count)."""
    rows = []

    def finite(value, rows):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: finite(item, rows) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            items = [finite(item, rows) for item in value]
            if rows is not None and items and all(item is None or type(item) in (int, float, bool) for item in items):
                rows.append(json.dumps(items, allow_nan=False))
                return f'\0{len(rows) - 1}'  # the row's place, filled in once the rest is indented
            return items
        return value

    text = json.dumps(finite(data, rows), indent=1, default=str, allow_nan=False)
    if text.count('\\u0000') != len(rows):  # a text in the data holds a NUL too: the marks would be ambiguous
        return json.dumps(finite(data, None), indent=1, default=str, allow_nan=False)
    return re.sub(r'"\\u0000(\d+)"', lambda match: rows[int(match.group(1))], text)


def atomic_write_json(data, path):
    """Write `data` as indented JSON (json_text) to `path` atomically (see atomic_write_bytes)."""
    atomic_write_bytes(json_text(data).encode(), path)


def save_checkpoint(state, path, sync_folder=True):
    """Serialize `state` with torch.save and write it to `path` atomically (see atomic_write_bytes);
    return the SHA-256 of its bytes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(buffer.getvalue(), path, sync_folder)
    return hashlib.sha256(buffer.getbuffer()).hexdigest()


def load_checkpoint(path, map_location='cpu', mmap=False):
    """Load a checkpoint or state dict safely: `.safetensors` files with the safetensors package,
    anything else with `torch.load(weights_only=True)` onto `map_location` (the CPU unless asked; with
    `mmap`, tensors are read from the file only when used); problems become a KilnError."""
    if not os.path.isfile(path):
        raise KilnError(f'checkpoint {path} does not exist; check --load_model_path')
    if path.endswith('.safetensors'):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path, device=str(map_location))
        except (SafetensorError, OSError, ValueError) as error:
            raise KilnError(f'{path} is not a readable safetensors file ({error})') from None
    try:
        path.encode()
    except UnicodeEncodeError:  # bytes of no UTF-8 in its name (os.fsdecode's surrogates), which mmap cannot open
        mmap = False
    try:
        with warnings.catch_warnings():  # a plain pickle is refused below in one line, without torch's warning
            warnings.filterwarnings('ignore', message='.*pickle protocol')
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as error:  # noqa: BLE001 - every failure of torch.load becomes one line
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        blocked = re.search(r'GLOBAL ([\w.]+)', str(error))
        if isinstance(error, pickle.UnpicklingError) and blocked:
            raise KilnError(
                f'refusing to load {path}: it holds the Python object {blocked.group(1)}, which could run '
                f'code and which safe loading does not allow; re-save it as a plain state dict'
            ) from None
        with open(path, 'rb') as f:
            head = f.read(2)
        if isinstance(error, pickle.UnpicklingError) and head[:1] == b'\x80':  # a pickle's PROTO opcode
            raise KilnError(
                f'refusing to load {path}: it is a plain pickle, which could run code and which '
                f'safe loading does not allow; re-save it with torch.save as a state dict'
            ) from None
        if not head:
            reason = 'the file is empty'
        elif head != b'PK':  # torch.save writes a zip archive
            reason = 'not a torch.save file'
        elif isinstance(error, OSError) or 'zip archive' in str(error):  # torch's own words name its zip reader
            reason = 'the file is cut short or damaged'
        else:
            reason = (lines[0].split('. ')[0] if lines else '') or type(error).__name__
        raise KilnError(
            f'{path} is not a readable PyTorch checkpoint ({reason}); '
            f'check that the file is complete and was written by torch.save'
        ) from None


def checksum(path):
    """The SHA-256 of a file's bytes, as hex (checkpoints.json keeps one per checkpoint)."""
    with open(path, 'rb') as f:
        return hashlib.file_digest(f, 'sha256').hexdigest()


WRAPPER_PREFIXES = ('module.', '_orig_mod.')  # added by DataParallel/DDP and by torch.compile


def unwrap_model(model):
    """The plain model inside DataParallel / DistributedDataParallel / torch.compile wrappers."""
    while True:
        inner = getattr(model, 'module', None) or getattr(model, '_orig_mod', None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def state_dict_of(checkpoint, prefix_map=None):
    """The model weights inside a Kiln checkpoint (its average of the weights when it has one:
    --ema_decay, what its run validated), a `{'state_dict': ...}` file or a plain state dict
    (torchvision's .pth files, .safetensors files), with wrapper prefixes (`module.`, `_orig_mod.`)
    stripped from the names, then names starting with a key of `prefix_map` renamed to start with
    its value instead (--load_prefix_map old.=new.; where several keys start a name, the longest)."""
    if not isinstance(checkpoint, dict):
        raise KilnError(f'expected a dict of tensors in the checkpoint, got {type(checkpoint).__name__}')
    if checkpoint.get('weights') == 'ema' and isinstance(checkpoint.get('ema'), dict):
        checkpoint = checkpoint['ema']
    for key in ('model', 'module', 'state_dict'):
        if isinstance(checkpoint.get(key), dict):
            checkpoint = checkpoint[key]
            break
    rules = sorted((prefix_map or {}).items(), key=lambda rule: -len(rule[0]))  # the longest prefix that matches
    weights, used = {}, set()
    for name, value in checkpoint.items():
        if not torch.is_tensor(value):
            continue
        used.update(old for old, _ in rules if name.startswith(old))  # a rule for a wrapper prefix, module.=, too
        stripped = True
        while stripped:
            stripped = False
            for prefix in WRAPPER_PREFIXES:
                if name.startswith(prefix):
                    name, stripped = name[len(prefix) :], True
        for old, new in rules:
            if name.startswith(old):
                name = new + name[len(old) :]
                used.add(old)
                break
        weights[name] = value
    unused = [old for old, _ in rules if old not in used]
    if unused:  # a typo, or a file other than the one meant: its names would load into nothing
        names = sorted(weights)
        raise KilnError(
            f'--load_prefix_map {unused[0]}=...: no tensor name in the checkpoint starts with {unused[0]!r} '
            f'(they start like {", ".join(names[:3])}{", ..." if len(names) > 3 else ""})'
        )
    return weights


@dataclass
class LoadReport:
    """What loading did: names loaded, skipped for shape, missing from, unexpected in the file."""

    loaded: list = field(default_factory=list)
    shape_mismatched: list = field(default_factory=list)  # (name, shape in file, shape in model)
    missing: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)

    def to_dict(self):
        """The report as plain data, for JSON."""
        return {
            'loaded': self.loaded,
            'missing': self.missing,
            'unexpected': self.unexpected,
            'shape_mismatched': [
                {'name': n, 'in_file': list(a), 'in_model': list(b)} for n, a, b in self.shape_mismatched
            ],
        }

    def fits(self):
        """Whether every tensor of the model was in the file with its shape, and nothing else was."""
        return not (self.shape_mismatched or self.missing or self.unexpected)

    def first_problems(self, count=3):
        """The first few mismatches, for a one-line message."""
        problems = [
            f'{n} is {tuple(a)} in the file but {tuple(b)} in the model' for n, a, b in self.shape_mismatched[:count]
        ]
        problems += [f'{n} is missing from the file' for n in self.missing[:count]]
        problems += [f'{n} is not in the model' for n in self.unexpected[:count]]
        more = len(self.shape_mismatched) + len(self.missing) + len(self.unexpected) - len(problems[:count])
        return '; '.join(problems[:count]) + (f'; and {more} more' if more > 0 else '')

    def __str__(self):
        lines = [
            f'loaded {len(self.loaded)} tensors, skipped {len(self.shape_mismatched)} for shape, '
            f'{len(self.missing)} missing from the checkpoint, {len(self.unexpected)} unexpected'
        ]
        lines += [
            f'  shape mismatch: {n} {tuple(a)} in file vs {tuple(b)} in model' for n, a, b in self.shape_mismatched
        ]
        lines += [f'  missing: {n}' for n in self.missing]
        lines += [f'  unexpected: {n}' for n in self.unexpected]
        return '\n'.join(lines)


def match_weights(model, weights):
    """Compare `weights` (a state dict) with `model`'s tensors: (LoadReport, the tensors that fit)."""
    own = unwrap_model(model).state_dict()
    report, matched = LoadReport(), {}
    for name, value in weights.items():
        if name not in own:
            report.unexpected.append(name)
        elif own[name].shape != value.shape:
            report.shape_mismatched.append((name, value.shape, own[name].shape))
        else:
            matched[name] = value
            report.loaded.append(name)
    report.missing = [name for name in own if name not in weights]
    return report, matched


NO_FIT_ADVICE = 'check --model_type, or rename its tensors with --load_prefix_map'


def load_match_dict(model, checkpoint, prefix_map=None, source=None, advice=NO_FIT_ADVICE):
    """Load into `model` only the tensors whose names and shapes match; return a LoadReport.

    `checkpoint` is a path (.pth or .safetensors) or an already loaded dict: a Kiln checkpoint, a
    plain state dict or a torchvision weights file. Use it to start from weights of a model that
    differs in places (another head, an extra block); everything else keeps its init.
    `prefix_map` renames names first (see state_dict_of). A KilnError when no tensor fits (`source`
    names the checkpoint in it, `advice` says what to do).
    """
    source = checkpoint if isinstance(checkpoint, str) else source or 'the checkpoint'
    if isinstance(checkpoint, str):
        checkpoint = load_checkpoint(checkpoint)
    report, matched = match_weights(model, state_dict_of(checkpoint, prefix_map))
    # nothing but counters (BatchNorm's num_batches_tracked, a scalar that fits any model with one): the
    # model would train from its init as if nothing were wrong
    if not any(value.dim() for value in matched.values()):
        raise KilnError(
            f'no tensor of {source} fits this model ({report.first_problems()}): it holds another '
            f"net's weights; {advice}"
        )
    unwrap_model(model).load_state_dict(matched, strict=False)
    return report


def load_pretrained(model, path, name, how_to_get):
    """Load the ImageNet weights file `path` (--pretrained_path) into `model` (net `name`), all of them
    (safely, as every checkpoint), and mark the model as having read it (models/model_entry.py checks);
    a missing file is a KilnError saying `how_to_get` it."""
    if os.path.isdir(path):
        raise KilnError(f'--pretrained_path {path} is a folder; give the weights file in it (.pth or .safetensors)')
    if not os.path.isfile(path):
        raise KilnError(
            f'--pretrained_path {path} does not exist; Kiln never downloads weights: on a machine with internet '
            f'{how_to_get} and copy it to {path}'
        )
    weights = load_checkpoint(path)
    if isinstance(weights, dict) and 'args' in weights:  # a training checkpoint of Kiln's, not bare weights
        raise KilnError(
            f'--pretrained_path {path} is a Kiln checkpoint, not ImageNet weights; to start from its weights give '
            f'--load_model_path {path} (with --load_not_strict where its classes differ)'
        )
    advice = f"these are not {name}'s weights: {how_to_get} and give that file"
    report = load_weights(model, weights, strict=True, source=f'--pretrained_path {path}', advice=advice)
    model.pretrained_path = path
    print(f'{name}: {len(report.loaded)} tensors of ImageNet weights loaded from {path}')


STRICT_ADVICE = 'check --model_type/--num_classes or pass --load_not_strict to load only the tensors that match'


def other_model_advice(checkpoint, model_type):
    """What to do when `checkpoint` is a Kiln checkpoint of another --model_type than `model_type`; None
    when it is not (or either is unknown)."""
    options = checkpoint.get('args') if isinstance(checkpoint, dict) else None
    trained = options.get('model_type') if isinstance(options, dict) else None
    if model_type and trained and trained != model_type:
        return (
            f'it is a --model_type {trained} checkpoint and this run builds {model_type}: give --model_type {trained}'
        )
    return None


def trained_options_advice(checkpoint, built_with=None):
    """What to do when a checkpoint run as it is (eval.py, predict.py) does not fit the model built with the
    options `built_with`: build the model it was trained for, naming the options given that differ from its
    training's. Never --load_not_strict: the layers that do not fit would be scored at their init."""
    options = checkpoint.get('args') if isinstance(checkpoint.get('args'), dict) else {}
    classes = len(checkpoint.get('class_names') or ()) or options.get('num_classes')
    trained = {'num_classes': classes, 'img_size': options.get('img_size')}
    changed = [
        f'--{name} {getattr(built_with, name)} (it was trained with {value})'
        for name, value in trained.items()
        if value is not None and getattr(built_with, name, value) not in (None, value)
    ]
    if changed:
        return f'{", ".join(changed)}: drop them (eval.py and predict.py take them from the checkpoint)'
    return 'give the --model_type, --num_classes and --img_size it was trained with'


POSITION_TABLES = ('pos_embed', 'position_embedding', 'relative_position')  # sized by the image (ViTs, Swin)


def only_position_tables_differ(report):
    """Whether a LoadReport's only problems are position tables of another size: weights of this very net
    made for another image size."""
    names = [name for name, _, _ in report.shape_mismatched]
    return (
        bool(names)
        and not report.missing
        and not report.unexpected
        and all(any(table in name for table in POSITION_TABLES) for name in names)
    )


def load_weights(
    model,
    checkpoint,
    strict=True,
    source=None,
    prefix_map=None,
    advice=STRICT_ADVICE,
    model_type=None,
    inference=False,
    built_with=None,
):
    """Load model weights from `checkpoint` (a path or a loaded dict): all of them when `strict`,
    else the matching ones via load_match_dict, whose report is printed. Returns a LoadReport.

    A strict load that does not fit raises a KilnError naming the first mismatched tensors and giving
    `advice`; `source` names the checkpoint in messages (default: its path). With `model_type` (the
    --model_type being built), a Kiln checkpoint of another model type says so in that error instead.
    With `inference` (eval.py, predict.py: the weights are run as they are, not trained on) the error
    says which model the checkpoint holds instead of `advice`, naming the options of `built_with` (those
    the model was built with) that differ from its training's (trained_options_advice).
    """
    path = checkpoint if isinstance(checkpoint, str) else None
    source = source or path or 'the checkpoint'
    if path is not None:
        checkpoint = load_checkpoint(path)
    other_model = other_model_advice(checkpoint, model_type)  # the likeliest reason it would not fit
    if not strict:
        report = load_match_dict(model, checkpoint, prefix_map, source, other_model or NO_FIT_ADVICE)
        print(f'load_match_dict from {source}: {report}')
        return report
    report, matched = match_weights(model, state_dict_of(checkpoint, prefix_map))
    if not report.fits():
        if inference:
            advice = other_model or trained_options_advice(checkpoint, built_with)
        elif only_position_tables_differ(report):
            advice = (
                'these weights are for another image size (only the position tables differ): give the --img_size '
                'they were made for (224 for a *_224 net)'
            )
        elif other_model:
            advice = f'{other_model}, or pass --load_not_strict to load only the tensors that match'
        raise KilnError(f'{source} does not fit this model ({report.first_problems()}); {advice}')
    unwrap_model(model).load_state_dict(matched)
    return report
