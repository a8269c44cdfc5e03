"""Small PyTorch helpers: seeding, device choice, unwrapping and tolerant weight loading."""
import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from utils.checkpoint import load_checkpoint
from utils.distributed import is_distributed, local_rank
from utils.errors import KilnError

WRAPPER_PREFIXES = ('module.', '_orig_mod.')  # added by DataParallel/DDP and by torch.compile


def set_seed(seed):
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic(enabled):
    """Use only deterministic algorithms (--deterministic), so the same run gives the same bits."""
    if enabled:
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')  # required by deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def rng_states():
    """The states of python's, numpy's and torch's (CPU and CUDA) random generators, checkpointable
    with weights_only loading (no numpy arrays)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        'python': random.getstate(),
        'numpy': (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached),
        'torch': torch.get_rng_state(),
        'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_states(states):
    """Restore generator states saved by `rng_states`."""
    random.setstate(states['python'])
    kind, keys, position, has_gauss, cached = states['numpy']
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(states['torch'])
    if states['cuda'] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states['cuda'])


def seed_worker(worker_id):
    """DataLoader worker_init_fn: seed python and numpy from the worker's own torch seed."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def select_device(args):
    """The device a run uses: --cpu, else the first of --gpus, else GPU 0 when CUDA exists
    (under torchrun: the GPU of this process's LOCAL_RANK)."""
    if args.cpu:
        return torch.device('cpu')
    if is_distributed():
        return torch.device('cuda', local_rank()) if torch.cuda.is_available() else torch.device('cpu')
    if args.gpus:
        if not torch.cuda.is_available():
            raise KilnError('--gpus was given but CUDA is not available here; drop --gpus or pass --cpu')
        if max(args.gpus) >= torch.cuda.device_count() or min(args.gpus) < 0:
            raise KilnError(f'--gpus {args.gpus}: only GPUs 0..{torch.cuda.device_count() - 1} exist')
        return torch.device('cuda', args.gpus[0])
    return torch.device('cuda', 0) if torch.cuda.is_available() else torch.device('cpu')


def to_device(batch, device, channels_last=False):
    """Move an (inputs, targets) batch to `device` without waiting for the copy; image inputs
    optionally in channels-last memory format."""
    inputs, targets = batch
    inputs = inputs.to(device, non_blocking=True)
    if channels_last and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, targets.to(device, non_blocking=True)


def place_model(model, args, device):
    """The model on `device`, channels-last with --channels_last, compiled with --compile
    (not yet wrapped for several devices: see model_entry.equip_multi_gpu)."""
    model = model.to(device, memory_format=torch.channels_last if args.channels_last else torch.preserve_format)
    return torch.compile(model) if args.compile else model


def autocast_for(device, amp):
    """A function giving the autocast context of --amp ('off', 'bf16', 'fp16') on `device`."""
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp)
    return lambda: torch.autocast(device.type, dtype, enabled=dtype is not None)


def unwrap_model(model):
    """The plain model inside DataParallel / DistributedDataParallel / torch.compile wrappers."""
    while True:
        inner = getattr(model, 'module', None) or getattr(model, '_orig_mod', None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def state_dict_of(checkpoint, prefix_map=None):
    """The model weights inside a Kiln checkpoint, a `{'state_dict': ...}` file or a plain state dict
    (torchvision's .pth files, .safetensors files), with wrapper prefixes (`module.`, `_orig_mod.`)
    stripped from the names, then names starting with a key of `prefix_map` renamed to start with
    its value instead (--load_prefix_map old.=new.)."""
    if not isinstance(checkpoint, dict):
        raise KilnError(f'expected a dict of tensors in the checkpoint, got {type(checkpoint).__name__}')
    for key in ('model', 'state_dict'):
        if isinstance(checkpoint.get(key), dict):
            checkpoint = checkpoint[key]
            break
    weights = {}
    for name, value in checkpoint.items():
        if not torch.is_tensor(value):
            continue
        stripped = True
        while stripped:
            stripped = False
            for prefix in WRAPPER_PREFIXES:
                if name.startswith(prefix):
                    name, stripped = name[len(prefix):], True
        for old, new in (prefix_map or {}).items():
            if name.startswith(old):
                name = new + name[len(old):]
                break
        weights[name] = value
    return weights


@dataclass
class LoadReport:
    """What load_match_dict did: names loaded, skipped for shape, missing from, unexpected in the file."""
    loaded: list = field(default_factory=list)
    shape_mismatched: list = field(default_factory=list)  # (name, shape in file, shape in model)
    missing: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)

    def to_dict(self):
        """The report as plain data, for JSON."""
        return {'loaded': self.loaded, 'missing': self.missing, 'unexpected': self.unexpected,
                'shape_mismatched': [{'name': n, 'in_file': list(a), 'in_model': list(b)}
                                     for n, a, b in self.shape_mismatched]}

    def __str__(self):
        lines = [f'loaded {len(self.loaded)} tensors, skipped {len(self.shape_mismatched)} for shape, '
                 f'{len(self.missing)} missing from the checkpoint, {len(self.unexpected)} unexpected']
        lines += [f'  shape mismatch: {n} {tuple(a)} in file vs {tuple(b)} in model' for n, a, b in self.shape_mismatched]
        lines += [f'  missing: {n}' for n in self.missing]
        lines += [f'  unexpected: {n}' for n in self.unexpected]
        return '\n'.join(lines)


def load_match_dict(model, checkpoint, prefix_map=None):
    """Load into `model` only the tensors whose names and shapes match; return a LoadReport.

    `checkpoint` is a path (.pth or .safetensors) or an already loaded dict: a Kiln checkpoint, a
    plain state dict or a torchvision weights file. Use it to start from weights of a model that
    differs in places (another head, an extra block); everything else keeps its init.
    `prefix_map` renames names first (see state_dict_of).
    """
    if isinstance(checkpoint, str):
        checkpoint = load_checkpoint(checkpoint)
    weights = state_dict_of(checkpoint, prefix_map)
    model = unwrap_model(model)
    own = model.state_dict()
    report = LoadReport()
    matched = {}
    for name, value in weights.items():
        if name not in own:
            report.unexpected.append(name)
        elif own[name].shape != value.shape:
            report.shape_mismatched.append((name, value.shape, own[name].shape))
        else:
            matched[name] = value
            report.loaded.append(name)
    report.missing = [name for name in own if name not in weights]
    model.load_state_dict(matched, strict=False)
    return report


def load_weights(model, checkpoint, strict=True, source=None, prefix_map=None):
    """Load model weights from `checkpoint` (a path or a loaded dict): all of them when `strict`,
    else the matching ones via load_match_dict, whose report is printed. Returns a LoadReport.

    A strict load that does not fit raises a KilnError suggesting --load_not_strict; `source`
    names an already loaded checkpoint in messages.
    """
    source = checkpoint if isinstance(checkpoint, str) else source or 'the checkpoint'
    if isinstance(checkpoint, str):
        checkpoint = load_checkpoint(checkpoint)
    if not strict:
        report = load_match_dict(model, checkpoint, prefix_map)
        print(f'load_match_dict from {source}: {report}')
        return report
    weights = state_dict_of(checkpoint, prefix_map)
    try:
        unwrap_model(model).load_state_dict(weights)
    except RuntimeError as error:
        lines = str(error).splitlines()
        detail = lines[1].strip() if len(lines) > 1 else lines[0]
        raise KilnError(f'{source} does not fit this model ({detail}); check --model_type/--num_classes '
                        f'or pass --load_not_strict to load only the tensors that match') from None
    return LoadReport(loaded=list(weights))
