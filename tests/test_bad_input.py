"""Bad input: train.py and eval.py answer with one clear line, never a traceback, and overwrite nothing.

The rule under test, for every mistake a user can make on the command line or in the data:
- exactly one non-empty line on stderr, starting with `error: `, naming what is wrong
  (the option, the path, the list file and line number) and how to fix it;
- a non-zero exit code;
- no Python traceback, unless `--debug` is given;
- nothing that existed before is changed (experiment folders, checkpoints, results).

Every case runs the real entry points (conftest.run_script) on a tiny generated dataset (24 train
and 12 val images), so one training run takes a second or two.
"""

import hashlib
import io
import json
import os
import random
import subprocess

import pytest
import torch

from conftest import REPO, run_script, timeout, tiny_run_args

FAST = ['--epochs', '1', '--batch_size', '8', '--no-progress_bar']


def run(script, *args):
    """`python <script> <args>` in the repo root (in this process: see conftest.run_script)."""
    return run_script(script, *args)


def train(checkpoints_dir, data, *extra, cpu=True):
    """train.py on the tiny data, writing under `checkpoints_dir`; `extra` flags override the defaults
    (on the CPU, unless not `cpu`: these tests are about the messages, not the device)."""
    return run(
        'train.py',
        '--checkpoints_dir',
        checkpoints_dir,
        '--data_type',
        'list',
        '--train_list',
        data / 'train.txt',
        '--val_list',
        data / 'val.txt',
        '--num_workers',
        '0',
        *FAST,
        *(['--cpu'] if cpu else []),
        *extra,
    )


def evaluate(checkpoint, *extra):
    """eval.py on `checkpoint` (its own validation list unless --val_list is in `extra`)."""
    return run('eval.py', '--load_model_path', checkpoint, '--no-progress_bar', '--num_workers', '0', '--cpu', *extra)


def assert_one_error_line(result, *needles):
    """The failure is one `error: ` line on stderr containing every needle; return that line."""
    shown = f'exit code {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}'
    assert result.returncode != 0, shown
    assert 'Traceback' not in result.stderr + result.stdout, shown
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, shown
    line = lines[0]
    assert line.startswith('error: '), shown
    for needle in needles:
        assert str(needle) in line, f'{needle!r} not in the error line\n{shown}'
    return line


def assert_succeeded(result):
    assert result.returncode == 0, f'--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}'


def snapshot(folder):
    """{relative path: sha256} of every file under `folder`."""
    digests = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, 'rb') as f:
                digests[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def leftovers(checkpoints_dir):
    """What a failed run left in `checkpoints_dir` (it may not exist at all)."""
    return sorted(os.listdir(checkpoints_dir)) if os.path.isdir(checkpoints_dir) else []


def write_list(data, name, lines):
    """Write a list file beside the tiny data (so classes.txt applies); return its path."""
    path = data / name
    path.write_text(''.join(line + '\n' for line in lines))
    return path


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    """The tiny shapes dataset: images/, train.txt, val.txt and classes.txt (6 classes)."""
    from data.shapes import generate_shapes

    root = tmp_path_factory.mktemp('bad_input_data') / 'shapes'
    generate_shapes(str(root), train_size=24, val_size=12)
    return root


@pytest.fixture(scope='module')
def trained(data, tmp_path_factory):
    """One finished training run: (checkpoints_dir, experiment folder). Tests must not change it."""
    checkpoints_dir = tmp_path_factory.mktemp('bad_input_trained')
    assert_succeeded(train(checkpoints_dir, data, '--save_prefix', 'base'))
    folder = checkpoints_dir / 'small_cnn_list_base'
    assert (folder / 'best.pth').is_file()
    return checkpoints_dir, folder


# 1. unknown names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    'option, bad, valid',
    [
        ('--model_type', 'no_such_model', 'small_cnn'),
        ('--data_type', 'no_such_data', 'shapes'),
    ],
)
def test_unknown_name_lists_the_valid_ones_and_leaves_no_folder(data, tmp_path, option, bad, valid):
    checkpoints_dir = tmp_path / 'ck'
    result = train(checkpoints_dir, data, option, bad, '--save_prefix', 'retry')
    assert_one_error_line(result, option, bad, valid)
    assert leftovers(checkpoints_dir) == []

    if option == '--model_type':  # the same command with the name fixed just works
        assert_succeeded(train(checkpoints_dir, data, option, valid, '--save_prefix', 'retry'))
        assert (checkpoints_dir / 'small_cnn_list_retry' / 'best.pth').is_file()


@pytest.mark.parametrize(
    'argv, suggestion',
    [
        (['--model_type', 'resnet'], '(did you mean resnet18?)'),
        (['--data_type', 'shape'], '(did you mean shapes?)'),
        (['--batchsize', '8'], '--batchsize 8 (did you mean --batch_size?)'),
        (['--save_prefx', 'x'], '(did you mean --save_prefix?)'),
        (['--loggers', 'csv,tensorbord'], "unknown logger 'tensorbord' (did you mean tensorboard?)"),
        (['--epoch', '1'], '--epoch 1 (did you mean --epochs?)'),  # an abbreviation was taken without a word
        (['--loss', 'label_smothing'], "unknown --loss 'label_smothing' (did you mean label_smoothing?)"),
        (['--augment', 'hflip,colr'], "unknown augmentation 'colr' (did you mean color?)"),
    ],
)
def test_a_mistyped_name_or_flag_comes_with_the_one_meant(data, tmp_path, argv, suggestion):
    assert_one_error_line(train(tmp_path / 'ck', data, *argv), suggestion)
    assert leftovers(tmp_path / 'ck') == []


@pytest.mark.parametrize(
    'argv, line',
    [
        (  # argparse says what is missing before what is unknown: the typo went unnamed
            ['--load_model_pth', 'best.pth', '--input', 'x'],
            'the following arguments are required: --load_model_path; --load_model_pth is no option (did you '
            'mean --load_model_path?)',
        ),
        (
            ['--load_model_path', 'best.pth', '--inptu', 'x'],
            'the following arguments are required: --input; --inptu is no option (did you mean --input?)',
        ),
        (  # an unquoted glob: the shell gave --input its first file, and the others to nobody
            ['--load_model_path', 'best.pth', '--input', 'README.md', 'train.py'],
            "unrecognized arguments: train.py (an option takes one path: quote a glob, e.g. 'photos/*.jpg', so",
        ),
    ],
)
def test_predict_s_usual_first_mistakes_are_named(argv, line):
    assert_one_error_line(run('predict.py', *argv), line)


def test_a_mistyped_loss_is_said_before_torch_loads_and_before_the_folder_is_looked_at(data, tmp_path):
    """--loss was checked only as the run was built: after torch loaded, and after an existing experiment
    folder was said to exist (the fix asked for, a new --save_prefix, then met the typo)."""
    import sys

    from options import loss_names

    assert_succeeded(train(tmp_path / 'ck', data, '--save_prefix', 'taken'))
    command = [sys.executable, '-X', 'importtime', 'train.py', '--loss', 'focal', '--save_prefix', 'taken']
    command += ['--checkpoints_dir', str(tmp_path / 'ck')]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout(120))
    lines = result.stderr.splitlines()
    said = [line for line in lines if not line.startswith('import time:')]
    assert said == [
        "error: unknown --loss 'focal'; choose one of: cross_entropy, label_smoothing (or add it to LOSSES in loss.py)"
    ], result.stderr[-2000:]
    assert not [line for line in lines if line.endswith('| torch')]  # (-X importtime: a line per module imported)
    assert loss_names() == ['cross_entropy', 'label_smoothing']


@pytest.mark.parametrize(
    'added, changes',
    [
        ("LOSSES |= {'focal': FocalLoss}", True),
        ("table = LOSSES\ntable['focal'] = FocalLoss", True),
        ("LOSSES['focal'] = FocalLoss", True),
        ('LOSSES.update(focal=FocalLoss)', True),
        ('register(LOSSES)', True),
        ("known = 'focal' in LOSSES and LOSSES['focal'] and sorted(LOSSES)", False),
    ],
)
def test_the_loss_names_read_without_torch_are_given_up_where_loss_py_may_add_some(added, changes):
    """The names were read from LOSSES's dict alone: a loss.py adding one later (`LOSSES |= ...`, an alias)
    had that loss refused as unknown."""
    import ast

    from options import _changes_losses

    with open(os.path.join(REPO, 'loss.py')) as f:
        text = f.read()
    assert _changes_losses(ast.parse(text)) is False
    assert _changes_losses(ast.parse(f'{text}\n{added}\n')) is changes


def test_a_saved_relative_path_is_the_same_option_as_its_absolute_path(tmp_path, monkeypatch):
    """Runs saved by an earlier Kiln hold --load_model_path as given: a sweep or submit.py run again
    compared it with today's absolute path and called it changed (and the other way round)."""
    from options import changed_options, parse_args, parse_train_args

    monkeypatch.chdir(tmp_path)
    options = parse_args(parse_train_args, ['--load_model_path', 'weights.pth'])
    saved = {'load_model_path': 'weights.pth'}
    assert 'load_model_path' not in changed_options(saved, options)
    assert 'load_model_path' not in changed_options({'load_model_path': str(tmp_path / 'weights.pth')}, options)
    assert 'load_model_path' in changed_options({'load_model_path': 'other.pth'}, options)


IGNORED = [
    (
        ['--augment', 'crop,hflip', '--mixup_alpha', '0.5'],
        '--mixup_alpha acts with mixup in --augment only, not crop,hflip',
    ),
    (['--augment', 'mixup', '--cutmix_alpha', '0.5'], '--cutmix_alpha acts with cutmix in --augment only'),
    (['--augment', 'cutmix', '--mix_switch_prob', '0.2'], '--mix_switch_prob acts with mixup and cutmix in --augment'),
    (['--augment', 'hflip', '--mix_prob', '0.5'], '--mix_prob acts with mixup or cutmix in --augment only'),
    (['--augment', 'crop', '--crop_scale', '0.5', '1'], '--crop_scale acts with resized_crop in --augment only'),
    (
        ['--augment', 'none', '--crop_ratio', '0.5', '2'],
        '--crop_ratio acts with resized_crop in --augment only, not none',
    ),
    (['--augment', 'crop', '--color_jitter', '0.1'], '--color_jitter acts with color in --augment only'),
    (['--augment', 'crop', '--erase_prob', '0.9'], '--erase_prob acts with erase in --augment only'),
    (['--resize', 'squash', '--crop_pct', '0.5'], '--crop_pct acts with --resize crop only, not squash'),
    (['--lr_gamma', '0.5'], '--lr_gamma acts with --scheduler step or plateau only, not cosine'),
    (['--scheduler', 'plateau', '--lr_step_epochs', '3'], '--lr_step_epochs acts with --scheduler step only'),
    (['--scheduler', 'step', '--lr_patience', '1'], '--lr_patience acts with --scheduler plateau only, not step'),
    (['--momentum', '0.5'], '--momentum acts with --optimizer sgd only, not adamw'),
    (['--optimizer', 'adam', '--momentum', '0.9'], '--momentum acts with --optimizer sgd only, not adam'),
    (['--scheduler', 'step', '--warmup_steps', '5'], '--warmup_steps acts with --scheduler cosine only, not step'),
    (['--scheduler', 'none', '--warmup_steps', '5'], '--warmup_steps acts with --scheduler cosine only, not none'),
    (['--compile_mode', 'max-autotune'], '--compile_mode acts with --compile only'),
    (['--freeze_batch_norms'], '--freeze_batch_norms acts with --freeze_to only'),
    (['--unfreeze_at_epoch', '2'], '--unfreeze_at_epoch acts with --freeze_to only'),
    (['--unfrozen_lr_scale', '0.5'], '--unfrozen_lr_scale acts with --freeze_to only'),
    (['--early_stop_min_delta', '0.1'], '--early_stop_min_delta acts with --early_stop_patience only'),
    (['--load_not_strict'], '--load_not_strict acts with --load_model_path only'),
    (['--load_prefix_map', 'net.='], '--load_prefix_map acts with --load_model_path only'),
    (['--no-log_images', '--image_interval', '5'], '--image_interval acts with --log_images only'),
    (['--mlflow_uri', 'file:/tmp/x'], '--mlflow_uri acts with mlflow in --loggers only, not tensorboard'),
    (['--loggers', 'csv', '--wandb_project', 'p'], '--wandb_project acts with wandb in --loggers only, not csv'),
    (
        ['--overfit_batches', '2', '--limit_val_batches', '1'],
        '--overfit_batches decides the batches trained and validated: this run ignores --limit_val_batches',
    ),
    (['--augment', 'hflip,crop,hflip'], '--augment names hflip twice: it is applied twice'),
    (['--task', 'detect', '--loss', 'label_smoothing'], '--task detect computes a loss of its own: this run ignores'),
    (['--augment', 'mixup,cutmix', '--batch_size', '1'], 'batches of 1 leave mixup and cutmix nothing to mix'),
    (['--overfit_batches', '2', '--augment', 'mixup'], '--overfit_batches trains on its batches as they are'),
    (['--loggers', 'csv', '--log_images'], '--log_images acts with tensorboard or wandb or mlflow in --loggers only'),
    (['--max_iteration', '3', '--epochs', '5'], '--max_iteration 3 decides how long it trains: this run ignores'),
    (['--freeze_to', '-2', '--unfreeze_at_epoch', '1'], '--unfreeze_at_epoch 1 unfreezes before the first step'),
]


@pytest.mark.parametrize('argv, note', IGNORED, ids=[note.split()[0].strip('-') for _, note in IGNORED])
def test_an_option_the_run_would_ignore_is_said(argv, note):
    """Recipe options that do nothing in the chosen setup were accepted without a word. A note, not an
    error: a --config (a run's args.yaml) or a sweep's grid may set them for runs they do not act in."""
    from options import ignored_options, parse_args, parse_train_args

    notes = ignored_options(parse_args(parse_train_args, argv), argv)
    assert len(notes) == 1 and notes[0].startswith(note), notes


def test_only_flags_given_are_said_to_be_ignored(data, tmp_path):
    """Defaults, a config's values (a saved args.yaml holds every option) and an --augment default or
    unset --resize (the dataset's choice) are not judged; train.py says its notes and trains."""
    import yaml

    from options import ignored_options, parse_args, parse_train_args, saved_options

    def notes(argv):
        return ignored_options(parse_args(parse_train_args, argv), argv)

    assert notes([]) == notes(['--augment', 'crop', '--optimizer', 'adam', '--scheduler', 'none']) == []
    assert notes(['--crop_scale', '0.5', '1', '--color_jitter', '0.1', '--crop_pct', '0.5']) == []
    assert notes(['--loss', 'label_smoothing']) == notes(['--task', 'segment', '--loss', 'label_smoothing']) == []
    sgd = ['--optimizer', 'sgd', '--momentum', '0', '--scheduler', 'step', '--lr_step_epochs', '2', '--lr_gamma', '1']
    assert notes(sgd) == []
    acting = ['--compile', '--compile_mode', 'default', '--freeze_to', '1', '--freeze_batch_norms']
    acting += ['--early_stop_patience', '2', '--early_stop_min_delta', '0.1', '--image_interval', '5']
    acting += ['--loggers', 'csv', 'mlflow', '--mlflow_uri', 'file:/tmp/x', '--warmup_steps', '5']
    assert notes(acting) == []
    record = tmp_path / 'args.yaml'  # an sgd run's record, given back with another optimizer
    record.write_text(yaml.safe_dump(saved_options(parse_args(parse_train_args, sgd))))
    assert notes(['--config', str(record), '--optimizer', 'adam', '--scheduler', 'cosine']) == []
    result = train(tmp_path / 'ck', data, '--lr_gamma', '0.5')
    assert_succeeded(result)
    assert (
        'note: --lr_gamma acts with --scheduler step or plateau only, not cosine: this run ignores it' in result.stdout
    )
    # train.py judges by what the dataset chose where the options left it the choice (the README said
    # these were noted; on the default job they were not)
    result = train(tmp_path / 'ck', data, '--mixup_alpha', '0.5', '--crop_pct', '0.9', '--save_prefix', 'data')
    assert_succeeded(result)
    assert 'note: --mixup_alpha acts with mixup in --augment only, not crop: this run ignores it' in result.stdout
    assert 'note: --crop_pct acts with --resize crop only, not squash: this run ignores it' in result.stdout


@pytest.mark.parametrize(
    'argv, needles',
    [
        (['--ema_decay', '0'], ['--ema_decay', 'got 0', 'or none to turn it off']),
        (['--clip_grad_norm', '0'], ['--clip_grad_norm', 'got 0', 'or none to turn it off']),
        (['--freeze_to', 'all'], ['--freeze_to', "'all'", 'or none to turn it off']),
        (['--monitor_mode', 'up'], ['--monitor_mode', "'up'", 'or none for its default']),
        # `none` starts the default number of workers: it said 'to turn it off'
        (['--num_workers', '-1'], ['--num_workers', 'got -1', 'or none for its default']),
        (['--no-ema_decay'], ['--no-ema_decay', 'use --ema_decay none to turn it off']),
    ],
    ids=['ema_decay', 'clip_grad_norm', 'freeze_to', 'monitor_mode', 'num_workers', 'no_ema_decay'],
)
def test_an_option_that_is_off_unless_given_says_what_none_does(data, tmp_path, argv, needles):
    assert_one_error_line(train(tmp_path / 'ck', data, *argv), *needles)
    assert leftovers(tmp_path / 'ck') == []


def test_none_turns_off_what_a_config_or_a_resumed_run_turned_on(data, tmp_path):
    """A config's (or a previous run's args.yaml's) --ema_decay, --clip_grad_norm or --freeze_to could not
    be turned off: 0 and none were refused, and --no-ema_decay is no flag."""
    import yaml

    from options import parse_args, parse_train_args, saved_options

    config = tmp_path / 'config.yaml'
    config.write_text('ema_decay: 0.99\nclip_grad_norm: 1.0\nfreeze_to: 2\nload_prefix_map: {net.: ""}\n')
    on = parse_args(parse_train_args, ['--config', str(config)])
    assert (on.ema_decay, on.clip_grad_norm, on.freeze_to, on.load_prefix_map) == (0.99, 1.0, 2, ['net.='])
    flags = ['--ema_decay', 'none', '--clip_grad_norm', 'none', '--freeze_to', 'none', '--load_prefix_map', 'none']
    off = parse_args(parse_train_args, ['--config', str(config), *flags])
    assert (off.ema_decay, off.clip_grad_norm, off.freeze_to, off.load_prefix_map) == (None, None, None, None)
    overridden = tmp_path / 'over.yaml'  # none in a config too
    overridden.write_text('ema_decay: none\nclip_grad_norm: null\n')  # null: unset, as in a saved args.yaml
    assert parse_args(parse_train_args, ['--config', str(overridden)], base_config=str(config)).ema_decay is None
    assert parse_args(parse_train_args, ['--config', str(overridden)], base_config=str(config)).clip_grad_norm == 1.0
    # what a run saves reads back the same, from args.yaml and from a checkpoint's options (a resume)
    saved = tmp_path / 'args.yaml'
    saved.write_text(yaml.safe_dump(saved_options(off)))
    assert saved_options(parse_args(parse_train_args, ['--config', str(saved)])) == saved_options(off)
    assert saved_options(parse_args(parse_train_args, [], base_config=saved_options(off))) == saved_options(off)

    # a real run: the config's EMA and clipping turned off, saved so, and resumed
    checkpoints_dir = tmp_path / 'ck'
    ema_config = tmp_path / 'ema.yaml'
    ema_config.write_text('ema_decay: 0.99\nclip_grad_norm: 1.0\n')
    argv = ['--config', ema_config, '--ema_decay', 'none', '--clip_grad_norm', 'none', '--save_prefix', 'off']
    assert_succeeded(train(checkpoints_dir, data, *argv))
    folder = checkpoints_dir / 'small_cnn_list_off'
    recorded = yaml.safe_load((folder / 'args.yaml').read_text())
    assert recorded['ema_decay'] is None and recorded['clip_grad_norm'] is None, recorded
    assert_succeeded(train(checkpoints_dir, data, '--save_prefix', 'off', '--resume', '--epochs', '2'))
    assert_succeeded(train(checkpoints_dir, data, '--config', folder / 'args.yaml', '--save_prefix', 'again'))


def test_the_summary_line_says_when_the_warmup_outlasts_the_run(data, tmp_path):
    """A warm-up longer than the run never reaches --lr: the line printed at the start says so. One as
    long as the run reaches it at the last step (the line said it never did)."""
    long_warmup = train(tmp_path / 'ck', data, '--warmup_steps', '4', '--save_prefix', 'long')  # 3 steps in all
    assert_succeeded(long_warmup)
    assert 'outlasts them' in long_warmup.stdout.splitlines()[0], long_warmup.stdout
    for steps in ('3', '2'):
        short_warmup = train(tmp_path / 'ck', data, '--warmup_steps', steps, '--save_prefix', f'short{steps}')
        assert_succeeded(short_warmup)
        assert 'warm-up' not in short_warmup.stdout, short_warmup.stdout


def test_loggers_are_given_apart_or_joined_by_commas_as_augmentations_are():
    """--loggers csv,tensorboard was refused as one unknown name, though --augment takes its names so."""
    from options import parse_args, parse_train_args

    for argv in (['csv', 'tensorboard'], ['csv,tensorboard'], ['csv, tensorboard', 'csv']):
        assert parse_args(parse_train_args, ['--loggers', *argv]).loggers == ['csv', 'tensorboard'], argv
    assert parse_args(parse_train_args, []).loggers == ['tensorboard']


@pytest.mark.parametrize(
    'text, limit', [('2', 2), ('2.0', 2), ('1e1', 10), ('1', 1), ('1.0', 1.0), ('0.25', 0.25), ('5e-1', 0.5)]
)
def test_limit_batches_take_counts_written_as_floats_as_counts(text, limit):
    """--limit_train_batches 2.0 (or `2.0` in a YAML config) was taken for a fraction: every batch."""
    from options import parse_args, parse_train_args

    parsed = parse_args(parse_train_args, ['--limit_train_batches', text]).limit_train_batches
    assert parsed == limit and type(parsed) is type(limit), (text, parsed)


@pytest.mark.parametrize('text', ['inf', 'nan', '2.5', '0', '-1', 'abc'])
def test_a_limit_that_is_neither_a_count_nor_a_fraction_is_one_line(data, tmp_path, text):
    result = train(tmp_path / 'ck', data, '--limit_train_batches', text)
    assert_one_error_line(result, '--limit_train_batches', text, 'a count of batches (1, 2, ...) or a fraction')


def test_a_single_class_is_one_line(data, tmp_path):
    """One class folder trained to acc 1.0 at once and said nothing: every answer is right."""
    import shutil

    (tmp_path / 'one' / 'cat').mkdir(parents=True)
    for image in sorted((data / 'images' / 'train').iterdir())[:4]:
        shutil.copy(image, tmp_path / 'one' / 'cat')
    result = run('train.py', '--checkpoints_dir', tmp_path / 'ck', '--train_list', tmp_path / 'one', *FAST)
    assert_one_error_line(result, '--task classify needs 2 classes or more', 'has 1 (cat)')
    assert leftovers(tmp_path / 'ck') == []


# 2. missing list file ------------------------------------------------------------------------------


@pytest.mark.parametrize('option', ['--train_list', '--val_list'])
def test_missing_list_file(data, tmp_path, option):
    missing = tmp_path / 'no_such_list.txt'
    result = train(tmp_path / 'ck', data, option, missing)
    assert_one_error_line(result, missing, option)
    assert leftovers(tmp_path / 'ck') == []


# 3. list line naming a missing image ---------------------------------------------------------------


def test_list_line_with_missing_image(data, tmp_path):
    listed = write_list(data, 'missing_image.txt', ['images/train/00000.png 0', 'images/train/no_such.png 1'])
    result = train(tmp_path / 'ck', data, '--train_list', listed)
    assert_one_error_line(result, f'{listed}:2', 'no_such.png')
    assert leftovers(tmp_path / 'ck') == []


# 4. malformed list lines ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    'line',
    [
        'just_one_field',
        'images/train/00001.png notanumber',
        'images/train/00001.png \u00b2',  # superscript two: str.isdigit() says yes, int() says no
    ],
    ids=['one_field', 'not_a_number', 'superscript_digit'],
)
def test_malformed_list_line_names_its_line_number(data, tmp_path, line):
    name = f'malformed_{hashlib.md5(line.encode()).hexdigest()[:8]}.txt'
    listed = write_list(data, name, ['# a comment, then a blank line', '', 'images/train/00000.png 0', line])
    result = train(tmp_path / 'ck', data, '--train_list', listed)
    assert_one_error_line(result, f'{listed}:4')
    assert leftovers(tmp_path / 'ck') == []


# 5. corrupt image -----------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def corrupt_list(data):
    """A training list whose line 3 is a .png file of garbage bytes: (list path, image path)."""
    garbage = data / 'images' / 'garbage.png'
    garbage.write_bytes(random.Random(0).randbytes(600))
    listed = write_list(
        data,
        'corrupt.txt',
        [
            'images/train/00000.png 0',
            'images/train/00001.png 1',
            'images/garbage.png 2',
            'images/train/00003.png 3',
            'images/train/00004.png 4',
            'images/train/00005.png 5',
        ],
    )
    return listed, garbage


@pytest.mark.parametrize('data_type, workers', [('list', 0), ('list', 1), ('mem_list', 0)])
def test_corrupt_image_names_the_image(data, tmp_path, corrupt_list, data_type, workers):
    listed, garbage = corrupt_list
    result = train(
        tmp_path / 'ck', data, '--data_type', data_type, '--train_list', listed, '--num_workers', workers
    )  # with 1 worker, 'list' fails inside a DataLoader worker
    assert_one_error_line(result, garbage, f'{listed}:3')  # mem_list decodes in the main process at startup


# 6. label outside the class range -------------------------------------------------------------------


def test_label_beyond_classes_txt(data, tmp_path):
    listed = write_list(data, 'label_9.txt', ['images/train/00000.png 0', 'images/train/00001.png 9'])
    result = train(tmp_path / 'ck', data, '--train_list', listed)
    assert_one_error_line(result, f'{listed}:2', 'label 9')
    assert leftovers(tmp_path / 'ck') == []


def test_label_beyond_num_classes(data, tmp_path):
    listed = write_list(data, 'label_5.txt', ['images/train/00000.png 0', 'images/train/00005.png 5'])
    result = train(tmp_path / 'ck', data, '--train_list', listed, '--num_classes', '2')
    assert_one_error_line(result, listed, '6 classes are named but --num_classes is 2')  # classes.txt names 6
    unnamed = tmp_path / 'unnamed'  # no classes.txt beside it: the label is what is wrong
    unnamed.mkdir()
    (unnamed / 'label_5.txt').write_text(f'{data}/images/train/00000.png 0\n{data}/images/train/00005.png 5\n')
    result = train(tmp_path / 'ck', data, '--train_list', unnamed / 'label_5.txt', '--num_classes', '2')
    assert_one_error_line(result, f'{unnamed / "label_5.txt"}:2', 'label 5', '--num_classes')
    assert leftovers(tmp_path / 'ck') == []


# 7. missing checkpoint -------------------------------------------------------------------------------


def test_eval_missing_checkpoint(tmp_path):
    missing = tmp_path / 'nope.pth'
    assert_one_error_line(evaluate(missing), missing, '--load_model_path')
    assert leftovers(tmp_path) == []


def test_train_missing_checkpoint(data, tmp_path):
    missing = tmp_path / 'nope.pth'
    result = train(tmp_path / 'ck', data, '--load_model_path', missing)
    assert_one_error_line(result, missing, '--load_model_path')
    assert leftovers(tmp_path / 'ck') == []


# 8. incompatible checkpoint --------------------------------------------------------------------------


def test_eval_checkpoint_of_another_model(trained):
    _, folder = trained
    before = snapshot(folder)
    result = evaluate(folder / 'best.pth', '--model_type', 'resnet18', '--save_prefix', 'other_model')
    line = assert_one_error_line(result, folder / 'best.pth', 'give --model_type small_cnn')
    assert '--load_not_strict' not in line  # an evaluation scores the weights as they are
    assert not (folder / 'eval' / 'best_val_other_model').exists()
    assert snapshot(folder) == before


@pytest.mark.parametrize('script', ['eval.py', 'predict.py'])
def test_eval_and_predict_with_other_num_classes_say_drop_it(data, trained, script):
    """The advice was '... or pass --load_not_strict': followed, eval.py scored a head left at its init
    and exited 0."""
    _, folder = trained
    before = snapshot(folder)
    extra = ['--input', data / 'val.txt'] if script == 'predict.py' else []
    result = run(script, '--load_model_path', folder / 'best.pth', '--num_classes', '10', '--no-progress_bar', *extra)
    line = assert_one_error_line(result, 'head.weight', '--num_classes 10 (it was trained with 6): drop them')
    assert '--load_not_strict' not in line
    assert snapshot(folder) == before


def test_train_checkpoint_with_other_num_classes(data, trained, tmp_path):
    _, folder = trained
    checkpoint = folder / 'best.pth'
    result = train(tmp_path / 'ck', data, '--load_model_path', checkpoint, '--num_classes', '10')
    assert_one_error_line(result, checkpoint, '--num_classes', '--load_not_strict')
    assert leftovers(tmp_path / 'ck') == []

    fixed = train(tmp_path / 'ck', data, '--load_model_path', checkpoint, '--num_classes', '10', '--load_not_strict')
    assert_succeeded(fixed)
    assert 'load_match_dict' in fixed.stdout
    assert (tmp_path / 'ck' / 'small_cnn_list_default' / 'best.pth').is_file()


# 9. a file that is not a checkpoint -----------------------------------------------------------------


def _cut_short_checkpoint():
    buffer = io.BytesIO()
    torch.save({'model': {'weight': torch.zeros(100)}}, buffer)
    return buffer.getvalue()[:-10]


@pytest.mark.parametrize(
    'content, reason',
    [
        (random.Random(0).randbytes(3000), 'not a torch.save file'),
        (b'', 'the file is empty'),
        (b'this is not a checkpoint\n', 'not a torch.save file'),  # it said "(pop from empty list)"
        (_cut_short_checkpoint(), 'the file is cut short or damaged'),  # "([Errno 22] Invalid argument)"
    ],
    ids=['random_bytes', 'empty', 'text', 'cut_short'],
)
def test_eval_file_that_is_not_a_checkpoint(tmp_path, content, reason):
    path = tmp_path / 'x.pth'
    path.write_bytes(content)
    line = assert_one_error_line(evaluate(path), path, f'not a readable PyTorch checkpoint ({reason})')
    # it is a damaged or foreign file, not a checkpoint that safe loading refuses: re-saving it cannot help
    assert 'safe loading does not allow' not in line
    assert not (tmp_path / 'eval').exists()  # no empty result folders left behind
    assert path.read_bytes() == content


@pytest.mark.parametrize('content', [[1, 2, 3], torch.zeros(3)], ids=['list', 'tensor'])
def test_eval_checkpoint_that_holds_no_weights(tmp_path, content):
    path = tmp_path / 'x.pth'
    torch.save(content, path)
    assert_one_error_line(evaluate(path), path, 'not model weights')
    assert not (tmp_path / 'eval').exists()


def test_eval_checkpoint_with_malformed_args_uses_the_command_line(data, trained, tmp_path):
    _, folder = trained
    checkpoint = torch.load(folder / 'best.pth', weights_only=True, map_location='cpu')
    checkpoint['args'] = 'not a dict'
    path = tmp_path / 'odd_args.pth'
    torch.save(checkpoint, path)
    # a list of its own (the first 5 validation images), not the one the checkpoint was trained with
    with open(data / 'val.txt') as f:
        lines = [line.split() for line in f if line.strip()][:5]
    five = tmp_path / 'five.txt'
    five.write_text(''.join(f'{data / image} {label}\n' for image, label in lines))
    result = evaluate(path, '--model_type', 'small_cnn', '--data_type', 'list', '--val_list', five)
    assert_succeeded(result)
    with open(tmp_path / 'eval' / 'odd_args_five_default' / 'result.json') as f:
        evaluated = json.load(f)
    assert evaluated['list'] == str(five) and evaluated['samples'] == 5, evaluated
    assert f'{path}: loss ' in result.stdout


def test_eval_refuses_a_pickle_that_would_run_code(tmp_path):
    marker = tmp_path / 'pwned'
    path = tmp_path / 'evil.pth'
    torch.save({'model': Exploit(str(marker))}, path)
    line = assert_one_error_line(evaluate(path), path, 'safe loading does not allow')
    assert 'os.system' in line or 'posix.system' in line
    assert not marker.exists()


class Exploit:
    """Unpickling this without safe loading would create the file `marker` by running a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f'touch {self.marker}',)


# 10. non-positive numbers, and numbers too large (argparse) ------------------------------------------------


@pytest.mark.parametrize(
    'option, value',
    [
        ('--batch_size', '0'),
        ('--epochs', '0'),
        ('--lr', '0'),
        ('--lr', '-1'),
        ('--seed', '99999999999999999999999'),  # more than torch holds: tracebacks once training began
        ('--seed', '9' * 400),  # more than a float holds: a traceback at once
        ('--topk', '99999999999999999999'),
    ],
)
def test_non_positive_number(data, tmp_path, option, value):
    result = train(tmp_path / 'ck', data, option, value)
    assert_one_error_line(result, option, value)
    assert result.returncode == 2
    assert leftovers(tmp_path / 'ck') == []


# 11. existing experiment folder ---------------------------------------------------------------------


def test_existing_experiment_folder_is_not_touched(data, trained):
    checkpoints_dir, folder = trained
    before = snapshot(folder)
    assert {'best.pth', 'last.pth', 'args.yaml', 'args.txt'} <= set(before)
    result = train(checkpoints_dir, data, '--save_prefix', 'base')
    assert_one_error_line(result, folder, '--save_prefix')
    after = snapshot(folder)
    for name in ('best.pth', 'last.pth', 'args.yaml', 'args.txt'):
        assert after[name] == before[name], f'{name} changed'
    assert {k: v for k, v in after.items() if not k.startswith('eval')} == {
        k: v for k, v in before.items() if not k.startswith('eval')
    }


# 12. eval result folder that already holds results ----------------------------------------------------


def test_existing_eval_results_are_not_touched(trained):
    _, folder = trained
    assert_succeeded(evaluate(folder / 'best.pth', '--save_prefix', 'twice'))
    results = [folder / 'eval' / name for name in os.listdir(folder / 'eval') if name.endswith('_twice')]
    assert len(results) == 1 and (results[0] / 'result.txt').is_file()
    before = snapshot(results[0])

    result = evaluate(folder / 'best.pth', '--save_prefix', 'twice')
    assert_one_error_line(result, results[0], '--save_prefix')
    assert snapshot(results[0]) == before


# 13. --config problems ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    'content, needle',
    [
        (None, None),  # no such file
        (b'epochs: [1\nlr: 0.1\n', None),  # malformed YAML
        (b'epochz: 1\n', "'epochz' (did you mean epochs?)"),  # unknown option, and the one meant
        (b'- epochs\n- 1\n', None),  # not a mapping
        (b'\xff\xfe\x00epochs: 1\n', None),  # not text at all
        (b'deterministic: "false"\n', "deterministic: expected true or false, got 'false'"),  # it turned it on
        (b'lr: [0.1, 0.2]\n', 'lr: expected one value'),  # was "unrecognized arguments: 0.2"
        (b'crop_scale: "0.5 1"\n', 'crop_scale: expected a list of 2 values'),
        (b'epochs: 2.5\n', 'epochs: must be a positive integer, got 2.5'),
        (b'optimizer: adamm\n', "optimizer: 'adamm' is not one of sgd, adam, adamw"),
        (b'lr: 0.1\nepochs: 2\nlr: 0.2\n', "the key 'lr' is given twice"),  # the last one won without a word
        (b'config: other.yaml\n', "'config' cannot be set in a config file"),  # was: unknown (did you mean config?)
        (b'on: 2\n', 'True is not an option name (YAML reads it as bool)'),  # was difflib's TypeError traceback
    ],
    ids=[
        'missing',
        'malformed_yaml',
        'unknown_key',
        'not_a_mapping',
        'not_utf8',
        'string_bool',
        'list',
        'pair',
        'type',
        'choice',
        'twice',
        'config_in_config',
        'key_not_text',
    ],
)
def test_bad_config_file(data, tmp_path, content, needle):
    config = tmp_path / 'config.yaml'
    if content is not None:
        config.write_bytes(content)
    result = train(tmp_path / 'ck', data, '--config', config)
    assert_one_error_line(result, '--config', config, *([needle] if needle else []))
    assert leftovers(tmp_path / 'ck') == []


def test_a_second_config_file_is_refused(data, tmp_path):
    """argparse kept the last --config: the first file's options were dropped without a word."""
    (tmp_path / 'a.yaml').write_text('lr: 0.5\n')
    (tmp_path / 'b.yaml').write_text('epochs: 3\n')
    result = train(tmp_path / 'ck', data, '--config', tmp_path / 'a.yaml', '--config', tmp_path / 'b.yaml')
    assert_one_error_line(result, '--config is given 2 times', 'a.yaml', 'b.yaml')
    assert leftovers(tmp_path / 'ck') == []


# 14. --debug shows the traceback ----------------------------------------------------------------------


def test_debug_shows_the_traceback(data, tmp_path):
    result = train(tmp_path / 'ck', data, '--model_type', 'no_such_model', '--debug')
    assert result.returncode != 0
    assert 'Traceback' in result.stderr
    assert 'no_such_model' in result.stderr
    assert leftovers(tmp_path / 'ck') == []


# 15. --gpus without CUDA ----------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason='CUDA is here: --gpus 0 names a GPU')
def test_gpus_without_cuda(data, tmp_path):
    result = train(tmp_path / 'ck', data, '--gpus', '0', cpu=False)
    assert_one_error_line(result, '--gpus')
    assert leftovers(tmp_path / 'ck') == []


# more paths that are not what they should be -----------------------------------------------------------


def test_checkpoints_dir_that_is_a_file(data, tmp_path):
    not_a_folder = tmp_path / 'a_file'
    not_a_folder.write_text('keep me\n')
    result = train(not_a_folder, data)
    assert_one_error_line(result, not_a_folder)
    assert not_a_folder.read_text() == 'keep me\n'


@pytest.mark.parametrize(
    ('model', 'size', 'sizes'), [('seg_net', 30, '28 or 32'), ('center_net', 50, '48 or 64'), ('center_net', 8, '16')]
)
def test_an_image_size_the_model_cannot_take_is_one_line(model, size, sizes):
    """seg_net's and center_net's skip connections need sides of a multiple of 4 and 16: other sizes
    failed at the first step with a traceback from torch.cat."""
    from argparse import Namespace

    from model.model_entry import select_model
    from utils.errors import KilnError

    expected = f'--model_type {model} takes images whose side is a multiple of .*; --img_size {size} is not: '
    with pytest.raises(KilnError, match=f'{expected}give {sizes}$'):
        select_model(Namespace(model_type=model, num_classes=3, img_size=size))
    select_model(Namespace(model_type=model, num_classes=3, img_size=64))  # fine


def test_a_segmentation_run_at_a_size_its_model_cannot_take_is_one_line(tiny_shapes, tmp_path):
    from conftest import tiny_seg_args

    args = [*tiny_seg_args(tiny_shapes, tmp_path / 'ck'), '--task', 'segment', '--img_size', '30']
    assert_one_error_line(run_script('train.py', *args), '--model_type seg_net takes images whose side is a multiple')
    assert not (tmp_path / 'ck').exists()  # nor the --checkpoints_dir made for it


@pytest.mark.parametrize(
    ('model', 'task', 'made_for'), [('seg_net', 'classify', 'segment'), ('center_net', 'segment', 'detect')]
)
def test_a_model_made_for_another_task_is_one_line(model, task, made_for):
    """--model_type seg_net left at --task classify failed at the first step with a traceback from the loss."""
    from argparse import Namespace

    from model.model_entry import select_model
    from utils.errors import KilnError

    with pytest.raises(KilnError, match=f'^--model_type {model} is made for --task {made_for}; give --task {made_for}'):
        select_model(Namespace(model_type=model, num_classes=3, img_size=64, task=task))
    select_model(Namespace(model_type=model, num_classes=3, img_size=64, task=made_for))  # fine


def test_a_classifier_given_to_segmentation_or_detection_is_one_line(tiny_shapes, tmp_path):
    """A classifier (its outputs one score per class) at --task segment or detect failed at the first step
    with a traceback from the loss ('0D or 1D target tensor expected', 'too many indices')."""
    from conftest import tiny_seg_args
    from options import parse_args, parse_train_args
    from tasks.detect import DetectTask
    from utils.errors import KilnError

    args = [*tiny_seg_args(tiny_shapes, tmp_path / 'ck'), '--task', 'segment', '--model_type', 'small_cnn']
    line = assert_one_error_line(run_script('train.py', *args), '--model_type small_cnn gives outputs of shape (16, ')
    assert line.endswith(
        '--task segment reads scores per class and pixel (N, classes, H, W): give a model made for '
        'it (its own: --model_type seg_net)'
    ), line
    assert not (tmp_path / 'ck').exists()
    task = DetectTask(
        parse_args(parse_train_args, ['--task', 'detect', '--model_type', 'linear', '--num_classes', '2'])
    )
    with pytest.raises(
        KilnError, match=r'^--model_type linear gives outputs of shape \(2, 2\), and --task detect reads'
    ):
        task.check_outputs(torch.zeros(2, 2))


def test_a_batch_of_one_that_batchnorm_cannot_train_on_is_one_line(tiny_shapes, tmp_path):
    """--batch_size 1 with a net whose last feature map is 1x1 ended in torch's ValueError traceback."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--model_type', 'resnet18', '--img_size', '8']
    args[args.index('--batch_size') + 1] = '1'
    assert_one_error_line(run_script('train.py', *args, '--max_iteration', '1'), 'BatchNorm cannot train on one value')


def test_a_task_built_on_segment_takes_its_models(monkeypatch):
    """A project's own task made from SegmentTask was refused seg_net, its own default model."""
    from argparse import Namespace

    import tasks.task_entry
    from model.model_entry import select_model
    from tasks.segment import SegmentTask

    class BinarySegTask(SegmentTask):
        pass

    task_class = tasks.task_entry.task_class
    monkeypatch.setattr(
        tasks.task_entry, 'task_class', lambda name: BinarySegTask if name == 'binary_seg' else task_class(name)
    )
    select_model(Namespace(model_type='seg_net', num_classes=3, img_size=64, task='binary_seg'))


def test_a_path_option_given_with_equals_or_in_a_config_expands_the_home_folder(tmp_path, monkeypatch):
    """`--checkpoints_dir=~/ck` (the shell leaves a `~` after `=` alone) and a config's `~/...` made a
    folder named `~` in the working folder; every path option now expands it as a shell would."""
    from options import parse_args, parse_predict_args, parse_test_args, parse_train_args

    monkeypatch.setenv('HOME', str(tmp_path))
    config = tmp_path / 'config.yaml'
    config.write_text('data_root: ~/generated\nval_list: ~/val.txt\n')
    train = parse_args(
        parse_train_args,
        ['--config=~/config.yaml', '--checkpoints_dir=~/ck', '--train_list=~/train.txt', '--resume=~/ck/run'],
    )
    assert (train.checkpoints_dir, train.train_list, train.resume) == tuple(
        str(tmp_path / name) for name in ('ck', 'train.txt', 'ck/run')
    )
    assert (train.data_root, train.val_list) == (str(tmp_path / 'generated'), str(tmp_path / 'val.txt'))
    evaluate = parse_args(parse_test_args, ['--load_model_path', '~/a.pth', '~/b/*.pth', '--output_dir=~/out'])
    assert evaluate.load_model_path == [str(tmp_path / 'a.pth'), str(tmp_path / 'b/*.pth')]
    assert evaluate.output_dir == str(tmp_path / 'out')
    predict = parse_args(parse_predict_args, ['--load_model_path=~/a.pth', '--input=~/photos'])
    assert (predict.load_model_path, predict.input) == (str(tmp_path / 'a.pth'), str(tmp_path / 'photos'))


def test_a_config_s_numbers_are_read_as_written_as_on_the_command_line(tmp_path):
    """YAML 1.1 reads 010 as 8, 2024_01 as 202401 and 12:30 as 750: `save_prefix: 010` named the folder
    `..._8` (and clashed with a run of `save_prefix: 8`). A config's value now means what the same
    text means after its flag."""
    from options import parse_args, parse_train_args

    config = tmp_path / 'config.yaml'
    config.write_text('save_prefix: 010\nepochs: 010\nlr: 2_0\n')
    options = parse_args(parse_train_args, ['--config', str(config)])
    assert (options.save_prefix, options.epochs, options.lr) == ('010', 10, 20.0)
    config.write_text('save_prefix: 2024_01\nseed: 1:00\n')
    with pytest.raises(SystemExit):  # base 60 for YAML, not a number for --seed
        parse_args(parse_train_args, ['--config', str(config)])
    config.write_text('save_prefix: 2024_01\n')
    assert parse_args(parse_train_args, ['--config', str(config)]).save_prefix == '2024_01'


def test_a_new_run_that_fails_to_start_leaves_no_folder_of_its_checkpoints_dir(tiny_shapes, tmp_path):
    """The run's folder went, but the --checkpoints_dir folders made above it for it stayed, empty."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'new' / 'a' / 'b')
    missing = args.index('--train_list') + 1
    args[missing] = str(tmp_path / 'gone.txt')
    result = run_script('train.py', *args)
    assert result.returncode == 2 and 'gone.txt does not exist' in result.stderr, result.stderr
    assert not (tmp_path / 'new').exists()


@pytest.mark.skipif(not os.path.isdir('/proc/self'), reason='no /proc here (where no folder can be made)')
def test_a_data_root_that_cannot_be_made_says_to_check_the_path(tmp_path):
    """A --data_root that cannot be made (No such file or directory: under /proc, say) said 'free disk space
    or fix the permissions'."""
    result = run('train.py', '--data_root', '/proc/kiln_no_such', '--checkpoints_dir', tmp_path / 'ck', '--cpu')
    line = assert_one_error_line(result, 'No such file or directory', 'check the path')
    assert 'disk space' not in line and not (tmp_path / 'ck').exists()


def test_a_class_folder_dataset_without_its_validation_folder_says_folders_work(tmp_path):
    """--data_type photos without --val_list said it 'reads list files', though it reads class folders."""
    from PIL import Image

    for name in ('cat', 'dog'):
        (tmp_path / 'train' / name).mkdir(parents=True)
        Image.new('RGB', (8, 8)).save(tmp_path / 'train' / name / 'a.png')
    result = run('train.py', '--data_type', 'photos', '--train_list', tmp_path / 'train', '--cpu')
    assert_one_error_line(result, 'reads a list file or a folder of class folders: give --val_list PATH')
