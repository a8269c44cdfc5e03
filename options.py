"""Command-line options shared by train.py and eval.py, and the folders they write to.

Precedence: built-in defaults < `--config FILE` (YAML or JSON) < flags on the command line.
Every run saves its options twice: `args.txt` for people and `args.yaml`, which can be given
back with `--config`. This module imports no torch, so `--help` answers at once.
"""
import argparse
import contextlib
import glob
import os
import sys

import yaml

from utils.errors import KilnError

ARGS_TXT = 'args.txt'
ARGS_YAML = 'args.yaml'
NOT_SAVED = ('config', 'debug', 'resume')  # how a run was started, not what it is
RESUME_LATEST = 'last'  # --resume without a path
LAST_CHECKPOINT = 'last.pth'
BEST_CHECKPOINT = 'best.pth'
EVAL_FOLDER = 'eval'  # evaluation results go to <experiment>/eval/<name>/
DERIVED = ('model_dir', 'result_dir', 'resume_from')  # computed from the options: shown in args.txt, not in args.yaml


class KilnArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) with exit code 2."""

    def error(self, message):
        self.exit(2, f'error: {message} (see --help)\n')


def _positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f'must be a positive integer, got {text}')
    return value


def _non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f'must be 0 or more, got {text}')
    return value


def _positive_float(text):
    value = float(text)
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f'must be a positive number, got {text}')
    return value


def _non_negative_float(text):
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f'must be 0 or more, got {text}')
    return value


def _prefix_rename(text):
    old, separator, new = text.partition('=')
    if not separator or not old:
        raise argparse.ArgumentTypeError(f'must look like old.=new. (a name prefix in the file, then the one '
                                         f'in the model), got {text!r}')
    return text


def prefix_map(args):
    """--load_prefix_map as a dict {old prefix: new prefix}."""
    return dict(item.split('=', 1) for item in args.load_prefix_map or [])


def _name_part(text):
    if not text or any(c in text for c in '/\\') or text in ('.', '..'):
        raise argparse.ArgumentTypeError(f'must be a plain name without slashes, got {text!r}')
    return text


def parse_common_args(parser):
    """Options that training and evaluation share, so the two cannot drift apart."""
    parser.add_argument('--config', metavar='FILE', help='YAML or JSON file of options (e.g. a saved args.yaml); '
                        'flags on the command line override it')
    parser.add_argument('--task', default='classify', choices=['classify', 'segment'],
                        help='picks the Trainer/Evaluator pair (TRAINERS in train.py, EVALUATORS in eval.py)')
    parser.add_argument('--model_type', default='small_cnn', help='model name, see MODELS in model/model_entry.py')
    parser.add_argument('--data_type', default='shapes', help='dataset name, see DATASETS in data/data_entry.py')
    parser.add_argument('--save_prefix', type=_name_part, default='default',
                        help='names the experiment folder in training, the result folder in evaluation')
    parser.add_argument('--checkpoints_dir', default='checkpoints', help='where experiment folders are created')
    parser.add_argument('--load_not_strict', action=argparse.BooleanOptionalAction, default=False,
                        help='load only the tensors whose names and shapes match the model (load_match_dict)')
    parser.add_argument('--load_prefix_map', type=_prefix_rename, nargs='+', metavar='OLD=NEW',
                        help='rename tensors in --load_model_path first, e.g. net.=  or  fc.=head.')
    parser.add_argument('--val_list', help='list file of "image_path label" lines for validation/evaluation '
                        '(default: the dataset\'s own val split)')
    parser.add_argument('--data_root', default='data/generated', help='where generated datasets are written')
    parser.add_argument('--num_classes', type=_positive_int, help='default: what the dataset reports')
    parser.add_argument('--img_size', type=_positive_int, default=32, help='images are resized to this side')
    parser.add_argument('--batch_size', type=_positive_int, default=128)
    parser.add_argument('--num_workers', type=_non_negative_int,
                        help='DataLoader worker processes (default: 0 for in-memory datasets, else min(4, CPUs per process))')
    parser.add_argument('--gpus', type=int, nargs='+', help='GPU ids, e.g. --gpus 0 1 (default: GPU 0 if CUDA exists)')
    parser.add_argument('--cpu', action='store_true', help='run on the CPU even when a GPU exists')
    parser.add_argument('--seed', type=int, default=0, help='seeds python, numpy, torch and DataLoader workers')
    parser.add_argument('--topk', type=_positive_int, default=3, help='k of the top-k accuracy')
    parser.add_argument('--amp', default='off', choices=['off', 'bf16', 'fp16'],
                        help='mixed precision: autocast to bfloat16, or float16 with a gradient scaler')
    parser.add_argument('--channels_last', action='store_true', help='channels-last memory format (faster convs on GPU)')
    parser.add_argument('--compile', action='store_true', help='torch.compile the model')
    parser.add_argument('--progress_bar', action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument('--debug', action='store_true', help='show full tracebacks on errors')
    return parser


def parse_train_args(parser):
    """Training options on top of the common ones."""
    parser = parse_common_args(parser)
    parser.add_argument('--train_list', help='list file for training (default: the dataset\'s own train split)')
    parser.add_argument('--load_model_path', help='weights to start from (a checkpoint, state dict or .safetensors)')
    parser.add_argument('--pretrained_path', help='local ImageNet weights for the tv_* models (never downloaded)')
    parser.add_argument('--freeze_to', type=int, metavar='INDEX',
                        help='freeze the layer groups (the model\'s direct children) 0..INDEX at the start; '
                        '-2 freezes all but the last (the head)')
    parser.add_argument('--freeze_batch_norms', action='store_true',
                        help='with --freeze_to, freeze normalization layers too and keep their statistics fixed')
    parser.add_argument('--unfreeze_at_epoch', type=_positive_int, metavar='EPOCH',
                        help='unfreeze everything when epoch EPOCH (counting from 1) begins')
    parser.add_argument('--unfrozen_lr_scale', type=_positive_float, default=1.0,
                        help='learning rate of unfrozen groups, relative to --backbone_lr (or --lr)')
    parser.add_argument('--head_lr', type=_positive_float, help='learning rate of the last layer group (default --lr)')
    parser.add_argument('--backbone_lr', type=_positive_float,
                        help='learning rate of all other layer groups (default --lr)')
    parser.add_argument('--epochs', type=_positive_int, default=12)
    parser.add_argument('--loss', default='cross_entropy', help='loss name, see LOSSES in loss.py')
    parser.add_argument('--optimizer', default='adamw', choices=['sgd', 'adam', 'adamw'])
    parser.add_argument('--lr', type=_positive_float, default=3e-3, help='peak learning rate')
    parser.add_argument('--momentum', type=_non_negative_float, default=0.9, help='SGD momentum')
    parser.add_argument('--weight_decay', type=_non_negative_float, default=5e-4)
    parser.add_argument('--scheduler', default='cosine', choices=['none', 'cosine', 'step', 'plateau'],
                        help='learning-rate schedule: cosine (after --warmup_steps), step (every --lr_step_epochs), '
                        'plateau (reduce when --monitor stalls), or none')
    parser.add_argument('--warmup_steps', type=_non_negative_int, default=0,
                        help='cosine scheduler: linear warm-up over this many optimizer steps')
    parser.add_argument('--lr_step_epochs', type=_positive_int, default=30, help='step scheduler: epochs per decay')
    parser.add_argument('--lr_gamma', type=_positive_float, default=0.1,
                        help='step and plateau schedulers: decay factor')
    parser.add_argument('--lr_patience', type=_non_negative_int, default=2,
                        help='plateau scheduler: validations without improvement before the decay')
    parser.add_argument('--max_iteration', type=_positive_int,
                        help='train for this many optimizer steps instead of --epochs')
    parser.add_argument('--valid_interval', type=_positive_int,
                        help='validate every N optimizer steps (default: after every epoch)')
    parser.add_argument('--save_interval', type=_positive_int,
                        help='also save a checkpoint every N optimizer steps (default: after every validation)')
    parser.add_argument('--grad_accum_steps', type=_positive_int, default=1,
                        help='add up the gradients of N batches per optimizer step (batch size x N)')
    parser.add_argument('--clip_grad_norm', type=_positive_float, help='clip the gradient norm to this value')
    parser.add_argument('--clip_grad_value', type=_positive_float, help='clip each gradient to [-value, value]')
    parser.add_argument('--print_freq', type=_positive_int, default=20,
                        help='print a line (and check for stops) every N optimizer steps')
    parser.add_argument('--tensorboard', action=argparse.BooleanOptionalAction, default=True,
                        help='write TensorBoard curves and images')
    parser.add_argument('--monitor', help='metric that picks the best checkpoint (default val/acc, val/miou to segment)')
    parser.add_argument('--monitor_mode', default='max', choices=['max', 'min'])
    parser.add_argument('--keep_last', type=_positive_int, default=1, help='keep the newest N checkpoints')
    parser.add_argument('--keep_best', type=_positive_int, default=1, help='keep the best N checkpoints by --monitor')
    parser.add_argument('--early_stop_patience', type=_positive_int,
                        help='stop after N validations without --monitor improving (default: never)')
    parser.add_argument('--early_stop_min_delta', type=_non_negative_float, default=0.0,
                        help='the least change of --monitor that counts as an improvement')
    parser.add_argument('--resume', nargs='?', const=RESUME_LATEST, metavar='CHECKPOINT',
                        help='continue this experiment from its last checkpoint (or from CHECKPOINT); '
                        'starts it when there is nothing to continue')
    parser.add_argument('--deterministic', action='store_true',
                        help='use deterministic algorithms only (slower on GPU; makes resumed runs bitwise exact)')
    parser.add_argument('--log_images', action=argparse.BooleanOptionalAction, default=True,
                        help='write image grids to TensorBoard at every validation')
    return parser


def parse_test_args(parser):
    """Evaluation options on top of the common ones.

    The model, dataset and image size default to what the checkpoint was trained with.
    """
    parser = parse_common_args(parser)
    parser.set_defaults(task=None, model_type=None, data_type=None, img_size=None)
    parser.add_argument('--load_model_path', nargs='+', metavar='CHECKPOINT',
                        help='checkpoint(s) to evaluate: files, experiment folders (their best.pth) or quoted '
                        'globs; with several, a comparison table is written too')
    parser.add_argument('--viz_freq', type=_positive_int, default=10, help='save a picture every N batches')
    parser.add_argument('--save_viz', action=argparse.BooleanOptionalAction, default=True)
    return parser


def parse_predict_args(parser):
    """Prediction options on top of the common ones; like evaluation, the model, task and image
    size default to what the checkpoint was trained with."""
    parser = parse_common_args(parser)
    parser.set_defaults(task=None, model_type=None, data_type=None, img_size=None)
    parser.add_argument('--load_model_path', required=True, help='the checkpoint to predict with')
    parser.add_argument('--input', required=True, help='a folder of images, or a list file (first column: image)')
    return parser


def _config_to_argv(parser, path):
    """Turn a YAML/JSON config file into command-line tokens, so it is checked like flags are."""
    try:
        with open(path) as f:
            config = yaml.safe_load(f)  # JSON is a subset of YAML
    except FileNotFoundError:
        parser.error(f'--config {path}: no such file')
    except (OSError, ValueError, yaml.YAMLError) as error:
        parser.error(f'--config {path}: cannot read it as YAML or JSON ({str(error).splitlines()[0]})')
    if config is None:
        return []
    if not isinstance(config, dict):
        parser.error(f'--config {path}: expected a mapping of option: value, got {type(config).__name__}')
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    argv = []
    for key, value in config.items():
        action = actions.get(key)
        if action is None or key in ('config', 'help'):
            parser.error(f'--config {path}: unknown option {key!r}')
        flag = action.option_strings[0]
        if value is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f'--no-{flag[2:]}')
        elif action.nargs == 0:  # store_true
            if value:
                argv.append(flag)
        elif isinstance(value, list):
            argv += [flag] + [str(v) for v in value]
        else:
            argv += [flag, str(value)]
    return argv


def parse_args(add_args, argv=None, base_config=None):
    """Parse `argv` with the options added by `add_args`, applying `--config FILE` first.

    `base_config` (a resumed run's args.yaml) comes before even that.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = add_args(KilnArgumentParser(description=add_args.__doc__))
    config_parser = KilnArgumentParser(add_help=False)
    config_parser.add_argument('--config')
    config_path = config_parser.parse_known_args(argv)[0].config
    config_argv = [token for path in (base_config, config_path) if path for token in _config_to_argv(parser, path)]
    return parser.parse_args(config_argv + argv)


def save_args(args, folder):
    """Write the options to `folder` as args.txt (for people) and args.yaml (for --config)."""
    shown = {k: v for k, v in vars(args).items() if k not in NOT_SAVED}
    with open(os.path.join(folder, ARGS_TXT), 'w') as f:
        f.write('# ' + ' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:]) + '\n')
        width = max(map(len, shown))
        f.writelines(f'{k:<{width}} : {v}\n' for k, v in sorted(shown.items()))
    with open(os.path.join(folder, ARGS_YAML), 'w') as f:
        yaml.safe_dump({k: v for k, v in shown.items() if k not in DERIVED}, f, sort_keys=True)


def create_run_folder(folder, args, what_to_change):
    """Create a new run folder and save the options in it; an existing one is a KilnError saying `what_to_change`."""
    if os.path.exists(folder):
        raise KilnError(f'{folder} already exists; {what_to_change}')
    try:
        os.makedirs(folder)
    except OSError as error:
        raise KilnError(f'cannot create {folder} ({error.strerror}); check --checkpoints_dir') from None
    save_args(args, folder)


def prepare_train_args(argv=None):
    """Parse training options, create the experiment folder and save the options in it.

    The folder is `<checkpoints_dir>/<model_type>_<data_type>_<save_prefix>` (args.model_dir);
    an existing one is never reused or overwritten, except by `--resume`, which continues the
    run in it: its saved options apply, and flags given now override them. args.resume_from
    is the checkpoint to continue from (None when there is nothing to continue yet).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(parse_train_args, argv)
    args.model_dir = os.path.join(args.checkpoints_dir, f'{args.model_type}_{args.data_type}_{args.save_prefix}')
    resume_from = _checkpoint_to_resume(args)
    if resume_from:
        folder = os.path.dirname(resume_from) or os.curdir
        saved = os.path.join(folder, ARGS_YAML)
        if not os.path.isfile(saved):
            raise KilnError(f'{resume_from} has no {ARGS_YAML} beside it; --resume needs the checkpoint '
                            f'inside its experiment folder (to start a new run from its weights, use --load_model_path)')
        args = parse_args(parse_train_args, argv, base_config=saved)
        args.model_dir, args.resume_from = folder, resume_from
        return args
    args.resume_from = None
    if args.resume and os.path.isdir(args.model_dir):
        print(f'{args.model_dir} holds no checkpoint yet; starting the run in it')
        save_args(args, args.model_dir)
        return args
    create_run_folder(args.model_dir, args, 'choose a new --save_prefix, add --resume to continue that run, '
                       'or move that folder away')
    return args


def _checkpoint_to_resume(args):
    """The checkpoint --resume points to; None without --resume or when the run has none yet."""
    if not args.resume:
        return None
    if args.resume != RESUME_LATEST:
        if not os.path.isfile(args.resume):
            raise KilnError(f'--resume {args.resume}: no such checkpoint file; give an existing .pth file, '
                            f'or --resume alone for the experiment\'s last checkpoint')
        return args.resume
    last = os.path.join(args.model_dir, LAST_CHECKPOINT)
    if os.path.isfile(last):
        return last
    others = sorted(name for name in os.listdir(args.model_dir) if name.endswith('.pth')) \
        if os.path.isdir(args.model_dir) else []
    if others:
        raise KilnError(f'{args.model_dir} has no {LAST_CHECKPOINT}; choose a checkpoint to continue from with '
                        f'--resume {os.path.join(args.model_dir, others[-1])}')
    return None


def checkpoints_to_evaluate(args):
    """The checkpoint files --load_model_path names, in order: files as they are, experiment folders
    as their best.pth, globs (e.g. 'checkpoints/*/best.pth') expanded."""
    if not args.load_model_path:
        raise KilnError('no checkpoint to evaluate; give --load_model_path PATH (e.g. checkpoints/<experiment>/best.pth)')
    paths = []
    for item in args.load_model_path:
        if glob.has_magic(item):
            found = sorted(glob.glob(item))
            if not found:
                raise KilnError(f'--load_model_path {item} matches no file')
            paths += [os.path.join(p, BEST_CHECKPOINT) if os.path.isdir(p) else p for p in found]
        else:
            paths.append(os.path.join(item, BEST_CHECKPOINT) if os.path.isdir(item) else item)
    for path in paths:
        if not os.path.isfile(path):
            raise KilnError(f'checkpoint {path} does not exist; check --load_model_path')
    return paths


def evaluated_list_name(args):
    """What result folders call the evaluated list: the --val_list file name, or `val` for the default split."""
    return os.path.splitext(os.path.basename(args.val_list))[0] if args.val_list else 'val'


def result_folder(args, checkpoint):
    """Where evaluating `checkpoint` writes: `<its folder>/eval/<checkpoint>_<list>_<save_prefix>`
    (<list>: see evaluated_list_name)."""
    checkpoint_name = os.path.splitext(os.path.basename(checkpoint))[0]
    return os.path.join(os.path.dirname(checkpoint), EVAL_FOLDER,
                        f'{checkpoint_name}_{evaluated_list_name(args)}_{args.save_prefix}')


def prepare_test_args(argv=None, checkpoint=None):
    """Parse evaluation options for one checkpoint (`checkpoint`, or the only one --load_model_path
    names), create its result folder (args.result_dir, see result_folder) and save the options in it."""
    args = parse_args(parse_test_args, argv)
    paths = checkpoints_to_evaluate(args)
    if checkpoint is None and len(paths) > 1:
        raise KilnError('several checkpoints given; evaluate them with eval.py, which compares them')
    args.load_model_path = checkpoint or paths[0]
    args.result_dir = result_folder(args, args.load_model_path)
    create_run_folder(args.result_dir, args, 'choose a new --save_prefix to keep the old results')
    return args


def prepare_predict_args(argv=None):
    """Parse prediction options, create `<checkpoint folder>/predict/<checkpoint>_<input>_<save_prefix>`
    (args.result_dir) and save the options in it."""
    args = parse_args(parse_predict_args, argv)
    if not os.path.isfile(args.load_model_path):
        raise KilnError(f'checkpoint {args.load_model_path} does not exist; check --load_model_path')
    checkpoint_name = os.path.splitext(os.path.basename(args.load_model_path))[0]
    input_name = os.path.splitext(os.path.basename(os.path.normpath(args.input)))[0]
    args.result_dir = os.path.join(os.path.dirname(args.load_model_path), 'predict',
                                   f'{checkpoint_name}_{input_name}_{args.save_prefix}')
    create_run_folder(args.result_dir, args, 'choose a new --save_prefix to keep the old predictions')
    return args


@contextlib.contextmanager
def discard_folder_if_setup_fails(folder):
    """Remove a just-created run folder again if setup fails, so the same command can be re-run.

    Only the option files written by this module are removed; a folder holding anything else
    is left alone.
    """
    try:
        yield
    except BaseException:
        for name in (ARGS_TXT, ARGS_YAML):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
        with contextlib.suppress(OSError):
            os.rmdir(folder)
            if os.path.basename(os.path.dirname(folder)) == EVAL_FOLDER:
                os.rmdir(os.path.dirname(folder))  # only succeeds when no other evaluation is in it
        raise
