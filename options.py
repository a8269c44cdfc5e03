"""Command-line options of train.py, eval.py and predict.py, parsed once.

Precedence: built-in defaults < `--config FILE` (YAML or JSON) < flags on the command line.
Task, model and dataset names are checked against their registries here, before torch loads,
so `--help` and every option mistake answer at once with one line. This module imports no torch.
Folders, resume and checkpoints are resolved later (utils/run_folder.py).
"""

import argparse
import functools
import math
import os
import re
import sys

import yaml

PROJECT = os.path.dirname(os.path.abspath(__file__))  # the defaults' outputs stay in it, run from anywhere

NOT_SAVED = ('config', 'debug', 'resume', 'command')  # how a run was started, not what it is
DERIVED = ('model_dir', 'result_dir', 'resume_from')  # computed from the options: in args.txt, not args.yaml
FILLED_BY_DATA = ('num_classes', 'resize')  # left unset, a run takes them from its training data (and saves them)
RESUME_LATEST = 'last'  # --resume without a path
NONE = 'none'  # the value that puts an option whose default is unset back to it (--ema_decay none: off)
# what a resumed run may change: how long it runs and how it reports, not what it computes
RESUME_CHANGEABLE = (
    'epochs',
    'max_iteration',
    'valid_interval',
    'save_interval',
    'print_freq',
    'progress_bar',
    'log_images',
    'image_interval',
    'loggers',
    'mlflow_uri',
    'wandb_project',
    'keep_last',
    'keep_best',
    'early_stop_patience',
    'early_stop_min_delta',
    'num_workers',
    'cpu',
    'gpus',
    'compile',
    'compile_mode',
    'channels_last',
    'deterministic',
    'limit_val_batches',
    'profile',
    'detect_anomaly',
    'checkpoints_dir',
    'data_root',
)
REGISTRIES = {  # option -> (registry module, dict name, its file)
    'task': ('tasks.task_entry', 'TASKS', 'tasks/task_entry.py'),
    'model_type': ('model.model_entry', 'MODELS', 'model/model_entry.py'),
    'data_type': ('data.data_entry', 'DATASETS', 'data/data_entry.py'),
}
# what decides the numbers evaluation measures: eval.py and predict.py take these from the
# checkpoint's training run unless they are given (on the command line or in --config)
INHERITED = (
    'task',
    'model_type',
    'data_type',
    'data_root',
    'val_list',
    'num_classes',
    'ignore_index',
    'img_size',
    'resize',
    'crop_pct',
    'normalize',
    'loss',
    'topk',
    'monitor',  # a top-k that holds every class is computed only where it is monitored (metrics.py)
    'amp',
    'channels_last',
)
# what a task decides when not given (tasks/task.py): option -> the Task attribute
TASK_DEFAULTS = {
    'model_type': 'default_model',
    'data_type': 'default_data',
    'loss': 'default_loss',
    'img_size': 'default_image_size',
    'monitor': 'monitor',
    'monitor_mode': 'monitor_mode',
}
AUGMENTATIONS = ('crop', 'resized_crop', 'hflip', 'vflip', 'color', 'erase', 'mixup', 'cutmix')  # data/augment.py's
LOGGERS = ('tensorboard', 'csv', 'wandb', 'mlflow')


def did_you_mean(word, choices):
    """' (did you mean X?)' for the choice closest to a mistyped `word`, or '' when none is close."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f' (did you mean {close[0]}?)' if close else ''


class DefaultsShown(argparse.HelpFormatter):
    """--help with each option's default, where it has one (not unset, not off) its help does not give."""

    def _get_help_string(self, action):
        text, default = action.help or '', action.default
        if default in (None, False, argparse.SUPPRESS) or 'default' in text:
            return text
        shown = ' '.join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f'{text} (default: {shown.replace("%", "%%")})'.lstrip()


class KilnArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) with exit code 2; an unknown flag
    comes with the nearest known one; every on/off option has its --no- form (a config file or a
    resumed run's options may turn one on, and the command line must be able to turn it off)."""

    def __init__(self, *args, **kwargs):
        # no abbreviations: --epoch was taken for --epochs, and a later option can change what one means
        kwargs.setdefault('formatter_class', DefaultsShown)
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.register('action', 'store_true', Switch)  # argument groups share the registry
        self.register('action', None, Store)
        self.register('action', 'store', Store)

    def set_defaults(self, **kwargs):
        """Change defaults; an option whose default becomes None takes `none` (see Store)."""
        super().set_defaults(**kwargs)
        for action in self._actions:
            if action.dest in kwargs and isinstance(action, Store):
                action.turns_off = Store.takes_none(action)

    def _get_values(self, action, arg_strings):
        """An option's value from its words; `none` turns off an option that is off unless given."""
        if getattr(action, 'turns_off', False) and arg_strings == [NONE]:
            return None
        try:
            return super()._get_values(action, arg_strings)
        except argparse.ArgumentError as error:
            if getattr(action, 'turns_off', False):
                error.message += f', or {NONE} {Store.none_does(action)}'
            raise

    def parse_known_args(self, args=None, namespace=None):
        self.words = sys.argv[1:] if args is None else list(args)  # what error() looks at for a hint
        return super().parse_known_args(args, namespace)

    def error(self, message):
        flags = {flag: action for action in self._actions for flag in action.option_strings}
        if message.startswith('unrecognized arguments:'):
            unknown = next((token for token in message.split()[2:] if token.startswith('--')), '').split('=')[0]
            meant = flags.get(unknown.replace('--no-', '--', 1))
            if unknown.startswith('--no-') and getattr(meant, 'turns_off', False):
                message += f' (use {meant.option_strings[0]} {NONE} {Store.none_does(meant)})'
            elif unknown:
                message += did_you_mean(unknown, flags)
            elif any(os.path.exists(word) for word in message.split()[2:]):  # a glob the shell expanded, likely
                message += " (an option takes one path: quote a glob, e.g. 'photos/*.jpg', so the shell leaves it)"
        elif message.startswith('the following arguments are required:'):  # said before a mistyped flag
            typed = [word.split('=')[0] for word in getattr(self, 'words', ()) if word.startswith('--')]
            mistyped = next((word for word in typed if word not in flags and did_you_mean(word, flags)), None)
            if mistyped:
                message += f'; {mistyped} is no option{did_you_mean(mistyped, flags)}'
        from utils.errors import exit_with_error

        exit_with_error(f'error: {message} (see --help)')  # every torchrun rank parses the same line


class Store(argparse._StoreAction):
    """What an option that takes a value makes in Kiln's parsers: one that is off unless given (default
    None) also takes `none`, so that the command line can turn off what a config or a resumed run set."""

    def __init__(self, option_strings, dest, default=None, required=False, **kwargs):
        super().__init__(option_strings, dest, default=default, required=required, **kwargs)
        self.turns_off = self.takes_none(self)

    @staticmethod
    def takes_none(action):
        """Whether `action` is an optional flag that is off (None) unless given."""
        return action.default is None and not action.required and bool(action.option_strings)

    @staticmethod
    def none_does(action):
        """What `none` does to `action`, in words: an option whose help names a default (--num_workers:
        min(4, CPUs)) gets that default, any other is turned off."""
        return 'for its default' if 'default' in (action.help or '') else 'to turn it off'


class Switch(argparse.BooleanOptionalAction):
    """What action='store_true' makes in Kiln's parsers: an option that is off unless given, and --no-X."""

    def __init__(self, option_strings, dest, default=False, **kwargs):
        super().__init__(option_strings, dest, default=default, **kwargs)


def _number(convert, test, requirement):
    """An argparse type: `convert` the text, then require `test(value)` (finite numbers only)."""

    def parse(text):
        try:
            value = convert(text)
        except ValueError:  # argparse would say "invalid a positive integer value: '2.5'"
            raise argparse.ArgumentTypeError(f'must be {requirement}, got {text}') from None
        if isinstance(value, int) and not -(2**63) <= value < 2**63:  # what torch (and the seeds) hold
            raise argparse.ArgumentTypeError(f'must be {requirement} from -2**63 to 2**63 - 1, got {text}')
        if not (math.isfinite(value) and test(value)):
            raise argparse.ArgumentTypeError(f'must be {requirement}, got {text}')
        return value

    return parse


def count_at_least(least):
    """An argparse type: an integer of at least `least`."""
    words = {0: '0 or more', 1: 'a positive integer'}.get(least, f'an integer of {least} or more')
    return _number(int, lambda v: v >= least, words)


_positive_int = count_at_least(1)
_non_negative_int = count_at_least(0)
_positive_float = _number(float, lambda v: v > 0, 'a positive number')
_non_negative_float = _number(float, lambda v: v >= 0, '0 or more')
_image_side = _number(int, lambda v: 8 <= v <= 4096, 'an image side from 8 to 4096 pixels')
_fraction = _number(float, lambda v: 0 < v <= 1, 'a fraction in (0, 1]')


def _count_or_fraction(text):
    """--limit_*_batches: a number of batches (an integer >= 1) or a fraction of them (0 < f <= 1)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # not a number: said below, as for one out of range
    if not math.isfinite(value) or not (0 < value <= 1 or value == int(value) > 1):
        raise argparse.ArgumentTypeError(
            f'must be a count of batches (1, 2, ...) or a fraction (0 < f <= 1), got {text}'
        )
    if value > 1 or (value == 1 and '.' not in text and 'e' not in text.lower()):
        return int(value)  # a count, 2.0 and 1e1 too (no fraction is above 1); 1 is one batch, 1.0 all of them
    return value


def _augmentations(text):
    """--augment: 'none', 'default' or names from AUGMENTATIONS joined by commas."""
    if text in ('none', 'default'):
        return text
    names = [name.strip() for name in text.split(',') if name.strip()]
    unknown = [name for name in names if name not in AUGMENTATIONS]
    if unknown or not names:
        hint = did_you_mean(unknown[0], AUGMENTATIONS) if unknown else ''
        raise argparse.ArgumentTypeError(
            f'unknown augmentation {", ".join(unknown) or text!r}{hint}; use none, default or '
            f'a comma list of {", ".join(AUGMENTATIONS)}'
        )
    return ','.join(names)


def _logger_names(text):
    """--loggers: names from LOGGERS, one per word or joined by commas (as --augment takes them)."""
    names = [name.strip() for name in text.split(',') if name.strip()]
    unknown = [name for name in names if name not in LOGGERS] or ([] if names else [text])
    if unknown:
        raise argparse.ArgumentTypeError(
            f'unknown logger {unknown[0]!r}{did_you_mean(unknown[0], LOGGERS)}; choose from {", ".join(LOGGERS)}'
        )
    return names


class _Joined(argparse.Action):
    """An option of several words whose type gives a list for each: its value is one list of them all, each once."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, list(dict.fromkeys(item for value in values for item in value)))


def _prefix_rename(text):
    old, separator, _ = text.partition('=')
    if not separator or not old:
        raise argparse.ArgumentTypeError(
            f'must look like old.=new. (a name prefix in the file, then the one in the model), got {text!r}'
        )
    return text


def prefix_map(args):
    """--load_prefix_map as a dict {old prefix: new prefix}."""
    return dict(item.split('=', 1) for item in args.load_prefix_map or [])


def user_path(text):
    """A path option's value with a leading `~` made the home folder, as a shell does for a word of its
    own but not for `--opt=~/x` or a config file's value (which would make a folder named `~`)."""
    return os.path.expanduser(text)


def _name_part(text):
    if not text or any(c in text for c in '/\\') or text in ('.', '..'):
        raise argparse.ArgumentTypeError(f'must be a plain name without slashes, got {text!r}')
    return text


def registry_names(option):
    """The names registered for `option` ('task', 'model_type' or 'data_type'), read without torch."""
    import importlib

    from utils.errors import KilnError

    module_name, dict_name, path = REGISTRIES[option]
    try:
        return list(getattr(importlib.import_module(module_name), dict_name))
    except Exception as error:  # noqa: BLE001 - a broken registry file is the user's to fix: say which
        line = f' line {error.lineno}' if isinstance(error, SyntaxError) else ''
        raise KilnError(f'{path}{line}: {type(error).__name__}: {error}') from None


def loss_names():
    """The names in loss.py's LOSSES, read from its text (loss.py imports torch: --help and typos do not);
    None when LOSSES is not one dict of quoted names that nothing else in the file changes (then loss.py
    checks the name as the run starts)."""
    import ast

    try:
        with open(os.path.join(PROJECT, 'loss.py'), encoding='utf-8') as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    made = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, 'id', None) == 'LOSSES' for t in node.targets)
    ]
    if len(made) != 1 or not isinstance(made[0], ast.Dict) or _changes_losses(tree):
        return None
    keys = made[0].keys
    return [key.value for key in keys] if all(isinstance(key, ast.Constant) for key in keys) else None


def _changes_losses(tree):
    """Whether the module `tree` may change LOSSES after making it: any use of the name but its one
    definition, reading an entry (LOSSES[name], `in LOSSES`) or giving it to a function that only reads
    it (sorted, ...): LOSSES['x'] = ..., LOSSES |= ..., LOSSES.update(...), an alias."""
    import ast

    reading = {'sorted', 'list', 'set', 'tuple', 'len', 'did_you_mean'}
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, 'id', None) == 'LOSSES' for t in node.targets):
            allowed.update(id(t) for t in node.targets)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            allowed.add(id(node.value))
        elif isinstance(node, ast.Compare):
            allowed.update(id(c) for c in node.comparators)
        elif isinstance(node, ast.Call) and getattr(node.func, 'id', None) in reading:
            allowed.update(id(a) for a in node.args)
    names = [node for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == 'LOSSES']
    return any(id(node) not in allowed for node in names)


def parse_common_args(parser):
    """Options that training, evaluation and prediction share, so they cannot drift apart."""
    parser.add_argument(
        '--config',
        metavar='FILE',
        type=user_path,
        help='YAML or JSON file of options (e.g. a saved args.yaml); flags on the command line override it',
    )
    parser.add_argument(
        '--task',
        default='classify',
        help='the kind of problem, see TASKS in tasks/task_entry.py (classify, segment, ...)',
    )
    parser.add_argument(
        '--model_type',
        help='model name, see MODELS in model/model_entry.py, or timm:NAME for a timm backbone (the timm extra) '
        "(default: the task's own, e.g. small_cnn to classify)",
    )
    parser.add_argument(
        '--data_type',
        help="dataset name, see DATASETS in data/data_entry.py (default: the task's own, e.g. shapes to classify)",
    )
    parser.add_argument(
        '--save_prefix',
        type=_name_part,
        default='default',
        help='names the experiment folder in training, the result folder in evaluation',
    )
    parser.add_argument(
        '--checkpoints_dir',
        type=user_path,
        default=os.path.join(PROJECT, 'checkpoints'),
        help="where experiment folders are created (default: the project's checkpoints/, whatever the working folder)",
    )
    parser.add_argument(
        '--load_not_strict',
        action=argparse.BooleanOptionalAction,
        default=False,
        help='load only the tensors whose names and shapes match the model (load_match_dict)',
    )
    parser.add_argument(
        '--load_prefix_map',
        type=_prefix_rename,
        nargs='+',
        metavar='OLD=NEW',
        help='rename tensors in --load_model_path first, e.g. net.=  or  fc.=head. (the longest OLD that fits)',
    )
    parser.add_argument(
        '--val_list', type=user_path, help="list file for validation/evaluation (default: the dataset's own val split)"
    )
    parser.add_argument(
        '--data_root',
        type=user_path,
        default=os.path.join(PROJECT, 'data', 'generated'),
        help="where generated datasets are written (default: the project's data/generated/)",
    )
    parser.add_argument('--num_classes', type=_positive_int, help='default: what the dataset reports')
    parser.add_argument(
        '--ignore_index',
        type=count_at_least(0),
        help="segmentation: the mask value of pixels left out of the loss and the metrics (255: Pascal VOC's "
        "and Cityscapes' void), one no class has; default: none, every value is a class",
    )
    parser.add_argument(
        '--img_size',
        type=_image_side,
        help="images are resized to this side (default: the task's, e.g. 32 to classify)",
    )
    parser.add_argument(
        '--resize',
        choices=['squash', 'crop'],
        help='how an image becomes a square: squash (all of it, its aspect ratio lost) or crop (its aspect '
        "ratio kept: a centred square of --crop_pct of its shorter side, as ImageNet's resize 256 and crop "
        "224); default: the dataset's (squash for the generated shapes, crop for photos)",
    )
    parser.add_argument(
        '--crop_pct', type=_fraction, default=0.875, help='--resize crop: the share of the shorter side kept'
    )
    parser.add_argument(
        '--normalize',
        choices=['imagenet', 'kiln'],
        help="the pixel mean and std images are normalized with: ImageNet's (what pretrained backbones saw) or "
        "Kiln's (0.5, 0.25); default: imagenet for the tv_* and timm:* nets, else kiln",
    )
    parser.add_argument('--batch_size', type=_positive_int, default=128, help='images per step and process')
    parser.add_argument(
        '--num_workers',
        type=_non_negative_int,
        help='DataLoader worker processes for datasets read from disk (default: min(4, CPUs per '
        'process)); in-memory datasets are batched on the device without workers',
    )
    parser.add_argument('--gpus', type=int, nargs='+', help='GPU ids, e.g. --gpus 0 1 (default: GPU 0 if CUDA exists)')
    parser.add_argument('--cpu', action='store_true', help='run on the CPU even when a GPU exists')
    parser.add_argument(
        '--seed',
        type=_number(int, lambda v: True, 'an integer'),
        default=0,
        help='seeds python, numpy, torch, the data order and augmentation',
    )
    parser.add_argument(
        '--topk',
        type=_positive_int,
        default=3,
        help='k of the top-k accuracy (classify; left out with k classes or fewer, where it is always 1)',
    )
    parser.add_argument(
        '--amp',
        default='off',
        choices=['off', 'bf16', 'fp16'],
        help='mixed precision: autocast to bfloat16, or float16 with a gradient scaler',
    )
    parser.add_argument(
        '--channels_last', action='store_true', help='channels-last memory format (faster convs on GPU)'
    )
    parser.add_argument('--compile', action='store_true', help='torch.compile the model')
    parser.add_argument(
        '--compile_mode',
        default='default',
        choices=['default', 'reduce-overhead', 'max-autotune'],
        help='with --compile: reduce-overhead uses CUDA graphs (a GPU; pays off on long runs of fixed shapes), '
        'max-autotune searches kernels longer for big ones',
    )
    parser.add_argument(
        '--progress_bar',
        action=argparse.BooleanOptionalAction,
        help="default: where stderr is a terminal or PyCharm's console, not in log files",
    )
    parser.add_argument('--debug', action='store_true', help='show full tracebacks on errors')
    return parser


def parse_train_args(parser):
    """Training options on top of the common ones."""
    parser = parse_common_args(parser)
    parser.add_argument(
        '--train_list', type=user_path, help="list file for training (default: the dataset's own train split)"
    )
    parser.add_argument(
        '--augment',
        type=_augmentations,
        default='default',
        help='training augmentation: default (what the dataset declares), none, or a comma list of crop '
        '(a shift with reflected borders), resized_crop (RandomResizedCrop, see --crop_scale), hflip, vflip, '
        'color (--color_jitter), erase (random erasing, --erase_prob), mixup and cutmix (--mixup_alpha, '
        '--cutmix_alpha; classification)',
    )
    parser.add_argument(
        '--color_jitter',
        type=_fraction,
        default=0.4,
        help='color: brightness, contrast and saturation each scaled by a factor in 1 +- this',
    )
    parser.add_argument(
        '--erase_prob', type=_fraction, default=0.25, help='erase: the chance a picture has a box erased'
    )
    parser.add_argument('--mixup_alpha', type=_positive_float, default=0.8, help='mixup: lam ~ Beta(alpha, alpha)')
    parser.add_argument('--cutmix_alpha', type=_positive_float, default=1.0, help='cutmix: lam ~ Beta(alpha, alpha)')
    parser.add_argument(
        '--mix_prob', type=_fraction, default=1.0, help='mixup/cutmix: the chance a pair of samples is mixed'
    )
    parser.add_argument(
        '--mix_switch_prob',
        type=_fraction,
        default=0.5,
        help='with both mixup and cutmix: the chance a pair is mixed by cutmix',
    )
    parser.add_argument(
        '--ema_decay',
        type=_fraction,
        metavar='DECAY',
        help='keep an exponential moving average of the weights (e.g. 0.9998; warmed up as TensorFlow does): '
        'validation, best.pth, eval.py and predict.py use it',
    )
    parser.add_argument(
        '--crop_scale',
        type=_fraction,
        nargs=2,
        default=[0.08, 1.0],
        metavar=('MIN', 'MAX'),
        help="resized_crop: the share of the image's area a crop covers",
    )
    parser.add_argument(
        '--crop_ratio',
        type=_positive_float,
        nargs=2,
        default=[3 / 4, 4 / 3],
        metavar=('MIN', 'MAX'),
        help="resized_crop: the range of a crop's width / height (drawn log-uniformly)",
    )
    parser.add_argument(
        '--load_model_path',
        type=user_path,
        help='weights to start from (a checkpoint, an experiment folder for its '
        'best.pth, a state dict or .safetensors)',
    )
    parser.add_argument(
        '--pretrained_path',
        type=user_path,
        help='local ImageNet weights for the tv_* and timm:* models (never downloaded)',
    )
    parser.add_argument(
        '--freeze_to',
        type=int,
        metavar='INDEX',
        help="freeze the layer groups (the model's direct children) 0..INDEX at the start; "
        '-2 freezes all but the last (the head)',
    )
    parser.add_argument(
        '--freeze_batch_norms',
        action='store_true',
        help='with --freeze_to, freeze normalization layers too and keep their statistics fixed',
    )
    parser.add_argument(
        '--unfreeze_at_epoch',
        type=_positive_int,
        metavar='EPOCH',
        help='unfreeze everything when epoch EPOCH (counting from 1) begins',
    )
    parser.add_argument(
        '--unfrozen_lr_scale',
        type=_positive_float,
        help='with --freeze_to, learning rate of the groups frozen at the start, relative to --backbone_lr '
        '(or --lr; default 1)',
    )
    parser.add_argument('--head_lr', type=_positive_float, help='learning rate of the last layer group (default --lr)')
    parser.add_argument(
        '--backbone_lr', type=_positive_float, help='learning rate of all other layer groups (default --lr)'
    )
    parser.add_argument('--epochs', type=_positive_int, default=12, help='passes over the training data')
    parser.add_argument('--loss', help="loss name, see LOSSES in loss.py (default: the task's own)")
    parser.add_argument('--optimizer', default='adamw', choices=['sgd', 'adam', 'adamw'], help='torch.optim optimizer')
    parser.add_argument('--lr', type=_positive_float, default=3e-3, help='peak learning rate')
    parser.add_argument('--momentum', type=_non_negative_float, default=0.9, help='SGD momentum')
    parser.add_argument(
        '--weight_decay',
        type=_non_negative_float,
        default=5e-4,
        help='weight decay (decoupled from the gradient with adamw)',
    )
    parser.add_argument(
        '--scheduler',
        default='cosine',
        choices=['none', 'cosine', 'step', 'plateau'],
        help='learning-rate schedule: cosine (after --warmup_steps), step (every --lr_step_epochs), '
        'plateau (reduce when --monitor stalls), or none',
    )
    parser.add_argument(
        '--warmup_steps',
        type=_non_negative_int,
        default=0,
        help='cosine scheduler: linear warm-up over this many optimizer steps',
    )
    parser.add_argument('--lr_step_epochs', type=_positive_int, default=30, help='step scheduler: epochs per decay')
    parser.add_argument(
        '--lr_gamma', type=_positive_float, default=0.1, help='step and plateau schedulers: decay factor'
    )
    parser.add_argument(
        '--lr_patience',
        type=_non_negative_int,
        default=2,
        help='plateau scheduler: validations without improvement before the decay',
    )
    parser.add_argument(
        '--max_iteration', type=_positive_int, help='train for this many optimizer steps instead of --epochs'
    )
    parser.add_argument(
        '--valid_interval', type=_positive_int, help='validate every N optimizer steps (default: after every epoch)'
    )
    parser.add_argument(
        '--save_interval',
        type=_positive_int,
        help='also save a checkpoint every N optimizer steps (default: after every validation)',
    )
    parser.add_argument(
        '--grad_accum_steps',
        type=_positive_int,
        default=1,
        help='add up the gradients of N batches per optimizer step (batch size x N)',
    )
    parser.add_argument('--clip_grad_norm', type=_positive_float, help='clip the gradient norm to this value')
    parser.add_argument('--clip_grad_value', type=_positive_float, help='clip each gradient to [-value, value]')
    parser.add_argument(
        '--print_freq',
        type=_positive_int,
        default=20,
        help='print a line (running train loss, learning rate, images/s since the line before; and check for a '
        'non-finite loss) every N optimizer steps',
    )
    parser.add_argument(
        '--loggers',
        nargs='+',
        type=_logger_names,
        action=_Joined,
        default=['tensorboard'],
        help='experiment trackers: any of tensorboard, csv (metrics.csv), wandb (offline unless '
        'logged in), mlflow (a local store unless --mlflow_uri); wandb and mlflow are the '
        "'trackers' extra",
    )
    parser.add_argument(
        '--mlflow_uri',
        help='MLflow tracking URI (default: $MLFLOW_TRACKING_URI when set, else a local store in --checkpoints_dir)',
    )
    parser.add_argument('--wandb_project', default='kiln', help='W&B project name')
    parser.add_argument('--monitor', help="metric that picks the best checkpoint (default: the task's, e.g. val/acc)")
    parser.add_argument(
        '--monitor_mode',
        choices=['max', 'min'],
        help="default: min for a loss or error (mae, rmse, ...), else max (the task's for its own)",
    )
    parser.add_argument('--keep_last', type=_positive_int, default=1, help='keep the newest N checkpoints')
    parser.add_argument('--keep_best', type=_positive_int, default=1, help='keep the best N checkpoints by --monitor')
    parser.add_argument(
        '--early_stop_patience',
        type=_positive_int,
        help='stop after N validations without --monitor improving (default: never)',
    )
    parser.add_argument(
        '--early_stop_min_delta',
        type=_non_negative_float,
        default=0.0,
        help='the least change of --monitor that counts as an improvement',
    )
    parser.add_argument(
        '--resume',
        type=user_path,
        nargs='?',
        const=RESUME_LATEST,
        metavar='CHECKPOINT',
        help='continue this experiment from its newest checkpoint (or from CHECKPOINT: a .pth file, or an '
        'experiment folder for its newest); starts it when there is nothing to continue',
    )
    parser.add_argument(
        '--deterministic',
        action='store_true',
        help='use deterministic algorithms only (slower on GPU; makes repeated GPU runs bitwise equal)',
    )
    parser.add_argument(
        '--log_images',
        action=argparse.BooleanOptionalAction,
        default=True,
        help='log pictures of a validation batch (see --image_interval) to the trackers that keep them (not csv)',
    )
    parser.add_argument(
        '--image_interval',
        type=_non_negative_float,
        default=30.0,
        metavar='SECONDS',
        help='log validation pictures at most every SECONDS of training, and at the last validation '
        '(0: at every validation); drawing them costs more than a short epoch',
    )
    debug = parser.add_argument_group('debugging')
    debug.add_argument(
        '--fast_dev_run',
        action='store_true',
        help='2 training and 2 validation batches and one save in a throwaway folder, then evaluate '
        'and predict from that checkpoint: checks that everything runs, in seconds',
    )
    debug.add_argument(
        '--overfit_batches',
        type=_positive_int,
        metavar='N',
        help='train on the same N batches again and again (no shuffling, no augmentation) and validate '
        'on them: a model that can learn drives the train loss to ~0',
    )
    debug.add_argument(
        '--limit_train_batches',
        type=_count_or_fraction,
        metavar='N_OR_FRACTION',
        help='train on this many batches per epoch (an integer) or this fraction of them',
    )
    debug.add_argument(
        '--limit_val_batches',
        type=_count_or_fraction,
        metavar='N_OR_FRACTION',
        help='validate on this many batches (an integer) or this fraction of them',
    )
    debug.add_argument(
        '--profile',
        action='store_true',
        help='record a few training steps with torch.profiler: a trace for TensorBoard or Perfetto '
        'and a table of the top operators',
    )
    debug.add_argument(
        '--detect_anomaly',
        action='store_true',
        help='autograd anomaly mode: name the operation that made a NaN gradient (slow)',
    )
    return parser


def _add_output_dir(parser):
    """--output_dir, for eval.py and predict.py."""
    parser.add_argument(
        '--output_dir',
        type=user_path,
        help='where results go: <output_dir>/<experiment>/eval/... (predict.py: .../predict/...; default: in the '
        "checkpoint's experiment folder; give one when that folder is read-only or shared)",
    )
    return parser


def parse_test_args(parser):
    """Evaluation options on top of the common ones.

    Every option that decides the numbers defaults to what the checkpoint was trained with: --task,
    --model_type, --data_type, --data_root, --val_list, --num_classes, --ignore_index, --img_size, --resize,
    --crop_pct, --normalize, --topk, --amp, --channels_last (give one to change it; the defaults shown below
    are training's), and its loss and monitored metric.
    """
    parser = parse_common_args(parser)
    parser.set_defaults(task=None)
    parser._option_string_actions['--checkpoints_dir'].help = (
        "where a comparison of several checkpoints goes: <checkpoints_dir>/comparisons/ (default: the project's "
        'checkpoints/)'
    )
    parser.add_argument(
        '--load_model_path',
        type=user_path,
        nargs='+',
        metavar='CHECKPOINT',
        help='checkpoint(s) to evaluate: files, experiment folders (their best.pth) or quoted '
        'globs; with several, a comparison table is written too',
    )
    parser.add_argument('--viz_freq', type=_positive_int, default=10, help='save a picture every N batches')
    parser.add_argument(
        '--save_viz',
        action=argparse.BooleanOptionalAction,
        default=True,
        help='save the pictures (every --viz_freq batches)',
    )
    return _add_output_dir(parser)


NOT_USED_IN_PREDICTION = (
    'val_list',
    'seed',
    'topk',
    'checkpoints_dir',
    'data_root',
    'ignore_index',
)  # common options predict.py has no use for: a note


def parse_predict_args(parser):
    """Prediction options on top of the common ones; as in evaluation, every option that decides the
    numbers defaults to what the checkpoint was trained with: --task, --model_type, --data_type,
    --num_classes, --img_size, --resize, --crop_pct, --normalize, --amp, --channels_last (give one to
    change it; the defaults shown below are training's). --val_list, --seed, --topk, --checkpoints_dir
    and --data_root act in training and evaluation only (the results go beside the checkpoint, or into
    --output_dir)."""
    parser = parse_common_args(parser)
    parser.set_defaults(task=None)
    parser.add_argument(
        '--load_model_path',
        type=user_path,
        required=True,
        help='the checkpoint to predict with (or an experiment folder: its best.pth)',
    )
    parser.add_argument(
        '--input',
        type=user_path,
        required=True,
        help="a folder of images, one image, a quoted glob ('photos/*.jpg'), or a list file (first column: image)",
    )
    return _add_output_dir(parser)


def _config_to_argv(parser, path):
    """Turn a YAML/JSON config file (or a mapping: a checkpoint's saved options) into command-line tokens,
    so it is checked like flags are. Each value is checked against its option first, so a mistake names
    the file and the key; keys that another Kiln script takes (a training run's args.yaml given to
    eval.py) are left out."""
    if isinstance(path, dict):
        config, path = path, "the checkpoint's saved options"
    else:
        try:
            with open(path, encoding='utf-8-sig') as f:
                config = yaml.load(f, UniqueKeyLoader)  # JSON is a subset of YAML
        except FileNotFoundError:
            parser.error(f'--config {path}: no such file')
        except (OSError, ValueError, yaml.YAMLError) as error:
            parser.error(f'--config {path}: cannot read it as YAML or JSON ({str(error).splitlines()[0]})')
    if config is None:
        return []
    if not isinstance(config, dict):
        parser.error(f'--config {path}: expected a mapping of option: value, got {type(config).__name__}')
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    # a training run's options given to eval.py or predict.py: its load_model_path named the weights it
    # started from, not the checkpoint to evaluate
    training_record = 'epochs' in config and 'epochs' not in actions
    argv = []
    for key, value in config.items():
        if not isinstance(key, str):  # YAML reads on, yes, 1, null as no text
            parser.error(f'--config {path}: {key!r} is not an option name (YAML reads it as {type(key).__name__})')
        action = actions.get(key)
        if action is None and key not in ('config', 'help') and key in _kiln_option_names():
            continue  # another script's option: a saved args.yaml is a whole record
        if key == 'load_model_path' and training_record:
            continue
        if key in ('config', 'help'):
            parser.error(f'--config {path}: {key!r} cannot be set in a config file; give --{key} on the command line')
        if action is None:
            parser.error(f'--config {path}: unknown option {key!r}{did_you_mean(key, actions)}')
        if value is not None:  # null (a saved args.yaml's None): left to the command line and the defaults
            argv += _config_tokens(parser, action, value, f'--config {path}: {key}')
    return argv


YAML_BOOLEANS = {False: ('off', 'no', 'false', 'n'), True: ('on', 'yes', 'true', 'y')}  # YAML 1.1's spellings


def choice_read_as(action, value):
    """The one choice of `action` that YAML 1.1 reads as the bool `value` (`off` for --amp), or None."""
    spelled = [choice for choice in action.choices or () if str(choice).lower() in YAML_BOOLEANS[value]]
    return spelled[0] if len(spelled) == 1 else None


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last without a word)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        twice = next((key for index, key in enumerate(keys) if key in keys[:index]), None)
        if twice is not None:
            raise yaml.YAMLError(f'the key {twice!r} is given twice')
        return super().construct_mapping(node, deep)


class WrittenInt(int):
    """An int read from YAML that keeps the text it was written as (`written`)."""


class WrittenFloat(float):
    """A float read from YAML that keeps the text it was written as (`written`)."""


def _keeping_the_text(construct, number_type):
    """A YAML constructor of numbers that also keeps each one's text."""

    def construct_number(loader, node):
        number = number_type(construct(loader, node))
        number.written = node.value
        return number

    return construct_number


UniqueKeyLoader.add_constructor(
    'tag:yaml.org,2002:int', _keeping_the_text(yaml.SafeLoader.construct_yaml_int, WrittenInt)
)
UniqueKeyLoader.add_constructor(
    'tag:yaml.org,2002:float', _keeping_the_text(yaml.SafeLoader.construct_yaml_float, WrittenFloat)
)


def _config_tokens(parser, action, value, where):
    """The command-line tokens that give `action`'s option the config value `value`, checked as argparse
    would check them (a mistake is one line starting with `where`)."""
    flag = action.option_strings[0]
    turns_off = getattr(action, 'turns_off', False)
    if turns_off and value == NONE:  # none: turns off what a resumed run (or an earlier file) set
        return [f'{flag}={NONE}']
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            parser.error(f'{where}: expected true or false, got {value!r}')
        return [flag if value else f'--no-{flag[2:]}']
    if action.nargs == '?' and isinstance(value, bool):  # --resume: true is the flag alone
        return [flag] if value else []
    if isinstance(value, bool):  # YAML 1.1 reads an unquoted off/no/on/yes as a bool: --amp off is meant
        if choice_read_as(action, value) is None:
            parser.error(
                f'{where}: YAML read this value as {str(value).lower()} (unquoted yes, no, on and off are '
                f"true or false); quote the text, e.g. '{YAML_BOOLEANS[value][0]}'"
            )
        value = choice_read_as(action, value)
    if isinstance(value, dict) and action.nargs in ('+', '*'):  # {old: new} for --load_prefix_map
        value = [f'{old}={new}' for old, new in value.items()]
    # a number as it was written: the command line's reading of it, not YAML's (010 is 8, 2024_01 is 202401)
    values = [getattr(item, 'written', item) for item in (value if isinstance(value, list) else [value])]
    if action.nargs in (None, '?') and isinstance(value, (list, dict)):
        parser.error(f'{where}: expected one value, got {value!r}')
    if isinstance(action.nargs, int) and len(values) != action.nargs:
        parser.error(f'{where}: expected a list of {action.nargs} values (e.g. [0.5, 1]), got {value!r}')
    off = f', or {NONE} to turn it off' if turns_off else ''
    for item in values:
        try:
            converted = action.type(str(item)) if action.type else str(item)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as error:
            parser.error(f'{where}: {error or "invalid value"} ({item!r}){off}')
        if action.choices is not None and converted not in action.choices:
            parser.error(f'{where}: {item!r} is not one of {", ".join(map(str, action.choices))}{off}')
    if action.nargs in (None, '?'):
        return [f'{flag}={values[0]}']  # one token: a value starting with '-' is not read as a flag
    return [flag, *map(str, values)]


@functools.cache
def _kiln_option_names():
    """The option names of train.py, eval.py and predict.py together."""
    return {
        action.dest
        for add_args in (parse_train_args, parse_test_args, parse_predict_args)
        for action in add_args(KilnArgumentParser(add_help=False))._actions
    }


def _check_names(args):
    """A KilnError (one line; a traceback with --debug) when --loss, --task, --model_type or --data_type
    names nothing registered (shared: every torchrun rank finds it, rank 0 says it)."""
    from utils.errors import KilnError

    loss = getattr(args, 'loss', None)
    names = loss_names() if loss is not None else None
    if names is not None and loss not in names:
        raise KilnError(
            f'unknown --loss {loss!r}{did_you_mean(loss, names)}; choose one of: {", ".join(sorted(names))} (or '
            f'add it to LOSSES in loss.py)'
        )
    for option in REGISTRIES:
        value = getattr(args, option, None)
        if option == 'model_type' and str(value).startswith('timm:'):
            continue  # a timm backbone: timm knows its names (model/timm_nets)
        if value is not None:
            names = registry_names(option)
            if value not in names:
                raise KilnError(
                    f'unknown --{option} {value!r}{did_you_mean(value, names)}; choose one of: '
                    f'{", ".join(sorted(names))} (or register it in {REGISTRIES[option][2]})'
                )


def _config_and_flags(parser, argv, base_config):
    """The tokens `parser` reads: the `base_config` file's (or mapping's), the --config file's, then `argv`."""
    config_parser = KilnArgumentParser(add_help=False)
    config_parser.add_argument('--config', type=user_path, action='append')
    config_paths = config_parser.parse_known_args(argv)[0].config or [None]
    if len(config_paths) > 1:  # argparse keeps the last: the others' options were dropped without a word
        parser.error(
            f'--config is given {len(config_paths)} times ({", ".join(config_paths)}): give one file, and the '
            f'options to change as flags after it'
        )
    config_path = config_paths[0]
    return [token for path in (base_config, config_path) if path for token in _config_to_argv(parser, path)] + argv


_PARSERS = {}  # add_args -> the parser parse_args built with it last (building one takes milliseconds)
ENTRY_SCRIPTS = {'parse_train_args': 'train.py', 'parse_test_args': 'eval.py', 'parse_predict_args': 'predict.py'}


def command_words(argv=None):
    """`argv` as a command line's words: sys.argv[1:] when None; numbers and paths a caller in Python gives
    (`train.main(['--epochs', 2, '--data_root', Path(...)])`) become their text."""
    return sys.argv[1:] if argv is None else [str(word) for word in argv]


def parse_args(add_args, argv=None, base_config=None):
    """Parse `argv` with the options added by `add_args`, applying `--config FILE` first.

    `base_config` (a resumed run's options: its checkpoint's, or its args.yaml) comes before even that.
    Registered names are checked.
    """
    # the command that made these options, to record: the script's own, or the words given to its main()
    script = ENTRY_SCRIPTS.get(add_args.__name__)
    given = argv is None or [str(word) for word in argv] == sys.argv[1:]  # the script's own command line
    command = sys.argv if given else [os.path.join(PROJECT, script) if script else sys.argv[0], *argv]
    argv = command_words(argv)
    epilog = (
        f'An option that takes a value and whose default is unset takes {NONE}: back to that default (off, '
        f"the task's choice, or in eval.py and predict.py the checkpoint's), e.g. to undo what a --config set."
    )
    parser = _PARSERS[add_args] = add_args(KilnArgumentParser(description=add_args.__doc__, epilog=epilog))
    args = parser.parse_args(_config_and_flags(parser, argv, base_config))
    for name in ('crop_scale', 'crop_ratio'):
        low, high = getattr(args, name, None) or (0, 0)
        if low > high:
            parser.error(f'argument --{name}: MIN {low:g} is above MAX {high:g}')
    _check_names(args)
    args.command = [str(word) for word in command]
    return args


SET = 'set'  # in ACTS_ONLY_WITH: the deciding option acts when it is set at all (not None)
# option -> (the option that decides whether it acts, the values of that one it acts with; 'a and b': both;
# an on/off option: True; a list option (--loggers): a value it must hold)
ACTS_ONLY_WITH = {
    'lr_step_epochs': ('scheduler', ('step',)),
    'lr_gamma': ('scheduler', ('step', 'plateau')),
    'lr_patience': ('scheduler', ('plateau',)),
    'warmup_steps': ('scheduler', ('cosine',)),
    'momentum': ('optimizer', ('sgd',)),
    'crop_pct': ('resize', ('crop',)),
    'crop_scale': ('augment', ('resized_crop',)),
    'crop_ratio': ('augment', ('resized_crop',)),
    'color_jitter': ('augment', ('color',)),
    'erase_prob': ('augment', ('erase',)),
    'mixup_alpha': ('augment', ('mixup',)),
    'cutmix_alpha': ('augment', ('cutmix',)),
    'mix_prob': ('augment', ('mixup', 'cutmix')),
    'mix_switch_prob': ('augment', ('mixup and cutmix',)),
    'compile_mode': ('compile', (True,)),
    'freeze_batch_norms': ('freeze_to', (SET,)),
    'unfreeze_at_epoch': ('freeze_to', (SET,)),
    'unfrozen_lr_scale': ('freeze_to', (SET,)),
    'early_stop_min_delta': ('early_stop_patience', (SET,)),
    'ignore_index': ('task', ('segment',)),
    'load_not_strict': ('load_model_path', (SET,)),
    'load_prefix_map': ('load_model_path', (SET,)),
    'image_interval': ('log_images', (True,)),
    'log_images': ('loggers', ('tensorboard', 'wandb', 'mlflow')),  # those that keep pictures: trackers' keeps_pictures
    'mlflow_uri': ('loggers', ('mlflow',)),
    'wandb_project': ('loggers', ('wandb',)),
}
DATASET_DECIDES = ('augment', 'resize')  # unset or 'default': the dataset's choice, not judged
MIX_NAMES = ('mixup', 'cutmix')  # data/augment.py's MIXES: they mix pairs of samples in a batch


def ignored_options(options, argv):
    """Notes, one line each, on the options given on the command line (`argv`) that this run (`options`)
    ignores: ACTS_ONLY_WITH, an augmentation named twice, mixing in batches of one. Notes, not errors: a
    --config or a sweep's grid may set them for runs they do not act in. An --augment default or an unset
    --resize is the dataset's: not judged here (train.py gives the dataset's, see Trainer.judged_options)."""
    given, notes = set(vars(_quiet_parser(parse_train_args).parse_args(argv))), []
    for name, (setting, needs) in ACTS_ONLY_WITH.items():
        value = getattr(options, setting, None)
        if name not in given or (setting in DATASET_DECIDES and value in (None, 'default')):
            continue
        if not any(_acts_with(setting, value, need) for need in needs):
            notes.append(f'--{name} acts with {_needed(setting, needs, value)}: this run ignores it')
    if 'loss' in given and options.loss and _task_has_own_loss(options.task):
        notes.append(f'--task {options.task} computes a loss of its own: this run ignores --loss')
    for name in ('limit_train_batches', 'limit_val_batches'):
        if name in given and getattr(options, 'overfit_batches', None):
            notes.append(f'--overfit_batches decides the batches trained and validated: this run ignores --{name}')
    if 'augment' in given and getattr(options, 'overfit_batches', None) and _augment_names(options.augment):
        notes.append('--overfit_batches trains on its batches as they are: this run ignores --augment')
    if 'epochs' in given and getattr(options, 'max_iteration', None) and not getattr(options, 'fast_dev_run', False):
        notes.append(f'--max_iteration {options.max_iteration} decides how long it trains: this run ignores --epochs')
    if 'unfreeze_at_epoch' in given and options.unfreeze_at_epoch == 1 and options.freeze_to is not None:
        notes.append('--unfreeze_at_epoch 1 unfreezes before the first step: --freeze_to keeps no layer frozen')
    names = _augment_names(getattr(options, 'augment', 'default'))
    twice = [name for index, name in enumerate(names) if name in names[:index]]
    if twice and 'augment' in given:
        notes.append(f'--augment names {twice[0]} twice: it is applied twice')
    mixes = ' and '.join(name for name in names if name in MIX_NAMES)
    if mixes and options.batch_size == 1 and given & {'augment', 'batch_size'}:
        notes.append(f'batches of 1 leave {mixes} nothing to mix (a sample is mixed with another of its batch)')
    return notes


def _task_has_own_loss(task):
    """Whether `task`'s loss is its own rather than a --loss (its default_loss is None; imports torch)."""
    from tasks.task_entry import task_class

    return task_class(task).default_loss is None


def _acts_with(setting, value, need):
    """Whether option `setting`, at `value`, is as an ACTS_ONLY_WITH `need` asks."""
    if need == SET:
        return value is not None
    if setting == 'augment':
        return set(need.split(' and ')) <= set(_augment_names(value))
    return need in value if isinstance(value, (list, tuple)) else value == need


def _needed(setting, needs, value):
    """What an ACTS_ONLY_WITH option needs, and what this run has instead, in words."""
    if needs in ((SET,), (True,)):
        return f'--{setting} only'
    shown = ' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value
    need = ' or '.join(needs)
    where = f'{need} in --{setting}' if setting in ('augment', 'loggers') else f'--{setting} {need}'
    return f'{where} only, not {shown}'


def _augment_names(value):
    """The augmentation names of an --augment value ('none', 'default' and the dataset's: none known)."""
    return [] if value in ('none', 'default') else value.split(',')


def _quiet_parser(add_args):
    """A parser of `add_args`'s options that records only the options its words set: no defaults."""
    parser = add_args(KilnArgumentParser(add_help=False))
    parser._defaults.clear()
    for action in parser._actions:
        action.default, action.required = argparse.SUPPRESS, False
    return parser


def option_defaults(add_args):
    """{name: default value} of the options `add_args` adds (reusing the parser of the last parse_args)."""
    parser = _PARSERS.get(add_args) or add_args(KilnArgumentParser())
    return vars(parser.parse_args([]))


def given_options(add_args, argv, config=True):
    """The names of the options that `argv` sets, by a flag or (unless not `config`) through its --config
    file (a value that equals the default counts as given: it was asked for)."""
    parser = _quiet_parser(add_args)
    return set(vars(parser.parse_args(_config_and_flags(parser, list(argv), None) if config else list(argv))))


def resolve(args, **changes):
    """The options a run computes with, read-only: `args` with `changes` (PATH_OPTIONS made absolute), and,
    for the options left unset, what the task decides (TASK_DEFAULTS: model, dataset, loss, image size,
    monitor). The one place these defaults are decided, for train.py, eval.py, predict.py and sweep.py.
    Imports the task's module (and so torch) only when an option is unset."""
    options = with_absolute_paths(Options.of(args, **changes))
    unset = [name for name in TASK_DEFAULTS if name in vars(options) and getattr(options, name) is None]
    options = options.replace(task=options.task or 'classify')
    if unset:
        from tasks.task_entry import task_class

        task = task_class(options.task)
        lists = bool(getattr(options, 'train_list', None) or options.val_list)
        values = {name: getattr(task, TASK_DEFAULTS[name]) for name in unset}
        if 'monitor_mode' in values and 'monitor' not in unset:  # a --monitor of the user's: its own direction
            values['monitor_mode'] = monitor_mode_of(options.monitor, task)
        if 'data_type' in values:
            values['data_type'] = values['data_type'][lists]  # without / with list files
        options = options.replace(**values)
    if 'normalize' in vars(options) and options.normalize is None:  # as the backbone's pretrained weights expect
        imagenet = options.model_type.startswith(('tv_', 'timm:'))
        options = options.replace(normalize='imagenet' if imagenet else 'kiln')
    return options


# options naming one file or folder, saved with a run: made absolute (eval.py's several checkpoints stay as given)
PATH_OPTIONS = ('train_list', 'val_list', 'data_root', 'load_model_path', 'pretrained_path')


def with_absolute_paths(options):
    """`options` (Options) with its list files, data root and weight files as absolute paths: saved with
    the run (args.yaml, reproduce.json), they still name the same files from another working folder, and
    `a/train.txt` and its absolute path are the same option."""
    paths = {name: getattr(options, name, None) for name in PATH_OPTIONS}
    return options.replace(
        **{name: os.path.abspath(os.path.expanduser(p)) for name, p in paths.items() if isinstance(p, str)}
    )


def changed_options(saved, options, unset_matches=True):
    """The names of the options a resume may not change whose values in `options` differ from a run's
    saved ones (its args.yaml); options left unset (None: to the task, or to the run resumed) match
    whatever the run has, unless not `unset_matches` (`options` resolved, a whole command that says what
    the run is: a sweep's; FILLED_BY_DATA still match). Paths compare as absolute ones (an earlier Kiln
    saved them as given)."""
    saved = vars(with_absolute_paths(Options.of(argparse.Namespace(**saved))))
    options = with_absolute_paths(Options.of(options))
    fixed = set(vars(options)) - set(RESUME_CHANGEABLE + NOT_SAVED + DERIVED)
    return sorted(
        name
        for name in fixed
        if getattr(options, name) != saved.get(name)
        and (getattr(options, name) is not None or not unset_matches and name not in FILLED_BY_DATA)
    )


# words of a metric's name that make it better lower: errors and distances by their usual names
MINIMIZED_WORDS = {'err', 'mae', 'mse', 'rmse', 'msle', 'mape', 'nll', 'perplexity', 'ppl', 'wer', 'cer', 'fid', 'eer'}


def monitor_mode_of(metric, task):
    """The direction a --monitor metric improves in: the task's mode for its own monitor; 'min' for the
    task's `minimized` metrics, losses, errors and the usual names of errors (MINIMIZED_WORDS: mae,
    rmse, ...); else 'max' (accuracy, IoU, mAP, ...)."""
    if metric == task.monitor:
        return task.monitor_mode
    name = metric.split('/')[-1]
    words = set(re.split(r'[^a-z0-9]+', name.lower()))
    if name in task.minimized or 'loss' in name or 'error' in name or words & MINIMIZED_WORDS:
        return 'min'
    return 'max'


def experiment_folder(options):
    """The experiment folder of a training run with resolved `options`:
    `<checkpoints_dir>/<model_type>_<data_type>_<save_prefix>`."""
    model = options.model_type.replace(':', '-')  # timm:convnext_tiny -> timm-convnext_tiny
    return os.path.join(options.checkpoints_dir, f'{model}_{options.data_type}_{options.save_prefix}')


def inherit(args, given, trained_with):
    """eval.py's and predict.py's options: those of INHERITED not `given` (or given as none) come from the
    checkpoint's training run (`trained_with`, its saved options), then from the task (see resolve)."""
    trained_with = as_trained(trained_with)
    if trained_with and not os.path.isdir(trained_with.get('data_root') or ''):  # trained on another machine:
        trained_with = {k: v for k, v in trained_with.items() if k != 'data_root'}  # not made there, but here
    inherited = {  # `--X none` is back to the default, which for these is the checkpoint's value
        name: trained_with[name]
        if name in trained_with and (name not in given or getattr(args, name, None) is None)
        else getattr(args, name, None)
        for name in INHERITED
    }
    return resolve(args, **inherited)


def as_trained(saved):
    """A checkpoint's saved options, with what a Kiln before an option computed with where it saved none
    (--normalize: Kiln's mean and std)."""
    return {'normalize': 'kiln', **saved} if saved else saved


def saved_options(args):
    """The options worth keeping with a run (args.txt, args.yaml, checkpoints): all but how it was started."""
    return {k: v for k, v in vars(args).items() if k not in NOT_SAVED}


class Options(argparse.Namespace):
    """A run's resolved options: read-only once made, so no part of a run can change what another sees."""

    @classmethod
    def of(cls, namespace, **changes):
        """Resolved options from a parsed namespace, with `changes` applied."""
        options = cls.__new__(cls)
        options.__dict__.update(vars(namespace), **changes)
        return options

    def replace(self, **changes):
        """A copy with `changes` applied."""
        return Options.of(self, **changes)

    def __setattr__(self, name, value):
        raise AttributeError(f'options are read-only once resolved (tried to set {name}); use .replace()')
