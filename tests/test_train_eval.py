"""End to end: train.py, eval.py and the bash scripts run as a user runs them, on tiny data."""

import csv
import glob
import json
import os
import re
import shutil
import signal
import socket

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO, experiment_of, run_script, timeout, tiny_run_args, train_succeeds
from utils.errors import KilnError


def _train(tiny_args, *extra):
    result = run_script('train.py', *tiny_args, *extra)
    assert result.returncode == 0, result.stderr
    return result


def _experiment(tiny_args, prefix='default', model='small_cnn'):
    return os.path.join(tiny_args[tiny_args.index('--checkpoints_dir') + 1], f'{model}_list_{prefix}')


@pytest.fixture(scope='module')
def trained(tiny_shapes, tmp_path_factory):
    """One finished 2-epoch training run on the tiny data, shared by this module: (experiment folder, stdout)."""
    args = tiny_run_args(tiny_shapes, tmp_path_factory.mktemp('trained'))
    result = _train(args, '--print_freq', '2')
    return _experiment(args), result.stdout


def test_training_writes_args_checkpoints_and_tensorboard(trained):
    folder, stdout = trained
    assert 'epoch 2/2' in stdout and 'best.pth' in stdout and 'tensorboard --logdir' in stdout
    assert 'step 2/6' in stdout  # --print_freq lines: 96 images / 16 per batch = 6 steps
    assert stdout.splitlines()[0] == (  # what it trains, on what, how long and where, before it starts
        f'classify: small_cnn on list, 6 classes, 96 training and 48 validation samples; 6 steps per epoch, '
        f'12 in all; into {folder}'
    )

    with open(os.path.join(folder, 'args.yaml')) as f:
        saved = yaml.safe_load(f)
    assert saved['epochs'] == 2 and saved['batch_size'] == 16 and saved['model_type'] == 'small_cnn'
    with open(os.path.join(folder, 'args.txt')) as f:
        text = f.read()
    assert text.startswith('# train.py') and 'batch_size' in text and ': 16' in text

    best = torch.load(os.path.join(folder, 'best.pth'), weights_only=True, map_location='cpu')
    last = torch.load(os.path.join(folder, 'last.pth'), weights_only=True, map_location='cpu')
    position = {key: value for key, value in last['position'].items() if key != 'lr'}  # lr: tested in test_long_runs
    assert position == {'epoch': 2, 'batch': 0, 'step': 12, 'validation_due': False} and last['position']['lr'] > 0
    assert set(last) >= {'model', 'optimizer', 'scheduler', 'monitor', 'args', 'class_names', 'rng', 'data_order'}
    assert best['monitor']['best'] == last['monitor']['best'] == best['monitor_value']
    assert best['args']['num_classes'] == 6 and best['class_names'][0] == 'circle'

    events = EventAccumulator(folder, size_guidance={'images': 0, 'scalars': 0})
    events.Reload()
    scalars = set(events.Tags()['scalars'])
    assert {'train/loss', 'train/acc', 'train/top3', 'train/lr', 'val/loss', 'val/acc', 'val/top3'} <= scalars
    assert [e.step for e in events.Scalars('val/acc')] == [6, 12]
    assert max(e.value for e in events.Scalars('val/acc')) == pytest.approx(best['monitor']['best'])
    assert 'val/predictions' in events.Tags()['images']


def test_eval_writes_results_that_match_the_predictions(trained):
    folder, _ = trained
    checkpoint = os.path.join(folder, 'best.pth')
    result = run_script(
        'eval.py',
        '--load_model_path',
        checkpoint,
        '--batch_size',
        '16',
        '--viz_freq',
        '2',
        '--no-progress_bar',
        '--num_workers',
        '0',
        '--cpu',  # as it was trained: the numbers are compared with training's below
    )
    assert result.returncode == 0, result.stderr
    out = os.path.join(folder, 'eval', 'best_val_default')
    assert out in result.stdout

    with open(os.path.join(out, 'result.txt')) as f:
        lines = dict(line.rstrip('\n').split(': ', 1) for line in f)
    assert lines['samples'] == '48' and lines['checkpoint'] == checkpoint
    with open(os.path.join(out, 'result.json')) as f:
        summary = json.load(f)
    with open(os.path.join(out, 'predictions.csv')) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 48
    correct = sum(row['label'] == row['prediction'] for row in rows)
    assert float(lines['acc']) == pytest.approx(correct / 48, abs=1e-4)
    assert summary['metrics']['acc'] == pytest.approx(correct / 48)
    matrix = summary['confusion_matrix']
    assert sum(map(sum, matrix)) == 48 and sum(matrix[i][i] for i in range(6)) == correct
    # the validation accuracy of the best epoch is what eval measures on the same list
    best = torch.load(checkpoint, weights_only=True, map_location='cpu')
    assert best['monitor']['best'] == pytest.approx(correct / 48, abs=1e-6)
    # so is the validation loss: result.txt has it
    assert float(lines['loss']) == pytest.approx(
        best['history']['metrics']['val/loss'][best['position']['epoch'] - 1], abs=1e-4
    )
    # 48 images / 16 = 3 batches, a picture for batches 0 and 2
    assert sorted(f for f in os.listdir(out) if f.startswith('predictions_batch')) == [
        'predictions_batch0000.png',
        'predictions_batch0002.png',
    ]
    assert os.path.getsize(os.path.join(out, 'confusion_matrix.png')) > 0


def test_eval_on_another_list_names_the_result_folder_after_it(trained, tiny_shapes):
    folder, _ = trained
    result = run_script(
        'eval.py',
        '--load_model_path',
        os.path.join(folder, 'last.pth'),
        '--val_list',
        os.path.join(tiny_shapes, 'train.txt'),
        '--save_prefix',
        'again',
        '--no-save_viz',
        '--no-progress_bar',
    )
    assert result.returncode == 0, result.stderr
    out = os.path.join(folder, 'eval', 'last_train_again')
    with open(os.path.join(out, 'result.txt')) as f:
        assert 'samples: 96' in f.read()
    assert not [f for f in os.listdir(out) if f.startswith('predictions_batch')]


def test_result_json_is_strict_json_when_a_class_has_no_samples(trained, tiny_shapes, tmp_path):
    """A validation list without class 0 made result.json hold `NaN` (its recall), which JSON readers
    other than Python's refuse: it is null now."""
    folder, _ = trained
    lines = open(os.path.join(tiny_shapes, 'val.txt')).read().splitlines()
    (tmp_path / 'classes.txt').write_text(open(os.path.join(tiny_shapes, 'classes.txt')).read())
    (tmp_path / 'no_zero.txt').write_text(
        ''.join(f'{os.path.join(tiny_shapes, path)} {label}\n' for path, label in map(str.split, lines) if label != '0')
    )
    result = run_script(
        'eval.py', '--load_model_path', os.path.join(folder, 'last.pth'), '--val_list', tmp_path / 'no_zero.txt',
        '--no-save_viz', '--no-progress_bar',
    )  # fmt: skip
    assert result.returncode == 0, result.stderr

    def refuse(constant):
        raise ValueError(f'{constant} is not JSON')

    named = tmp_path / "no zero, 'v2'.txt"  # a result folder named after it needs no quotes in a shell
    shutil.copy(tmp_path / 'no_zero.txt', named)
    again = run_script(
        'eval.py', '--load_model_path', os.path.join(folder, 'last.pth'), '--val_list', named, '--no-save_viz',
        '--no-progress_bar',
    )  # fmt: skip
    assert again.returncode == 0 and os.path.isdir(os.path.join(folder, 'eval', 'last_no_zero_v2_default')), again
    with open(os.path.join(folder, 'eval', 'last_no_zero_default', 'result.json')) as f:
        metrics = json.loads(f.read(), parse_constant=refuse)['metrics']
    first = open(os.path.join(tiny_shapes, 'classes.txt')).read().split()[0]
    assert metrics[f'recall/{first}'] is None and 0 <= metrics['acc'] <= 1


def test_a_list_whose_classes_txt_orders_the_classes_otherwise_is_numbered_by_name(trained, tiny_shapes, tmp_path):
    """Labels are positions in classes.txt: a list whose classes.txt orders the names otherwise is numbered
    as the checkpoint's classes (it was scored against the wrong classes without a word, then refused);
    one that names a class the model lacks is one line."""
    folder, _ = trained
    with open(os.path.join(tiny_shapes, 'classes.txt')) as f:
        names = f.read().split()
    with open(os.path.join(tiny_shapes, 'val.txt')) as f:
        lines = [line.split() for line in f if line.strip()]
    (tmp_path / 'classes.txt').write_text('\n'.join(reversed(names)) + '\n')
    flipped = ''.join(f'{os.path.join(tiny_shapes, p)} {len(names) - 1 - int(label)}\n' for p, label in lines)
    (tmp_path / 'reversed.txt').write_text(flipped)  # the same images and classes, numbered backwards
    results = {}
    for name, val_list in (('same', os.path.join(tiny_shapes, 'val.txt')), ('reversed', tmp_path / 'reversed.txt')):
        result = run_script(
            'eval.py', '--load_model_path', folder, '--val_list', val_list, '--save_prefix', name, '--no-progress_bar'
        )
        assert result.returncode == 0, result.stdout + result.stderr
        (evaluated,) = glob.glob(os.path.join(folder, 'eval', f'best_*_{name}'))
        with open(os.path.join(evaluated, 'result.json')) as f:
            results[name] = json.load(f)
        with open(os.path.join(evaluated, 'predictions.csv')) as f:
            rows = list(csv.DictReader(f))
        assert [row['label_name'] for row in rows] == [names[int(label)] for _, label in lines]
    assert results['reversed']['metrics'] == results['same']['metrics']
    assert results['reversed']['class_names'] == names

    (tmp_path / 'classes.txt').write_text('\n'.join(reversed(names[:-1] + ['hexagon'])) + '\n')
    runs = [
        run_script(
            'eval.py', '--load_model_path', folder, '--val_list', tmp_path / 'reversed.txt', '--no-progress_bar'
        ),
        run_script(
            'train.py',
            *tiny_run_args(tiny_shapes, tmp_path / 'ck'),
            '--val_list',
            tmp_path / 'reversed.txt',
            '--max_iteration',
            '1',
        ),
    ]
    for result in runs:
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stdout + result.stderr
        assert 'classes.txt names the classes hexagon, cross' in lines[0] and 'circle, square' in lines[0], lines[0]
    assert not (tmp_path / 'ck' / 'small_cnn_list_default').exists()  # no folder left behind
    assert not os.path.exists(os.path.join(folder, 'eval', 'best_reversed_default'))


@pytest.mark.parametrize('named', [False, True], ids=['numbers', 'numbers-and-a-name'])
def test_validation_class_folders_are_numbered_by_their_names(tiny_shapes, tmp_path, named):
    """Class folders named by numbers (as MNIST's are) and a validation set lacking one: validation's
    folder '3' is class 3, not 2 (its place among validation's folders: the check skipped names that look
    like numbers, and every image after the gap was scored against the wrong class); a name written
    decomposed, as macOS writes file names, is the same class as its composed form."""
    import unicodedata

    import eval as evaluation
    import train

    composed = 'gr\u00fcn'
    with open(os.path.join(tiny_shapes, 'train.txt')) as f:
        images = [os.path.join(tiny_shapes, line.split()[0]) for line in f if line.strip()]
    decomposed = unicodedata.normalize('NFD', composed)
    extra = {'train': [composed], 'val': [decomposed]} if named else {'train': [], 'val': []}
    names = {'train': ['0', '1', '2', '3', *extra['train']], 'val': ['0', '1', '3', *extra['val']]}
    for split, folders in names.items():
        for number, name in enumerate(folders):
            (tmp_path / split / name).mkdir(parents=True)
            for image in images[number * 4 : number * 4 + 4]:
                shutil.copy(image, tmp_path / split / name)
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--epochs', '1', '--loggers', 'csv', '--img_size', '32']
    args[args.index('--train_list') + 1], args[args.index('--val_list') + 1] = tmp_path / 'train', tmp_path / 'val'
    args = [str(arg) for arg in args]
    trainer = train.start(args)
    val = trainer.val_data.dataset
    assert val.class_names == names['train']
    labels = {os.path.basename(os.path.dirname(path)): label for path, label, _ in val.samples}
    assert labels == {'0': 0, '1': 1, '3': 3, **dict.fromkeys(extra['val'], 4)}, labels
    assert trainer.run() is None
    folder = experiment_of(args)
    evaluation.main(['--load_model_path', folder, '--no-progress_bar', '--cpu'])
    (evaluated,) = glob.glob(os.path.join(folder, 'eval', '*'))
    with open(os.path.join(evaluated, 'predictions.csv')) as f:
        rows = list(csv.DictReader(f))
    named_rows = {unicodedata.normalize('NFC', os.path.basename(os.path.dirname(row['image']))): row for row in rows}
    expected = {'0': ('0', '0'), '1': ('1', '1'), '3': ('3', '3'), **({composed: ('4', composed)} if named else {})}
    assert {name: (row['label'], row['label_name']) for name, row in named_rows.items()} == expected


def test_saved_args_given_back_with_config_reproduce_the_run(trained, tmp_path):
    folder, _ = trained
    ck = str(tmp_path)
    result = run_script(
        'train.py', '--config', os.path.join(folder, 'args.yaml'), '--save_prefix', 'replay', '--checkpoints_dir', ck
    )
    assert result.returncode == 0, result.stderr
    first = torch.load(os.path.join(folder, 'last.pth'), weights_only=True, map_location='cpu')['model']
    second = torch.load(os.path.join(ck, 'small_cnn_list_replay', 'last.pth'), weights_only=True, map_location='cpu')[
        'model'
    ]
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_a_fine_tuned_runs_args_yaml_names_its_weights_from_anywhere_and_eval_takes_it_for_that_run(
    trained, tiny_args, tmp_path
):
    """A relative --load_model_path was saved as given: `--config args.yaml` from another folder loaded
    other weights or none; and eval.py --config of a fine-tuned run evaluated the weights it started from,
    writing into that other run's folder."""
    folder, _ = trained
    relative = os.path.relpath(folder, REPO)
    _train(tiny_args, '--epochs', '1', '--save_prefix', 'tuned', '--load_model_path', relative)
    tuned = _experiment(tiny_args, 'tuned')
    with open(os.path.join(tuned, 'args.yaml')) as f:
        assert yaml.safe_load(f)['load_model_path'] == folder
    with open(os.path.join(tuned, 'reproduce.json')) as f:
        assert json.load(f)[-1]['args']['load_model_path'] == folder
    before = sorted(os.listdir(folder))
    evaluated = run_script('eval.py', '--config', os.path.join(tuned, 'args.yaml'), '--no-progress_bar')
    assert evaluated.returncode == 0, evaluated.stderr
    assert evaluated.stdout.startswith(os.path.join(tuned, 'best.pth') + ':'), evaluated.stdout
    assert os.path.isdir(os.path.join(tuned, 'eval')) and sorted(os.listdir(folder)) == before


def test_a_glob_of_checkpoints_leaves_out_files_that_are_none(tmp_path, capsys):
    """'ck/*' took a notes.txt beside the experiments for a checkpoint and stopped on it; and stopped on a run
    stopped before its first validation (no best.pth yet), where the others can be compared."""
    from utils.run_folder import checkpoint_path, checkpoints_to_evaluate

    (tmp_path / 'run').mkdir()
    (tmp_path / 'young').mkdir()
    for name in (
        'run/args.yaml',
        'run/best.pth',
        'young/args.yaml',
        'young/last.pth',
        'notes.txt',
        'weights.safetensors',
    ):
        (tmp_path / name).write_text('x')
    assert checkpoints_to_evaluate([str(tmp_path / '*')]) == [
        str(tmp_path / 'run' / 'best.pth'),
        str(tmp_path / 'weights.safetensors'),
    ]
    young = tmp_path / 'young'
    assert capsys.readouterr().out == f'note: {young} has no best.pth yet: left out (give its last.pth to compare it)\n'
    with pytest.raises(KilnError, match=r'--load_model_path .*\*.txt matches no checkpoint'):
        checkpoints_to_evaluate([str(tmp_path / '*.txt')])
    with pytest.raises(KilnError, match=r'has no best.pth yet; give its last.pth instead'):  # named: not left out
        checkpoints_to_evaluate([str(young)])
    # the checkpoints folder itself: 'ck/best.pth does not exist'
    glob_of_them = re.escape(f"or a quoted glob such as '{tmp_path}/*' to compare them")
    with pytest.raises(
        KilnError, match=rf'is no experiment folder but holds 1 \(run\): give one of them, {glob_of_them}'
    ):
        checkpoints_to_evaluate([str(tmp_path)])
    with pytest.raises(KilnError, match=r'holds 1 \(run\): give one of them$'):  # train.py's, predict.py's: one
        checkpoint_path(str(tmp_path))


def test_command_line_overrides_config(tiny_args, tmp_path):
    config = tmp_path / 'run.json'
    config.write_text(json.dumps({'epochs': 5, 'lr': 0.01, 'save_prefix': 'fromfile', 'progress_bar': False}))
    _train(tiny_args, '--config', str(config), '--epochs', '1')
    with open(os.path.join(_experiment(tiny_args, 'fromfile'), 'args.yaml')) as f:
        saved = yaml.safe_load(f)
    assert saved['epochs'] == 1 and saved['lr'] == 0.01 and saved['progress_bar'] is False


def test_load_not_strict_reuses_a_checkpoint_with_another_head(trained, tiny_args):
    folder, _ = trained
    result = _train(
        tiny_args,
        '--epochs',
        '1',
        '--num_classes',
        '8',
        '--save_prefix',
        'eight',
        '--load_model_path',
        os.path.join(folder, 'best.pth'),
        '--load_not_strict',
    )
    assert 'skipped 2 for shape' in result.stdout
    assert 'head.weight (6, 64) in file vs (8, 64) in model' in result.stdout


# resnet18 is slow to train on a CPU: tests/test_units.py only builds it and runs a forward pass
@pytest.mark.parametrize('model', ['linear'])
def test_other_models_train(tiny_args, model):
    from argparse import Namespace

    from model.model_entry import select_model

    _train(tiny_args, '--model_type', model, '--epochs', '1')
    folder = _experiment(tiny_args, model=model)
    best = torch.load(os.path.join(folder, 'best.pth'), weights_only=True, map_location='cpu')
    assert best['args']['model_type'] == model and best['position']['step'] == 6  # 96 images / 16 per batch
    torch.manual_seed(0)  # --seed 0: the run's initial weights
    initial = select_model(Namespace(model_type=model, num_classes=6, img_size=32)).state_dict()
    assert initial.keys() == best['model'].keys()
    assert not any(torch.equal(initial[name], best['model'][name]) for name in initial)  # every tensor trained
    with open(os.path.join(folder, 'history.json')) as f:
        validated = json.load(f)['metrics']['val/acc']
    assert len(validated) == 1 and 0 <= validated[0] <= 1


@pytest.mark.slow
def test_scripts_train_then_eval_on_the_default_dataset(tmp_path):
    """The bash scripts as shipped, on the real default dataset (generated into tmp), one epoch."""
    env = {'EPOCHS': '1', 'SAVE_PREFIX': 'script'}
    common = ['--data_root', str(tmp_path / 'gen'), '--no-progress_bar']
    train = run_script('bash', 'scripts/train.sh', '--checkpoints_dir', str(tmp_path / 'ck'), *common, env=env)
    assert train.returncode == 0, train.stderr
    assert os.path.isfile(tmp_path / 'gen' / 'shapes' / 'images' / 'train' / '05999.png')
    checkpoint = tmp_path / 'ck' / 'small_cnn_shapes_script' / 'best.pth'
    evaluate = run_script('bash', 'scripts/eval.sh', *common, env={'CHECKPOINT': str(checkpoint)})
    assert evaluate.returncode == 0, evaluate.stderr
    with open(tmp_path / 'ck' / 'small_cnn_shapes_script' / 'eval' / 'best_val_default' / 'result.txt') as f:
        result = f.read()
    assert 'samples: 1200' in result
    # one epoch on 6000 images already beats chance (1/6) by far
    accuracy = float(result.split('acc: ')[1].split()[0])
    assert accuracy > 0.3


def test_quickstart_trains_and_evaluates_into_checkpoints_dir(tiny_shapes, tmp_path):
    """quickstart.sh looked for its run in the project's checkpoints/ alone: given --checkpoints_dir (a
    project that is not yours to write) it trained, then said there was nothing to evaluate."""
    lists = tiny_run_args(tiny_shapes, tmp_path)[:6]  # --data_type list and the two lists
    quick = ['bash', 'scripts/quickstart.sh', *lists, '--model_type', 'linear', '--max_iteration', '1', '--cpu']
    ran = run_script(*quick, '--no-progress_bar', env={'CHECKPOINTS_DIR': str(tmp_path / 'mine')})
    assert ran.returncode == 0, ran.stdout + ran.stderr
    (run,) = os.listdir(tmp_path / 'mine')
    assert os.path.isfile(tmp_path / 'mine' / run / 'eval' / 'best_val_quickstart' / 'result.txt')
    refused = run_script(*quick, '--checkpoints_dir', tmp_path / 'other')
    assert refused.returncode == 2 and 'takes CHECKPOINTS_DIR=DIR before the command' in refused.stderr
    assert not (tmp_path / 'other').exists()
    for option in (['--save_prefix', 'mine'], ['--fast_dev_run']):  # trained, then found no run of its name
        refused = run_script(*quick, *option, env={'CHECKPOINTS_DIR': str(tmp_path / 'mine')})
        assert refused.returncode == 2 and 'quickstart.sh names its run itself' in refused.stderr, refused.stderr
        assert os.listdir(tmp_path / 'mine') == [run]


def test_eval_script_evaluates_the_newest_best_checkpoint(tiny_shapes, tmp_path):
    """scripts/eval.sh without CHECKPOINT named the default classification run's folder, which another task,
    model or dataset (or a project from scripts/new_task.py) never makes: it takes the newest best.pth."""
    for prefix in ('older', 'newer'):
        train_succeeds(tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--max_iteration', '2', '--save_prefix', prefix)
    older = tmp_path / 'ck' / 'small_cnn_list_older'
    os.utime(older / 'best.pth', (1_000_000_000, 1_000_000_000))  # made long ago
    result = run_script(
        'bash', 'scripts/eval.sh', '--cpu', '--no-progress_bar', env={'CHECKPOINTS_DIR': str(tmp_path / 'ck')}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert os.listdir(tmp_path / 'ck' / 'small_cnn_list_newer' / 'eval') == ['best_val_default']
    assert not (older / 'eval').exists()


def test_scripts_read_relative_paths_from_the_working_folder_and_run_through_links(tiny_shapes, tmp_path):
    """The scripts changed to the project's folder first: from elsewhere a relative --checkpoints_dir went
    into the project (while train.py printed it as relative), CHECKPOINT=ck/... was not found, and a link
    to a script looked for train.py beside the link."""
    args = tiny_run_args(tiny_shapes, 'ck')  # relative: the working folder's
    os.symlink(os.path.join(REPO, 'scripts', 'eval.sh'), tmp_path / 'evaluate.sh')
    env = {'EPOCHS': '1', 'SAVE_PREFIX': 'here'}
    trained = run_script(
        'bash', os.path.join(REPO, 'scripts', 'train.sh'), *args, '--model_type', 'linear', cwd=tmp_path, env=env
    )
    assert trained.returncode == 0, trained.stderr
    checkpoint = os.path.join('ck', 'linear_list_here', 'best.pth')
    assert os.path.isfile(tmp_path / checkpoint) and not os.path.exists(os.path.join(REPO, 'ck'))
    evaluated = run_script(
        'bash', 'evaluate.sh', '--cpu', '--no-progress_bar', cwd=tmp_path, env={'CHECKPOINT': checkpoint}
    )
    assert evaluated.returncode == 0, evaluated.stderr
    assert os.listdir(tmp_path / 'ck' / 'linear_list_here' / 'eval') == ['best_val_default']


def test_a_comparison_of_checkpoints_validated_on_different_lists_names_each_list(tiny_shapes, tmp_path):
    """Without --val_list each checkpoint is evaluated on its own validation list: the table mixed results
    on different data without a word; it now has a list column (and none when the lists are the same)."""
    other = tmp_path / 'other_val.txt'
    with open(os.path.join(tiny_shapes, 'val.txt')) as f:
        other.write_text(''.join(f'{os.path.join(tiny_shapes, line)}' for line in f.readlines()[:20]))
    shutil.copy(os.path.join(tiny_shapes, 'classes.txt'), tmp_path)
    for prefix, val_list in (('a', os.path.join(tiny_shapes, 'val.txt')), ('b', str(other))):
        args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--max_iteration', '2', '--save_prefix', prefix]
        args[args.index('--val_list') + 1] = val_list
        train_succeeds(args)
    pattern = str(tmp_path / 'ck' / 'small_cnn_list_*')
    result = run_script(
        'eval.py',
        '--load_model_path',
        pattern,
        '--cpu',
        '--no-progress_bar',
        '--save_prefix',
        'cmp',
        '--checkpoints_dir',
        tmp_path / 'ck',
    )
    assert result.returncode == 0 and '--val_list to compare on one' in result.stdout, result.stdout + result.stderr
    with open(tmp_path / 'ck' / 'comparisons' / 'val_cmp' / 'comparison.csv') as f:
        rows = list(csv.DictReader(f))
    assert [row['list'] for row in rows] == [os.path.join(tiny_shapes, 'val.txt'), str(other)]
    header = (tmp_path / 'ck' / 'comparisons' / 'val_cmp' / 'comparison.txt').read_text().split()[:3]
    assert header == ['checkpoint', 'list', 'loss']


def test_the_progress_bar_shows_where_stderr_is_read_live_not_in_log_files(tiny_shapes, tmp_path, monkeypatch):
    """Without --progress_bar, a bar is drawn only where stderr is a terminal or PyCharm's console: a
    log file (here, captured stderr) would keep every redraw. --progress_bar forces it, --no-progress_bar
    stops it."""
    args = [arg for arg in tiny_run_args(tiny_shapes, tmp_path / 'ck') if arg != '--no-progress_bar']
    args += ['--epochs', '1', '--loggers', 'csv']

    def bar_drawn(*extra, prefix):
        result = run_script('train.py', *args, *extra, '--save_prefix', prefix)
        assert result.returncode == 0, result.stderr
        return 'batch/s' in result.stderr

    assert not bar_drawn(prefix='log_file')
    assert bar_drawn('--progress_bar', prefix='forced')
    assert not bar_drawn('--no-progress_bar', prefix='stopped')
    monkeypatch.setenv('PYCHARM_HOSTED', '1')
    assert bar_drawn(prefix='pycharm')


def _train_in_a_terminal(args, columns, rows, **environment):
    """train.py's output in a pseudo-terminal of `columns` x `rows`, as the bytes it wrote there."""
    import fcntl
    import struct
    import subprocess
    import sys
    import termios

    main, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack('HHHH', rows, columns, 0, 0))
    env = {key: value for key, value in os.environ.items() if key not in ('PYCHARM_HOSTED', 'TERM')}
    process = subprocess.Popen(
        [sys.executable, 'train.py', *args],
        cwd=REPO,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env={**env, 'TERM': 'xterm', **environment},
    )
    os.close(terminal)
    output = b''
    try:
        while chunk := os.read(main, 65536):
            output += chunk
    except OSError:  # EIO: the last process writing to the terminal has ended
        pass
    finally:
        os.close(main)
    assert process.wait(timeout=timeout(120)) == 0, output.decode(errors='replace')[-3000:]
    return output.decode(errors='replace')


def test_in_a_terminal_each_printed_line_starts_a_line_of_its_own(tiny_shapes, tmp_path):
    """The validation line was printed after the validation bar, which tqdm leaves with the cursor at the
    end of the epoch bar's line: every epoch's metrics were glued to a leftover bar. A terminal that says
    it is 0 x 0 (`script` from a job) showed no bar at all; TERM=dumb (no cursor moves) shows none."""
    args = [arg for arg in tiny_run_args(tiny_shapes, tmp_path / 'ck') if arg != '--no-progress_bar']
    args += ['--loggers', 'csv']
    output = _train_in_a_terminal([*args, '--save_prefix', 'sized'], 80, 30)
    assert 'batch/s' in output  # the bars were drawn
    starts = [output[max(0, at - 1)] for at in range(len(output)) if output.startswith('epoch 1/2 train/loss', at)]
    assert starts and set(starts) <= {'\r', '\n'}, output
    assert 'batch/s' in _train_in_a_terminal([*args, '--save_prefix', 'unsized'], 0, 0)
    assert 'batch/s' not in _train_in_a_terminal([*args, '--save_prefix', 'dumb'], 80, 30, TERM='dumb')


def test_a_closed_stderr_ends_the_run_quietly_as_a_closed_output_does(tiny_shapes, tmp_path):
    """`train.py 2>&1 >log | head`: the progress bar's write to the closed pipe ended the run with exit
    code 1 and 'error: Broken pipe; free disk space or fix the permissions' (to the closed pipe)."""
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    command = [sys.executable, 'train.py', *tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--progress_bar']
    try:
        result = subprocess.run(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=write_end, text=True, timeout=timeout(120)
        )
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stdout  # as a tool stopped by SIGPIPE


def test_the_printed_commands_paste_into_a_shell_with_spaces_in_paths(tiny_shapes, tmp_path):
    """They were printed unquoted: `python eval.py --load_model_path /tmp/sp ace/...` read /tmp/sp."""
    import shlex
    import subprocess
    import sys

    from conftest import REPO

    args = tiny_run_args(tiny_shapes, tmp_path / 'sp ace')
    trained = run_script('train.py', *args, '--max_iteration', '2', '--save_prefix', 'my run')
    assert trained.returncode == 0, trained.stderr
    commands = {line.split(':', 1)[0].strip(): line.split(':', 1)[1] for line in trained.stdout.splitlines()[-4:]}
    folder = tmp_path / 'sp ace' / 'small_cnn_list_my run'
    assert shlex.split(commands['TensorBoard']) == ['tensorboard', '--logdir', str(tmp_path / 'sp ace')]
    assert shlex.split(commands['train more'])[-3:] == [str(folder / 'last.pth'), '--max_iteration', '4']
    command = shlex.split(commands['evaluate'])
    assert command[:3] == ['python', 'eval.py', '--load_model_path'] and command[3] == str(folder / 'best.pth')
    evaluated = subprocess.run(
        [sys.executable, *command[1:], '--no-progress_bar'], cwd=REPO, capture_output=True, timeout=timeout()
    )
    assert evaluated.returncode == 0, evaluated.stderr
    with open(folder / 'args.txt') as f:  # its command line, joined with spaces, named another folder
        assert shlex.split(f.readline()[2:]) == [
            'train.py',
            *map(str, args),
            '--max_iteration',
            '2',
            '--save_prefix',
            'my run',
        ]


def test_results_go_to_output_dir_and_leave_the_experiment_folder_as_it_was(trained, tiny_shapes, tmp_path):
    """A read-only or shared experiment folder could not be evaluated (results went only beside the
    checkpoint, and the error pointed at --checkpoints_dir, which eval.py does not use for them)."""
    folder, _ = trained
    before = sorted(
        os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder) for name in names
    )
    out = tmp_path / 'out'
    evaluated = run_script('eval.py', '--load_model_path', folder, '--output_dir', out, '--no-progress_bar')
    assert evaluated.returncode == 0, evaluated.stderr
    experiment = os.path.basename(folder)
    assert (out / experiment / 'eval' / 'best_val_default' / 'result.txt').is_file()
    predicted = run_script(
        'predict.py', '--load_model_path', folder, '--input', os.path.join(tiny_shapes, 'val.txt'), '--output_dir', out
    )
    assert predicted.returncode == 0, predicted.stderr
    assert (out / experiment / 'predict' / 'best_val_default' / 'predictions.csv').is_file()
    after = sorted(
        os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder) for name in names
    )
    assert after == before
    blocked = tmp_path / 'file'
    blocked.write_text('not a folder')
    refused = run_script('eval.py', '--load_model_path', folder, '--output_dir', blocked / 'x', '--no-progress_bar')
    assert refused.returncode == 2 and 'give a folder you can write to as --output_dir' in refused.stderr, (
        refused.stderr
    )


def test_classes_beyond_the_named_ones_go_by_their_number(tiny_shapes, tmp_path):
    """--num_classes above classes.txt's count (what the label error suggested) crashed drawing pictures
    and writing results (IndexError on the names); a name given twice or an empty classes.txt is one line."""
    lists = tmp_path / 'lists'
    lists.mkdir()
    (lists / 'classes.txt').write_text('circle\nsquare\n')
    with open(os.path.join(tiny_shapes, 'val.txt')) as f:
        lines = [line.split() for line in f if line.strip()]
    (lists / 'all.txt').write_text(''.join(f'{os.path.join(tiny_shapes, p)} {label}\n' for p, label in lines))
    args = [
        *tiny_run_args(tiny_shapes, tmp_path / 'ck'),
        '--train_list',
        lists / 'all.txt',
        '--val_list',
        lists / 'all.txt',
    ]
    trained = run_script('train.py', *args, '--num_classes', '6', '--max_iteration', '2')
    assert trained.returncode == 0, trained.stdout + trained.stderr
    folder = tmp_path / 'ck' / 'small_cnn_list_default'
    evaluated = run_script('eval.py', '--load_model_path', folder, '--no-progress_bar')
    assert evaluated.returncode == 0, evaluated.stderr
    with open(folder / 'eval' / 'best_val_default' / 'result.json') as f:
        assert json.load(f)['class_names'] == ['circle', 'square', '2', '3', '4', '5']
    for content, needle in (
        ('circle\nsquare\ncircle\n', "names the class 'circle' twice"),
        ('', 'names no class'),
        ('\n  \n', 'names no class'),
    ):
        (lists / 'classes.txt').write_text(content)
        refused = run_script('train.py', *args, '--num_classes', '6', '--save_prefix', 'again')
        assert refused.returncode == 2 and needle in refused.stderr and len(refused.stderr.splitlines()) == 1, (
            refused.stderr
        )


def test_the_default_output_folders_are_the_projects_whatever_the_working_folder(tmp_path, monkeypatch):
    """`python ~/kiln/train.py` run from elsewhere generated the shapes (61 MB) and made checkpoints/ in the
    working folder; eval.py of a checkpoint did the same there. A folder given stays the user's."""
    from options import parse_args, parse_test_args, parse_train_args

    monkeypatch.chdir(tmp_path)
    for parser in (parse_train_args, parse_test_args):
        options = parse_args(parser, [])
        assert options.data_root == os.path.join(REPO, 'data', 'generated'), parser
    assert parse_args(parse_train_args, []).checkpoints_dir == os.path.join(REPO, 'checkpoints')
    assert parse_args(parse_train_args, ['--checkpoints_dir', 'mine']).checkpoints_dir == 'mine'


def test_list_files_are_saved_as_absolute_paths(tiny_shapes, tmp_path):
    """A list given relative to another folder was saved as typed: eval.py from the project folder then
    said 'list file L/val.txt does not exist', though training had printed the command to run. The same
    command again with --resume was then refused: 'L/val.txt (the run has /.../L/val.txt)'."""
    import subprocess
    import sys

    from conftest import REPO

    lists = tmp_path / 'L'
    lists.mkdir()
    with open(os.path.join(tiny_shapes, 'val.txt')) as f:
        lines = [line.split() for line in f if line.strip()]
    (lists / 'val.txt').write_text(''.join(f'{os.path.join(tiny_shapes, p)} {label}\n' for p, label in lines))
    args = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--train_list', 'L/val.txt', '--val_list', 'L/val.txt']
    trained = subprocess.run(
        [sys.executable, os.path.join(REPO, 'train.py'), *map(str, args), '--max_iteration', '1'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout(),
    )
    assert trained.returncode == 0, trained.stderr
    folder = tmp_path / 'ck' / 'small_cnn_list_default'
    with open(folder / 'args.yaml') as f:
        assert yaml.safe_load(f)['val_list'] == str(lists / 'val.txt')
    evaluated = run_script('eval.py', '--load_model_path', folder, '--no-progress_bar')  # from the project folder
    assert evaluated.returncode == 0, evaluated.stderr
    resumed = subprocess.run(  # the same command, as a job script repeats it, with --resume: goes on
        [sys.executable, os.path.join(REPO, 'train.py'), *map(str, args), '--max_iteration', '2', '--resume'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout(),
    )
    assert resumed.returncode == 0, resumed.stderr
    assert 'resuming' in resumed.stdout, resumed.stdout


def test_validation_folders_of_a_training_list_without_names_take_its_numbers(tiny_shapes, tmp_path):
    """A training list with labels 0 to 10 and no classes.txt, validated on folders 0 to 10: validation
    numbered the folders in their sorted order (0, 1, 10, 2, ...), best.pth was picked on wrong labels.
    Folders named otherwise cannot be matched to bare numbers: one line."""
    import train
    from utils.errors import KilnError

    with open(os.path.join(tiny_shapes, 'train.txt')) as f:
        images = [os.path.join(tiny_shapes, line.split()[0]) for line in f if line.strip()]
    numbered = tmp_path / 'numbered'
    numbered.mkdir()
    lines = []
    for label in range(11):
        (tmp_path / 'val' / str(label)).mkdir(parents=True)
        for image in images[label * 4 : label * 4 + 4]:
            lines.append(f'{image} {label}\n')
            shutil.copy(image, tmp_path / 'val' / str(label))
    (numbered / 'train.txt').write_text(''.join(lines))
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--epochs', '1', '--img_size', '32']
    args[args.index('--train_list') + 1], args[args.index('--val_list') + 1] = numbered / 'train.txt', tmp_path / 'val'
    args = [str(arg) for arg in args]
    trainer = train.start(args)
    labels = {int(os.path.basename(os.path.dirname(path))) for path, _, _ in trainer.val_data.dataset.samples}
    assert labels == set(range(11))
    assert all(
        int(os.path.basename(os.path.dirname(path))) == label for path, label, _ in trainer.val_data.dataset.samples
    )
    trainer.lock.release()

    for label in range(11):
        os.rename(tmp_path / 'val' / str(label), tmp_path / 'val' / f'class_{label}')
    args[args.index('--checkpoints_dir') + 1] = str(tmp_path / 'ck2')
    with pytest.raises(
        KilnError, match=r'has class folders class_0, class_1, class_10, .* by label number alone \(0 to 10\)'
    ):
        train.start(args)


def test_eval_and_predict_normalize_as_the_run_did(tiny_shapes, tmp_path):
    """eval.py's batches were built without the run's options: Kiln's normalization whatever the run had.
    With --normalize imagenet, eval.py's and predict.py's answers (class and confidence) agree image by image."""
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--epochs', '1', '--normalize', 'imagenet']
    train_succeeds(args)
    folder = experiment_of(args)
    saved = torch.load(os.path.join(folder, 'last.pth'), weights_only=True, map_location='cpu')
    assert saved['args']['normalize'] == 'imagenet'
    val = os.path.join(tiny_shapes, 'val.txt')
    assert run_script('eval.py', '--load_model_path', folder, '--cpu', '--no-progress_bar').returncode == 0
    unused = ['--topk', '2', '--checkpoints_dir', str(tmp_path / 'unused')]  # were taken silently
    predicted = run_script('predict.py', '--load_model_path', folder, '--input', val, '--cpu', *unused)
    assert predicted.returncode == 0, predicted.stderr  # predictions are top-1, beside the checkpoint
    assert 'note: predict.py does not use --topk, --checkpoints_dir: they act in training and evaluation only' in (
        predicted.stdout
    )
    (evaluated,) = glob.glob(os.path.join(folder, 'eval', '*', 'predictions.csv'))
    (predicted,) = glob.glob(os.path.join(folder, 'predict', '*', 'predictions.csv'))
    with open(evaluated) as f, open(predicted) as g:
        evaluations, predictions = list(csv.DictReader(f)), list(csv.DictReader(g))
    assert len(evaluations) == len(predictions) == 48
    answers = {row['image']: (row['prediction_name'], row['confidence']) for row in predictions}
    assert {row['image']: (row['prediction_name'], row['confidence']) for row in evaluations} == answers
    # fine-tuned with this model's own default (kiln): said, since its weights saw the other
    tuned = train_succeeds(args[: args.index('--normalize')], '--load_model_path', folder, '--save_prefix', 'tuned')
    assert 'was trained on images normalized with --normalize imagenet; this run uses kiln' in tuned.stdout


def test_an_eval_that_fails_half_way_leaves_no_result_folder(trained, monkeypatch):
    """Pictures are written while the evaluation runs: an eval.py that failed at its 6th batch left a
    folder of pictures, and the same command was then refused ('already exists')."""
    import eval as evaluation
    from tasks.task import Task
    from utils.errors import KilnError

    folder, _ = trained
    forward, batches = Task.forward, []

    def failing(self, model, batch):
        batches.append(len(batch['image']))
        if len(batches) == 6:
            raise KilnError('the disk holding the images is gone')
        return forward(self, model, batch)

    monkeypatch.setattr(Task, 'forward', failing)
    command = ['--load_model_path', os.path.join(folder, 'last.pth'), '--viz_freq', '1', '--batch_size', '4']
    command += ['--num_workers', '0', '--save_prefix', 'halfway', '--no-progress_bar', '--cpu']
    with pytest.raises(KilnError, match='the disk holding the images is gone'):
        evaluation.main(command)
    assert not os.path.exists(os.path.join(folder, 'eval', 'last_val_halfway'))
    monkeypatch.setattr(Task, 'forward', forward)
    evaluation.main(command)  # the same command again
    pictures = glob.glob(os.path.join(folder, 'eval', 'last_val_halfway', '*_batch*.png'))
    assert len(pictures) == 12  # one per batch of 4


# results appear whole or not at all ------------------------------------------------------------------


def _staged(parent):
    """The staged (hidden, unfinished) result folders in `parent`."""
    return sorted(name for name in os.listdir(parent) if name.startswith('.') and '.tmp' in name)


def _assert_whole(folder, *names):
    """`folder` holds `names`, and no text in it names a staged folder (args.txt's result_dir, mask paths)."""
    assert set(names) <= set(os.listdir(folder)), os.listdir(folder)
    for name in os.listdir(folder):
        if name.endswith(('.txt', '.yaml', '.json', '.csv')):
            with open(os.path.join(folder, name)) as f:
                assert '.tmp' not in f.read(), name


def _killed_at(moment, *command):
    killed = run_script(*command, env={'KILN_KILL_AT': moment})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    return killed


EVAL = ('--cpu', '--no-progress_bar', '--num_workers', '0', '--viz_freq', '1')


@pytest.mark.parametrize('moment', ['temporary_written', 'writing_results', 'results_staged'])
def test_an_eval_killed_while_writing_leaves_no_result_folder_and_runs_again(trained, moment):
    """A SIGKILL while eval.py wrote predictions.csv left a result folder without it (while it wrote
    args.txt: an empty one), which looked real, and the same command was then refused ('already exists')."""
    experiment, _ = trained
    parent, prefix = os.path.join(experiment, 'eval'), f'killed_{moment}'
    folder = os.path.join(parent, f'best_val_{prefix}')
    command = ['eval.py', '--load_model_path', experiment, '--save_prefix', prefix, *EVAL]
    _killed_at(moment, *command)
    assert not os.path.exists(folder) and len(_staged(parent)) == 1
    running = os.path.join(parent, f'.best_val_other.tmp{os.getppid()}@{socket.gethostname()}')  # a live eval's
    os.makedirs(running)
    try:
        again = run_script(*command)  # the same command
        assert again.returncode == 0, again.stderr
        assert _staged(parent) == [os.path.basename(running)]  # the killed one's is gone, not the running one's
    finally:
        shutil.rmtree(running)
    assert f'results in {folder}: ' in again.stdout
    _assert_whole(folder, 'args.txt', 'args.yaml', 'result.txt', 'result.json', 'predictions.csv')
    assert 'predictions_batch0000.png' in os.listdir(folder) and 'confusion_matrix.png' in os.listdir(folder)
    with open(os.path.join(folder, 'args.txt')) as f:
        assert any(line.split() == ['result_dir', ':', folder] for line in f)


@pytest.mark.parametrize('moment', ['temporary_written', 'writing_results'])
def test_a_prediction_killed_while_writing_leaves_no_result_folder_and_runs_again(trained, tiny_shapes, moment):
    """predict.py killed at predictions.csv left its folder with only the options in it, which blocked the prefix."""
    experiment, _ = trained
    parent, prefix = os.path.join(experiment, 'predict'), f'killed_{moment}'
    folder = os.path.join(parent, f'best_val_{prefix}')
    command = ['predict.py', '--load_model_path', experiment, '--input', os.path.join(tiny_shapes, 'val.txt')]
    command += ['--save_prefix', prefix, '--cpu', '--no-progress_bar', '--num_workers', '0']
    _killed_at(moment, *command)
    assert not os.path.exists(folder)
    again = run_script(*command)
    assert again.returncode == 0, again.stderr
    assert f'48 images predicted in {folder}/predictions.csv' in again.stdout
    _assert_whole(folder, 'args.txt', 'args.yaml', 'predictions.csv')
    assert _staged(parent) == []


@pytest.mark.parametrize('moment', ['temporary_written', 'writing_results', 'writing_results:2'])
def test_a_comparison_killed_half_way_leaves_no_result_folder_and_runs_again(trained, tmp_path, moment):
    """A comparison killed while evaluating left an args-only comparison folder and an args-only result
    folder (the first checkpoint's, or the second's beside the first's whole one), and was refused again."""
    experiment, _ = trained
    checkpoints = [os.path.join(experiment, name) for name in ('best.pth', 'last.pth')]
    prefix = 'cmp_' + moment.replace(':', '_')
    folders = [os.path.join(experiment, 'eval', f'{name}_val_{prefix}') for name in ('best', 'last')]
    table = tmp_path / 'comparisons' / f'val_{prefix}'
    command = ['eval.py', '--load_model_path', *checkpoints, '--save_prefix', prefix, '--checkpoints_dir', tmp_path]
    _killed_at(moment, *command, *EVAL)
    assert not any(os.path.exists(folder) for folder in folders) and not table.exists()
    again = run_script(*command, *EVAL)
    assert again.returncode == 0, again.stderr
    assert f'comparison of 2 checkpoints in {table}: ' in again.stdout
    _assert_whole(table, 'args.txt', 'comparison.csv', 'comparison.txt')
    for folder in folders:
        _assert_whole(folder, 'result.txt', 'predictions.csv')
        assert f'results in {folder}: ' in again.stdout
    assert _staged(os.path.join(experiment, 'eval')) == _staged(tmp_path / 'comparisons') == []


def test_a_result_folder_made_while_results_are_written_is_not_replaced(tmp_path):
    """os.rename puts a folder in place of an empty one: the results are refused in one line instead."""
    from options import parse_args, parse_test_args
    from utils.errors import KilnError
    from utils.run_folder import StagedResults

    folder = tmp_path / 'eval' / 'best_val_x'
    with pytest.raises(KilnError, match=f'^{folder} appeared while this ran; choose a new --save_prefix$'):
        with StagedResults(str(folder), parse_args(parse_test_args, []), 'choose a new --save_prefix') as staged:
            (tmp_path / 'eval' / os.path.basename(staged.path) / 'result.txt').write_text('0.5\n')
            folder.mkdir()  # another command's, still empty
    assert os.listdir(tmp_path / 'eval') == ['best_val_x'] and os.listdir(folder) == []


def test_a_staged_folder_of_this_pid_left_by_another_process_is_removed(tmp_path):
    """In a container every start may get the same pid: a staged folder named with this process's pid that
    it did not make is a dead one's (its own mkdir then failed 'File exists'); its own are kept."""
    from options import parse_args, parse_test_args
    from utils.run_folder import StagedResults

    left = tmp_path / f'.best_val_x.tmp{os.getpid()}@{socket.gethostname()}'
    (left / 'result.txt').parent.mkdir()
    with StagedResults(str(tmp_path / 'best_val_x'), parse_args(parse_test_args, []), 'choose') as first:
        with StagedResults(str(tmp_path / 'last_val_x'), parse_args(parse_test_args, []), 'choose'):
            assert os.path.isdir(first.path)  # a second result folder beside it keeps this one's
    assert sorted(os.listdir(tmp_path)) == ['best_val_x', 'last_val_x']


@pytest.mark.parametrize('appears', ['before', 'between'])
def test_results_published_together_appear_all_or_none(tmp_path, monkeypatch, appears):
    """A comparison's result folders were renamed into place one by one: when a later one's name was taken
    meanwhile (another eval.py), those renamed before it stayed, and the comparison could not run again."""
    from options import parse_args, parse_test_args
    from utils.run_folder import PublishedTogether, StagedResults

    args, first, second = parse_args(parse_test_args, []), tmp_path / 'first', tmp_path / 'second'
    rename = StagedResults.rename_into_place

    def taken_between(staged):  # `first` appears once `second` (renamed first: the last added) is in place
        rename(staged)
        if staged.folder == str(second) and appears == 'between':
            first.mkdir()
            (first / 'mine.txt').write_text('mine')

    monkeypatch.setattr(StagedResults, 'rename_into_place', taken_between)
    with pytest.raises(KilnError, match='first appeared while this ran; choose'):
        with PublishedTogether() as together:
            for folder in (first, second):
                staged = together.enter_context(StagedResults(str(folder), args, 'choose'))
                with open(os.path.join(staged.path, 'result.txt'), 'w') as f:
                    f.write('x')
            if appears == 'before':
                first.mkdir()
                (first / 'mine.txt').write_text('mine')
    assert sorted(os.listdir(tmp_path)) == ['first'] and os.listdir(first) == ['mine.txt']


def test_a_result_folder_with_a_name_near_the_limit_is_staged_and_named_so(tmp_path):
    """The hidden name adds '.', '.tmp<pid>@<host>': a --save_prefix near the file system's 255 bytes, which
    an eval folder could take before, failed with 'File name too long'."""
    from options import parse_args, parse_test_args
    from utils.run_folder import StagedResults

    folder = tmp_path / ('best_val_' + 'p' * 240)
    with StagedResults(str(folder), parse_args(parse_test_args, []), 'choose') as staged:
        assert os.path.isdir(staged.path) and os.path.basename(staged.path).startswith('.')
    assert os.listdir(tmp_path) == [folder.name] and os.path.isfile(folder / 'args.yaml')


def test_a_result_name_past_the_limit_is_refused_before_evaluating(trained, tiny_shapes, tmp_path):
    """eval.py ran the whole evaluation, then failed renaming its results, naming the hidden staging folder
    and telling to free disk space; a run's folder named the wrong option too."""
    folder, _ = trained
    prefix = 'y' * 250
    evaluated = run_script('eval.py', '--load_model_path', folder, '--save_prefix', prefix, '--no-progress_bar')
    line = evaluated.stderr.strip()
    assert evaluated.returncode == 2 and '\n' not in line and 'acc' not in evaluated.stdout, evaluated.stdout + line
    assert line.endswith('above the 255 a file system takes; give a shorter --save_prefix (or folder name)'), line
    assert f'eval/best_val_{prefix}:' in line
    args = tiny_run_args(tiny_shapes, tmp_path)
    trained_again = run_script('train.py', *args, '--save_prefix', prefix)
    assert trained_again.returncode == 2 and 'give a shorter --save_prefix' in trained_again.stderr


def test_train_sh_leaves_a_config_and_a_resumed_run_their_settings(tiny_shapes, tmp_path):
    """scripts/train.sh passed --task classify --epochs 12 --batch_size 128 --lr 3e-3 every time: flags
    override a --config, so the config's settings were silently lost, and `train.sh --resume` of a run
    trained otherwise asked to change its batch size."""
    import sys

    import yaml

    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    at = args.index('--epochs')
    del args[at : at + 4]  # --epochs 2 --batch_size 16: the config's
    config = tmp_path / 'config.yaml'
    config.write_text('epochs: 1\nbatch_size: 8\nlr: 0.01\nmodel_type: linear\nsave_prefix: configured\n')
    script = os.path.join(REPO, 'scripts', 'train.sh')
    env = {'PYTHON': sys.executable}
    trained = run_script('bash', script, '--config', config, *args, env=env, timeout_seconds=300)
    assert trained.returncode == 0, trained.stderr
    folder = tmp_path / 'ck' / 'linear_list_configured'
    saved = yaml.safe_load((folder / 'args.yaml').read_text())
    assert (saved['task'], saved['epochs'], saved['batch_size'], saved['lr']) == ('classify', 1, 8, 0.01)
    resumed = run_script('bash', script, '--resume', folder, env=env, timeout_seconds=300)
    assert resumed.returncode == 0 and 'nothing left to train' in resumed.stdout, resumed.stderr
    longer = run_script('bash', script, '--resume', folder, env={**env, 'EPOCHS': '2'}, timeout_seconds=300)
    assert longer.returncode == 0, longer.stderr
    assert torch.load(folder / 'last.pth', weights_only=True, map_location='cpu')['position']['epoch'] == 2


def test_a_void_label_is_left_out_of_the_loss_and_the_metrics_with_ignore_index(tiny_shapes, tmp_path):
    """Masks with Pascal VOC's void (255 around each object) were refused with advice to raise
    --num_classes, which trains the void as a class and counts it in the mIoU. --ignore_index 255 leaves
    it out of the loss and the metrics (pixel accuracy over the other pixels); without it, the refusal
    says so."""
    import numpy as np
    from PIL import Image

    from conftest import tiny_seg_args

    lists = {}
    for split in ('train', 'val'):
        lines = []
        for line in open(os.path.join(tiny_shapes, f'seg_{split}.txt')).read().split('\n'):
            if line:
                image, mask = line.split()
                pixels = np.array(Image.open(os.path.join(tiny_shapes, mask)))
                pixels[:2] = 255  # a band of void along the top
                void = tmp_path / 'void' / mask
                void.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels).save(void)
                lines.append(f'{os.path.join(tiny_shapes, image)} {void}')
        lists[split] = tmp_path / 'void' / f'seg_{split}.txt'
        lists[split].write_text('\n'.join(lines) + '\n')
    (tmp_path / 'void' / 'seg_classes.txt').write_text(open(os.path.join(tiny_shapes, 'seg_classes.txt')).read())
    args = tiny_seg_args(tiny_shapes, tmp_path / 'ck') + ['--task', 'segment', '--epochs', '1', '--img_size', '32']
    args[args.index('--train_list') + 1], args[args.index('--val_list') + 1] = lists['train'], lists['val']
    refused = run_script('train.py', *args)
    assert refused.returncode == 2 and 'give --ignore_index 255 to leave it out' in refused.stderr, refused.stderr
    trained = run_script('train.py', *args, '--ignore_index', '255')
    assert trained.returncode == 0, trained.stderr
    folder = tmp_path / 'ck' / 'seg_net_seg_list_default'
    evaluated = run_script('eval.py', '--load_model_path', folder, '--cpu', '--no-progress_bar')
    assert evaluated.returncode == 0, evaluated.stderr
    (result,) = glob.glob(str(folder / 'eval' / '*' / 'result.json'))
    with open(result) as f:
        metrics = json.load(f)['metrics']
    assert 0 < metrics['pixel_acc'] < 1 and all(not name.endswith('/255') for name in metrics), metrics
    # per image, the rows count the pixels that are not void: the mean of the rows (the same pixels per
    # image) is the split's pixel accuracy
    (rows,) = glob.glob(str(folder / 'eval' / '*' / 'predictions.csv'))
    with open(rows) as f:
        accuracies = [float(row['pixel_accuracy']) for row in csv.DictReader(f)]
    assert abs(np.mean(accuracies) - metrics['pixel_acc']) < 1e-3
    wrong = run_script('train.py', *args, '--ignore_index', '3', '--save_prefix', 'three')
    assert wrong.returncode == 2 and '--ignore_index 3 is class 3 of 0..' in wrong.stderr, wrong.stderr
