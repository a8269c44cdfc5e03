"""A new task in minutes: the project generator, the segmentation example (through the same
Trainer/Evaluator design), predict.py, comparing checkpoints and TensorBoard hparams."""

import csv
import glob
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO, run_script, timeout, tiny_run_args, tiny_seg_args


def _ok(result):
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_generated_project_is_clean_registers_stubs_and_runs(tiny_shapes, tmp_path):
    dest = tmp_path / 'glaze'
    _ok(run_script('scripts/new_task.py', str(dest), '--name', 'Glaze', '--dataset', 'shards', '--model', 'shard_net'))
    files = {os.path.relpath(os.path.join(folder, name), dest) for folder, _, names in os.walk(dest) for name in names}
    assert not any(
        f.startswith(('.git/', 'data/generated/')) or '__pycache__' in f or '.pytest_cache' in f for f in files
    )
    assert [f for f in files if f.startswith('checkpoints/')] == ['checkpoints/.gitkeep']
    assert {
        'train.py',
        'eval.py',
        'predict.py',
        'README.md',
        '.ci/run',
        '.run/train.run.xml',
        'tests/conftest.py',
        'data/shards.py',
        'model/shard_net/shard_net.py',
        'model/shard_net/__init__.py',
    } <= files
    readme = (dest / 'README.md').read_text()
    assert readme.startswith('# Glaze') and not re.search(r'\bKiln\b', readme)  # KilnError is code, kept
    # the template's measured figures are not the project's: they read as Glaze's own with the name changed
    assert 'Not measured yet' in readme and 'img/s' not in readme and 'images/s' not in readme
    assert 'bench/bench_overhead.py' in readme  # how to measure stays
    assert "'shards': 'data.shards:ShardsDataset'," in (dest / 'data' / 'data_entry.py').read_text()
    assert "'shard_net': 'model.shard_net:ShardNet'," in (dest / 'model' / 'model_entry.py').read_text()

    # its own tests (the fast ones here; the whole suite is the template's) and its train.sh with the stubs
    _ok(
        subprocess.run(
            [sys.executable, '-m', 'pytest', '-q', '-n', '0', 'tests/test_units.py'],
            cwd=dest,
            capture_output=True,
            text=True,
            timeout=timeout(),
        )
    )
    trained = subprocess.run(
        [
            'bash',
            'scripts/train.sh',
            '--data_type',
            'shards',
            '--model_type',
            'shard_net',
            '--train_list',
            os.path.join(tiny_shapes, 'train.txt'),
            '--val_list',
            os.path.join(tiny_shapes, 'val.txt'),
            '--no-progress_bar',
            '--batch_size',
            '16',
        ],
        cwd=dest,
        capture_output=True,
        text=True,
        timeout=timeout(),
        env={**os.environ, 'EPOCHS': '1'},
    )
    _ok(trained)
    assert (dest / 'checkpoints' / 'shard_net_shards_default' / 'best.pth').is_file()


def test_generator_refuses_a_non_empty_destination(tmp_path):
    (tmp_path / 'mine.txt').write_text('keep me')
    result = run_script('scripts/new_task.py', str(tmp_path))
    assert result.returncode == 2 and result.stderr.startswith('error: ') and 'not an empty folder' in result.stderr
    assert os.listdir(tmp_path) == ['mine.txt'] and (tmp_path / 'mine.txt').read_text() == 'keep me'


def test_a_destination_that_cannot_be_written_or_links_into_the_template_is_one_line(tmp_path):
    """A DEST under a file gave a NotADirectoryError traceback; a DEST reached through a link into the
    template was taken as outside it, and the project was written into the template."""
    (tmp_path / 'afile').write_text('mine')
    under_a_file = run_script('scripts/new_task.py', str(tmp_path / 'afile' / 'project'))
    assert under_a_file.returncode == 2 and under_a_file.stderr.startswith(
        f'error: cannot write the new project into {tmp_path / "afile" / "project"}: Not a directory'
    ), under_a_file.stderr
    assert 'Traceback' not in under_a_file.stderr and os.listdir(tmp_path) == ['afile']
    os.symlink(REPO, tmp_path / 'kiln')
    linked = run_script('scripts/new_task.py', str(tmp_path / 'kiln' / 'my_project'))
    assert linked.returncode == 2 and 'is inside the template' in linked.stderr, linked.stderr
    assert not os.path.exists(os.path.join(REPO, 'my_project'))


def test_a_project_name_is_written_as_given_and_its_code_compiles(tmp_path):
    """--name went into re.sub as a replacement: 'Proj\\1' failed with a traceback half-way through the
    copy, 'C:\\new' wrote a newline into every file (such names are refused now: see below)."""
    name = 'Lab v2.1-beta_x'
    result = run_script('scripts/new_task.py', str(tmp_path / 'project'), '--name', name)
    assert result.returncode == 0, result.stderr
    readme = (tmp_path / 'project' / 'README.md').read_text()
    assert readme.startswith(f'# {name}\n'), readme[:80]
    pyproject = (tmp_path / 'project' / 'pyproject.toml').read_text()
    assert "name = 'lab-v2.1-beta_x'" in pyproject
    assert "'lab-v2.1-beta_x[trackers" in pyproject and "'kiln[" not in pyproject  # its dev extra names itself
    with open(os.path.join(REPO, 'pyproject.toml')) as f:
        made_from_kiln = "name = 'kiln'" in f.read()
    if made_from_kiln:  # (a project made from a project renames less)
        assert name in (tmp_path / 'project' / 'utils' / 'checkpoint.py').read_text()
    for path in (tmp_path / 'project').rglob('*.py'):
        compile(path.read_text(), str(path), 'exec')


@pytest.mark.parametrize('name', ["O'Brien", 'A"B', 'Lab{v2}', r'C:\new Lab', 'Ünï Cödé', '日本', '...', ''])
def test_a_project_name_the_code_cannot_hold_is_refused(tmp_path, name):
    """The name goes into Python strings, f-strings, .format templates and the package name unescaped:
    "O'Brien" was a SyntaxError in utils/checkpoint.py, 'A"B' broke `train.py --help`, 'Lab{v2}' sweep.py's
    SBATCH script, 'Ünï Cödé' became the package n-c-d, '日本' and '...' the package kiln."""
    result = run_script('scripts/new_task.py', str(tmp_path / 'project'), '--name', name)
    assert result.returncode == 2 and result.stderr.startswith(f'error: --name {name!r}: '), result.stderr
    assert 'ASCII letters, digits, spaces and . _ -' in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / 'project').exists()


@pytest.mark.parametrize('option, name', [('--model', 'class'), ('--task', 'import'), ('--dataset', 'lambda')])
def test_a_python_keyword_is_refused_as_a_stub_name(tmp_path, option, name):
    """--model class wrote `from model.class.class import Class`: training failed with a SyntaxError."""
    result = run_script('scripts/new_task.py', str(tmp_path / 'new'), option, name)
    assert result.returncode == 2 and result.stderr.startswith(f'error: {option} {name}: a Python keyword'), (
        result.stderr
    )
    assert not (tmp_path / 'new').exists()


def test_an_empty_destination_is_refused_and_the_next_step_is_quoted(tmp_path):
    """'' said 'error:  is inside the template'; `cd DEST` was printed unquoted: a folder with a space or a
    quote could not be pasted."""
    empty = run_script('scripts/new_task.py', '')
    assert empty.returncode == 2 and empty.stderr.startswith('error: DEST is empty'), empty.stderr
    dest = tmp_path / "my lab's project"
    made = run_script('scripts/new_task.py', str(dest), '--name', 'Lab')
    assert made.returncode == 0, made.stderr
    assert f'  cd {shlex.quote(str(dest))} && ' in made.stdout, made.stdout


def test_a_project_made_from_a_project_keeps_its_code(tmp_path):
    """A project named 'detect' made a project whose code had every 'detect' renamed: --task detect was gone.
    And a project copied from a read-only install kept its files read-only, and could not rename them."""
    assert run_script('scripts/new_task.py', str(tmp_path / 'first'), '--name', 'detect').returncode == 0
    os.chmod(tmp_path / 'first' / 'README.md', 0o444)  # a read-only install: the copy is the new project's own
    made = subprocess.run(
        [sys.executable, 'scripts/new_task.py', str(tmp_path / 'second'), '--name', 'boxes'],
        cwd=tmp_path / 'first',
        capture_output=True,
        text=True,
        timeout=timeout(),
    )
    assert made.returncode == 0, made.stderr
    second = tmp_path / 'second'
    assert (second / 'README.md').read_text().startswith('# boxes\n')
    assert os.stat(second / 'README.md').st_mode & 0o200
    assert "name = 'boxes'" in (second / 'pyproject.toml').read_text()
    assert "'detect': 'tasks.detect:DetectTask'," in (second / 'tasks' / 'task_entry.py').read_text()
    kiln = run_script('scripts/new_task.py', str(tmp_path / 'third'), '--name', 'Kiln')  # Kiln's code is kept by it
    assert kiln.returncode == 2 and "--name Kiln: that is the template's own name" in kiln.stderr, kiln.stderr


def test_a_new_task_is_what_the_project_s_scripts_train(tmp_path):
    """train.sh kept TASK=classify: the project's `bash scripts/train.sh` trained the template's task. And
    my_task, the name the registry's docstring gives as an example, was refused as taken."""
    created = run_script('scripts/new_task.py', str(tmp_path / 'spots'), '--task', 'my_task')
    assert created.returncode == 0, created.stderr
    for script in ('train.sh', 'train_ddp.sh'):
        lines = (tmp_path / 'spots' / 'scripts' / script).read_text().splitlines()
        assert "TASK=${TASK:-my_task}  # this project's task (tasks/task_entry.py)" in lines, script
    project = tmp_path / 'spots'
    assert "    'my_task': 'tasks.my_task:MyTaskTask',\n}" in (project / 'tasks' / 'task_entry.py').read_text()
    # and what its IDEs' training configurations train (they trained classify), checked by the project's own tests
    assert 'value="--task my_task --save_prefix pycharm"' in (project / '.run' / 'train.run.xml').read_text()
    assert 'train.py --task my_task --save_prefix pycharm_ddp' in (project / '.run' / 'train_ddp.run.xml').read_text()
    assert (project / '.vscode' / 'launch.json').read_text().count('"--task", "my_task", "--save_prefix"') == 2
    ide_tests = [sys.executable, '-m', 'pytest', '-q', '-n', '0', '-p', 'no:cacheprovider', 'tests/test_ide_configs.py']
    _ok(subprocess.run(ide_tests, cwd=project, capture_output=True, text=True, timeout=timeout()))


def test_a_project_made_from_a_copy_outside_git(tmp_path):
    """A project made from a project that is no git checkout, on a machine without git: git's absence was
    blamed on DEST; the README's title was read from its first line (a logo line: nothing renamed; a blank
    one: every file garbled); a registry with an annotation or no last comma gave a traceback and a half-made
    project; outputs that .gitignore names were copied, checkpoints/ anywhere dropped, a broken link refused."""
    first = tmp_path / 'first'
    assert run_script('scripts/new_task.py', str(first), '--name', 'model').returncode == 0
    readme = (first / 'README.md').read_text()
    (first / 'README.md').write_text('<p align="center"><img src="logo.png"></p>\n\n' + readme)
    entry = first / 'tasks' / 'task_entry.py'
    registry = entry.read_text()
    last_entry = "'detect': 'tasks.detect:DetectTask',\n}"  # to one in brackets, with no comma after it
    entry.write_text(
        registry.replace('TASKS = {', 'TASKS: dict[str, str] = {').replace(
            last_entry, last_entry.replace("'tasks.detect:DetectTask',", "('tasks.detect:DetectTask')")
        )
    )
    for output in ('mlruns/0/meta.yaml', 'cache.pyc', 'sub/checkpoints/keep.py'):
        (first / output).parent.mkdir(parents=True, exist_ok=True)
        (first / output).write_text('x = 1\n')
    os.symlink(tmp_path / 'gone', first / 'latest_run')

    def make(dest, *options):
        return subprocess.run(  # no git on PATH
            [sys.executable, 'scripts/new_task.py', str(tmp_path / dest), *options],
            cwd=first,
            capture_output=True,
            text=True,
            timeout=timeout(),
            env={**os.environ, 'PATH': str(tmp_path / 'no_git')},
        )

    made = make('second', '--name', 'Glaze', '--task', 'spots')
    assert made.returncode == 0 and 'not a git checkout' in made.stdout, made.stderr
    second = tmp_path / 'second'
    text = (second / 'README.md').read_text()
    assert text.startswith('<p align="center">') and '\n# Glaze\n' in text
    after_intro = '<!-- /intro -->'  # the title and intro alone change: 'model' is also a word of the text
    assert text.partition(after_intro)[2] == readme.partition(after_intro)[2]
    registry = (second / 'tasks' / 'task_entry.py').read_text()
    assert "('tasks.detect:DetectTask'),\n    'spots': 'tasks.spots:SpotsTask',\n}" in registry
    for path in second.rglob('*.py'):
        compile(path.read_text(), str(path), 'exec')
    assert not (second / 'mlruns').exists() and not (second / 'cache.pyc').exists()
    assert (second / 'sub' / 'checkpoints' / 'keep.py').is_file() and os.path.islink(second / 'latest_run')

    entry.write_text('TASKS = {\n')  # a registry that is no longer Python
    broken = make('third', '--task', 'spots')
    assert broken.returncode == 2 and len(broken.stderr.splitlines()) == 1, broken.stderr
    assert "error: the template's tasks/task_entry.py does not parse (" in broken.stderr
    assert not (tmp_path / 'third').exists()
    (first / 'README.md').write_text('no title\n')
    untitled = make('fourth')
    assert untitled.returncode == 2 and "README.md has no title line ('# Name')" in untitled.stderr, untitled.stderr
    assert not (tmp_path / 'fourth').exists()


def test_a_copy_of_kiln_outside_git_keeps_links_as_links(tmp_path):
    """A copy of Kiln outside git (an unpacked archive) wrote the project's name through a link into the
    file it points to, outside the project, and left out links to folders."""
    import io
    import tarfile

    template = tmp_path / 'kiln'
    template.mkdir()
    archive = subprocess.run(
        ['git', 'archive', '--format=tar', 'HEAD'], cwd=REPO, capture_output=True, check=True, timeout=timeout()
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(template, filter='data')
    outside = tmp_path / 'notes.md'
    outside.write_text('Kiln notes\n')
    os.symlink(outside, template / 'notes.md')
    (tmp_path / 'photos').mkdir()
    os.symlink(tmp_path / 'photos', template / 'my_photos')
    made = subprocess.run(  # no git on PATH
        [sys.executable, 'scripts/new_task.py', str(tmp_path / 'glaze'), '--name', 'Glaze'],
        cwd=template,
        capture_output=True,
        text=True,
        timeout=timeout(),
        env={**os.environ, 'PATH': str(tmp_path / 'no_git')},
    )
    assert made.returncode == 0 and 'not a git checkout' in made.stdout, made.stderr
    assert outside.read_text() == 'Kiln notes\n'
    glaze = tmp_path / 'glaze'
    assert os.readlink(glaze / 'notes.md') == str(outside) and os.readlink(glaze / 'my_photos') == str(
        tmp_path / 'photos'
    )
    assert (glaze / 'README.md').read_text().startswith('# Glaze\n')


@pytest.mark.parametrize(
    'option, name, where',
    [
        ('--task', 'classify', 'tasks/task_entry.py'),
        ('--dataset', 'shapes', 'data/data_entry.py'),
        ('--dataset', 'loader', 'data/loader.py'),  # not a dataset, but the stub would replace it
        ('--model', 'small_cnn', 'model/model_entry.py'),
        ('--model', 'submodules', 'model/submodules.py'),  # the package model/submodules/ hid it: no model imported
        ('--model', 'model_entry', 'model/model_entry.py'),
    ],
)
def test_generator_refuses_a_name_the_template_has(tmp_path, option, name, where):
    """The stub replaced Kiln's own file and its registry entry (--dataset shapes broke the default job)."""
    result = run_script('scripts/new_task.py', str(tmp_path / 'new'), option, name)
    assert result.returncode == 2 and result.stderr.startswith(f'error: {option} {name}: the template has'), (
        result.stderr
    )
    assert f'({where})' in result.stderr and not (tmp_path / 'new').exists()


@pytest.fixture(scope='module')
def segmented(tiny_shapes, tmp_path_factory):
    """A 2-epoch segmentation run through scripts/train_seg.sh on the tiny shapes' masks: its folder."""
    args = tiny_seg_args(tiny_shapes, tmp_path_factory.mktemp('seg'))
    result = subprocess.run(
        ['bash', 'scripts/train_seg.sh', *args[2:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(),
        env={**os.environ, 'EPOCHS': '2', 'BATCH_SIZE': '16', 'DATA_TYPE': 'seg_list'},
    )
    _ok(result)
    assert 'val/miou' in result.stdout
    return os.path.join(args[args.index('--checkpoints_dir') + 1], 'seg_net_seg_list_default')


def _checkpoint_step(folder):
    import torch

    return torch.load(os.path.join(folder, 'last.pth'), weights_only=True, map_location='cpu')['position']['step']


def test_train_seg_sh_resumes_a_run_with_its_own_epochs_and_batch_size(segmented, tmp_path):
    """train_seg.sh passed its --epochs 8 and --batch_size 64 on a resume too: a longer run was declared
    done at once (and one of another batch size refused)."""
    run = tmp_path / 'run'
    shutil.copytree(segmented, run)
    step = _checkpoint_step(run)
    resume = ['--resume', run, '--epochs', '3', '--cpu', '--no-progress_bar']
    _ok(run_script('bash', 'scripts/train_seg.sh', *resume, env={'DATA_TYPE': 'seg_list'}))
    assert _checkpoint_step(run) == step * 3 // 2  # 2 epochs of its batch size 16, then a third


def test_segmentation_trains_and_logs_masks(segmented):
    events = EventAccumulator(segmented, size_guidance={'images': 0, 'scalars': 0})
    events.Reload()
    assert {'train/pixel_acc', 'train/miou', 'val/pixel_acc', 'val/miou', 'val/loss'} <= set(events.Tags()['scalars'])
    assert 'val/segmentation' in events.Tags()['images']
    with open(os.path.join(segmented, 'history.json')) as f:
        assert len(json.load(f)['metrics']['val/miou']) == 2


def test_segmentation_eval_writes_exact_iou_and_pictures(segmented):
    result = _ok(
        run_script(
            'eval.py', '--load_model_path', os.path.join(segmented, 'best.pth'), '--no-progress_bar', '--viz_freq', '1'
        )
    )  # the task, model and data come from the checkpoint
    folder = os.path.join(segmented, 'eval', 'best_val_default')
    with open(os.path.join(folder, 'result.json')) as f:
        saved = json.load(f)
    matrix = np.array(saved['confusion_matrix'])
    assert matrix.shape == (7, 7) and matrix.sum() == 48 * 32 * 32  # every pixel counted once
    iou = np.diag(matrix) / (matrix.sum(0) + matrix.sum(1) - np.diag(matrix))
    assert saved['metrics']['miou'] == pytest.approx(np.nanmean(iou))
    assert saved['metrics']['pixel_acc'] == pytest.approx(np.trace(matrix) / matrix.sum())
    assert 'miou' in result.stdout
    picture = np.asarray(Image.open(os.path.join(folder, 'segmentation_batch0000.png')))
    assert picture.shape[1] == 3 * 96  # image | predicted mask | true mask
    with open(os.path.join(folder, 'predictions.csv')) as f:
        assert len(list(csv.reader(f))) == 49


def test_segment_task_needs_masks(tiny_shapes, tmp_path):
    result = run_script(
        'train.py', *tiny_run_args(tiny_shapes, tmp_path), '--task', 'segment', '--model_type', 'seg_net'
    )
    assert (
        result.returncode == 2
        and 'needs a dataset that gives mask' in result.stderr
        and 'Traceback' not in result.stderr
    )
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope='module')
def classified(tiny_shapes, tmp_path_factory):
    """Two 1-epoch classification runs (seeds 0 and 1): their experiment folders."""
    root = tmp_path_factory.mktemp('cls')
    folders = []
    for seed in ('0', '1'):
        _ok(
            run_script(
                'train.py',
                *tiny_run_args(tiny_shapes, root),
                '--epochs',
                '1',
                '--seed',
                seed,
                '--save_prefix',
                f'seed{seed}',
            )
        )
        folders.append(str(root / f'small_cnn_list_seed{seed}'))
    return folders


def test_predict_classification_reports_unreadable_images(tiny_shapes, classified, tmp_path):
    images = tmp_path / 'images'
    images.mkdir()
    for name in ('00000.png', '00001.png', '00002.png'):
        os.link(os.path.join(tiny_shapes, 'images', 'val', name), images / name)
    (images / '00001_broken.png').write_bytes(b'not an image')  # between two readable ones

    def predict_images(*options):
        return run_script(
            'predict.py', '--load_model_path', classified[0], '--input', images, '--no-progress_bar', *options
        )

    result = predict_images('--num_workers', '0')
    assert result.returncode == 2 and '1 of 4 images could not be read' in result.stderr
    folder = os.path.join(classified[0], 'predict', 'best_images_default')
    with open(os.path.join(folder, 'predictions.csv')) as f:
        rows = list(csv.DictReader(f))
    assert [os.path.basename(r['image']) for r in rows] == ['00000.png', '00001.png', '00002.png']
    assert all(r['prediction_name'] in ('circle', 'square', 'triangle', 'star', 'cross', 'ring') for r in rows)
    assert '00001_broken.png' in open(os.path.join(folder, 'unreadable.txt')).read()
    assert 'the others were predicted' in result.stderr
    # decoded by worker processes, in batches of 2: the same rows in the same order, the same reasons
    in_workers = predict_images('--num_workers', '2', '--batch_size', '2', '--save_prefix', 'workers')
    assert in_workers.returncode == 2 and '1 of 4 images could not be read' in in_workers.stderr
    other = os.path.join(classified[0], 'predict', 'best_images_workers')
    with open(os.path.join(other, 'predictions.csv')) as f:
        assert [(r['image'], r['prediction']) for r in csv.DictReader(f)] == [
            (r['image'], r['prediction']) for r in rows
        ]
    assert open(os.path.join(other, 'unreadable.txt')).read() == open(os.path.join(folder, 'unreadable.txt')).read()
    # a batch crosses from a worker as one tensor: 300 images in batches of 256 under 128 open files
    many = tmp_path / 'many'
    many.mkdir()
    for number in range(300):
        os.link(images / '00000.png', many / f'{number:03d}.png')
    limited = subprocess.run(
        [sys.executable, 'predict.py', '--load_model_path', classified[0], '--input', many, '--no-progress_bar']
        + ['--num_workers', '2', '--batch_size', '256', '--cpu'],  # (CUDA's own open files are not this test's)
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(300),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)),
    )
    assert limited.returncode == 0 and '300 images predicted' in limited.stdout, limited.stderr
    alone = run_script(  # nothing else to predict: no word of others
        'predict.py', '--load_model_path', classified[0], '--input', images / '00001_broken.png', '--no-progress_bar'
    )
    assert alone.returncode == 2 and '1 of 1 images could not be read' in alone.stderr, alone.stderr
    assert 'others' not in alone.stderr


WHO_DECODES = """
import os, sys, types, torch, predict
predict.decode_image = lambda path, *args, **kw: (torch.zeros(3, 2, 2, dtype=torch.uint8), (0, 0, 2, 2), os.getpid())
options = types.SimpleNamespace(num_workers=int(sys.argv[1]), batch_size=3, img_size=2, resize=None, crop_pct=None)
batches = list(predict.read_batches([f'{i}.png' for i in range(8)], options, []))
print([path for paths, *_ in batches for path in paths] == [f'{i}.png' for i in range(8)], len(batches))
print(len({size for *_, sizes in batches for size in sizes} - {os.getpid()}))
"""


@pytest.mark.parametrize('workers', [0, 2])
def test_predict_decodes_in_num_workers_processes(workers):
    """--num_workers was accepted and ignored: every image was decoded in the main process."""
    result = subprocess.run(
        [sys.executable, '-c', WHO_DECODES, str(workers)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(300),
    )
    assert result.returncode == 0, result.stderr
    in_order, others = result.stdout.split('\n')[:2]
    assert in_order == 'True 3' and int(others) == workers  # in order; each worker decoded some


def test_predict_takes_a_quoted_glob_and_names_its_folder_plainly(tiny_shapes, classified, tmp_path):
    """A quoted glob, as eval.py takes them, was 'does not exist'; the result folder kept the input's
    commas and quotes, so pasting its path needed quoting."""
    images = tmp_path / "my photos, it's"
    images.mkdir()
    for name in ('00000.png', '00001.png', '00002.png'):
        os.link(os.path.join(tiny_shapes, 'images', 'val', name), images / name)
    checkpoint = os.path.join(classified[0], 'best.pth')
    result = run_script('predict.py', '--load_model_path', checkpoint, '--input', images / '0000[01].png')
    assert result.returncode == 0, result.stderr
    folder = os.path.join(classified[0], 'predict', 'best_my_photos_it_s_default')
    with open(os.path.join(folder, 'predictions.csv')) as f:
        assert [os.path.basename(row['image']) for row in csv.DictReader(f)] == ['00000.png', '00001.png']
    # ** reaches any depth (it took one folder level, and said nothing of the rest)
    (images / 'sub' / 'deeper').mkdir(parents=True)
    os.link(images / '00002.png', images / 'sub' / 'deeper' / '00003.png')
    deep = run_script(
        'predict.py', '--load_model_path', checkpoint, '--input', images / '**' / '*.png', '--save_prefix', 'deep'
    )
    assert deep.returncode == 0 and '4 images predicted' in deep.stdout, deep.stdout + deep.stderr
    # a folder holding Kiln's results deeper down (--output_dir inside it): their pictures were predicted
    first = run_script('predict.py', '--load_model_path', checkpoint, '--input', images, '--output_dir', images / 'out')
    assert first.returncode == 0, first.stderr
    (results,) = glob.glob(str(images / 'out' / '*' / 'predict' / '*'))
    os.link(images / '00000.png', os.path.join(results, '00000_mask.png'))  # as a segmentation's masks lie there
    again = run_script('predict.py', '--load_model_path', checkpoint, '--input', images, '--save_prefix', 'again')
    assert again.returncode == 2 and 'holds Kiln runs or results, not only images' in again.stderr, again.stderr
    assert f'({results} holds args.yaml)' in again.stderr
    for source, cwd in ((images / '**' / '*.png', REPO), ('.', images)):  # a glob and the folder as '.' too
        refused = subprocess.run(
            [sys.executable, os.path.join(REPO, 'predict.py'), '--load_model_path', checkpoint, '--input', source],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout(),
        )
        assert refused.returncode == 2 and f'({results} holds args.yaml)' in refused.stderr, (source, refused.stderr)


def test_predict_segmentation_writes_masks(tiny_shapes, segmented):
    _ok(
        run_script(
            'predict.py',
            '--load_model_path',
            os.path.join(segmented, 'best.pth'),
            '--input',
            os.path.join(tiny_shapes, 'seg_val.txt'),
            '--no-progress_bar',
        )
    )
    folder = os.path.join(segmented, 'predict', 'best_seg_val_default')
    with open(os.path.join(folder, 'predictions.csv')) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 48
    mask = np.asarray(Image.open(rows[0]['mask']))
    assert mask.shape == (32, 32) and mask.max() < 7  # the image's size


def test_a_predicted_mask_lies_on_its_image():
    """Squashed, the mask covers the whole image; cropped, the centred square it saw, UNSEEN around."""
    from tasks.segment import UNSEEN, mask_on_image

    mask = np.arange(16, dtype=np.uint8).reshape(4, 4)
    whole = mask_on_image(mask, (0, 0, 80, 40), (80, 40))
    assert whole.shape == (40, 80) and (whole[:10, :20] == 0).all() and (whole[30:, 60:] == 15).all()
    cropped = mask_on_image(mask, (22, 2, 58, 38), (80, 40))  # the centred 36-pixel square of crop_pct 0.9
    assert cropped.shape == (40, 80) and (cropped[:, :22] == UNSEEN).all() and (cropped[:2] == UNSEEN).all()
    assert (cropped[2:11, 22:31] == 0).all() and (cropped[29:38, 49:58] == 15).all()
    # a 1x2 image's centred square is under a pixel high: the one pixel it falls in (as the input was cut)
    tiny = mask_on_image(mask, (0.0625, 0.5625, 0.9375, 1.4375), (1, 2))
    assert tiny.shape == (2, 1) and tiny[0, 0] == UNSEEN and tiny[1, 0] in mask


def test_eval_compares_several_checkpoints(classified, tmp_path):
    pattern = os.path.join(os.path.dirname(classified[0]), '*_seed*')  # experiment folders: their best.pth
    result = _ok(
        run_script(
            'eval.py',
            '--load_model_path',
            pattern,
            '--no-progress_bar',
            '--save_prefix',
            'cmp',
            '--checkpoints_dir',
            str(tmp_path),
        )
    )
    folder = tmp_path / 'comparisons' / 'val_cmp'
    with open(folder / 'comparison.csv') as f:
        rows = list(csv.DictReader(f))
    assert [os.path.dirname(r['checkpoint']) for r in rows] == classified
    for row, experiment in zip(rows, classified):
        with open(os.path.join(experiment, 'eval', 'best_val_cmp', 'result.json')) as f:
            assert float(row['acc']) == pytest.approx(json.load(f)['metrics']['acc'], abs=1e-6)
    table = (folder / 'comparison.txt').read_text().splitlines()
    assert (
        table[0].split() == ['checkpoint', 'loss', 'acc', 'top3'] and len(table) == 3 and 'checkpoint' in result.stdout
    )
    again = run_script(
        'eval.py', '--load_model_path', pattern, '--save_prefix', 'cmp', '--checkpoints_dir', str(tmp_path)
    )
    assert again.returncode == 2 and 'already exists' in again.stderr
    # ** takes the experiment folders at any depth, not their result folders (which hold args.yaml too)
    deep = os.path.join(os.path.dirname(classified[0]), '**', '')  # every folder below: runs, eval/, results
    compared = run_script('eval.py', '--load_model_path', deep, '--save_prefix', 'deep', '--checkpoints_dir', tmp_path)
    assert compared.returncode == 0 and 'comparison of 2 checkpoints' in compared.stdout, compared.stderr


def test_a_comparison_that_fails_half_way_leaves_nothing_and_runs_again(classified, tmp_path):
    """The first checkpoint's results and an empty comparison folder stayed, and the same command was
    refused ('already exists') once the cause was mended."""
    import torch

    weights = tmp_path / 'weights.pth'  # a plain state dict: which model it holds is not said
    torch.save(
        torch.load(os.path.join(classified[1], 'best.pth'), map_location='cpu', weights_only=True)['model'], weights
    )
    command = ['--load_model_path', classified[0], weights, '--save_prefix', 'half', '--checkpoints_dir', tmp_path]
    failed = run_script('eval.py', *command, '--no-progress_bar')
    assert failed.returncode == 2 and 'give --model_type' in failed.stderr, failed.stderr
    assert not os.path.exists(os.path.join(classified[0], 'eval', 'best_val_half'))  # evaluated, then removed
    assert not (tmp_path / 'comparisons' / 'val_half').exists()
    # the folders made for the results go too: eval/ and --output_dir's (they stayed, empty)
    elsewhere = run_script('eval.py', *command, '--no-progress_bar', '--output_dir', tmp_path / 'out' / 'cmp')
    assert elsewhere.returncode == 2 and not (tmp_path / 'out').exists(), elsewhere.stderr
    _ok(run_script('eval.py', *command, '--no-progress_bar', '--model_type', 'small_cnn'))
    assert os.path.isfile(os.path.join(classified[0], 'eval', 'best_val_half', 'result.txt'))
    assert (tmp_path / 'comparisons' / 'val_half' / 'comparison.csv').is_file()


def test_a_corrupt_copy_or_two_checkpoints_of_one_name_are_refused_before_any_work(classified, tmp_path):
    """A folder copied without its hard links (cp -r) had best.pth pass unchecked, damaged or not; two
    experiment folders of one name under --output_dir wrote into one result folder (the second refused
    after the first was evaluated)."""
    import shutil

    copied = tmp_path / 'copied' / os.path.basename(classified[1])
    shutil.copytree(classified[1], copied)  # best.pth and last.pth: copies now, not links
    data = bytearray((copied / 'best.pth').read_bytes())
    data[len(data) // 2] ^= 0x40
    (copied / 'best.pth').write_bytes(bytes(data))
    command = ['--load_model_path', classified[0], copied, '--save_prefix', 'bad', '--checkpoints_dir', tmp_path]
    refused = run_script('eval.py', *command, '--no-progress_bar')
    assert refused.returncode == 2 and f'{copied}/best.pth is none of the checkpoints' in refused.stderr, refused.stderr
    assert (
        not os.path.exists(os.path.join(classified[0], 'eval', 'best_val_bad'))
        and not (tmp_path / 'comparisons').exists()
    )
    shutil.copyfile(os.path.join(classified[1], 'best.pth'), copied / 'best.pth')  # a whole copy is taken
    _ok(run_script('eval.py', '--load_model_path', copied, '--no-progress_bar', '--save_prefix', 'whole'))

    twin = tmp_path / 'twin' / os.path.basename(classified[0])
    shutil.copytree(classified[0], twin, ignore=shutil.ignore_patterns('eval'))
    both = ['--load_model_path', classified[0], twin, '--output_dir', tmp_path / 'out', '--checkpoints_dir', tmp_path]
    clash = run_script('eval.py', *both, '--no-progress_bar')
    assert clash.returncode == 2 and 'would both write their results to' in clash.stderr, clash.stderr
    assert not (tmp_path / 'out').exists()


def test_a_closed_output_keeps_whole_results_and_ends_quietly(classified, tmp_path):
    """`eval.py ... | head -1`: the pipe closed before the summary lines removed the finished result
    folder, with 'error: cannot use: Broken pipe; free disk space ...'."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is printed
    command = [sys.executable, 'eval.py', '--load_model_path', classified[0], '--no-progress_bar', '--cpu']
    result = subprocess.run(
        [*command, '--save_prefix', 'piped'],
        cwd=REPO,
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout(300),
    )
    os.close(write_end)
    assert result.returncode == 141 and result.stderr == '', result.stderr  # as a tool stopped by SIGPIPE
    assert os.path.isfile(os.path.join(classified[0], 'eval', 'best_val_piped', 'predictions.csv'))
    # a comparison, printing unbuffered: its first line failed inside the all-or-nothing block, which
    # removed some results and kept others (the same command was then refused)
    read_end, write_end = os.pipe()
    os.close(read_end)
    compared = subprocess.run(
        [
            *command[:3],
            *classified,
            '--no-progress_bar',
            '--cpu',
            '--save_prefix',
            'piped2',
            '--checkpoints_dir',
            tmp_path,
        ],
        cwd=REPO,
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout(300),
        env={**os.environ, 'PYTHONUNBUFFERED': '1'},
    )
    os.close(write_end)
    assert compared.returncode == 141 and compared.stderr == '', compared.stderr
    assert all(os.path.isfile(os.path.join(folder, 'eval', 'best_val_piped2', 'result.txt')) for folder in classified)
    assert (tmp_path / 'comparisons' / 'val_piped2' / 'comparison.csv').is_file()
    # and with no output at all (fd 1 closed: sys.stdout is None), a run is a run
    closed = subprocess.run(
        [*command, '--save_prefix', 'closed'],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout(300),
        preexec_fn=lambda: os.close(1),
    )
    assert closed.returncode == 0, closed.stderr
    assert os.path.isfile(os.path.join(classified[0], 'eval', 'best_val_closed', 'result.txt'))


def test_runs_log_hparams_and_args(classified):
    events = EventAccumulator(classified[0])
    events.Reload()
    assert '_hparams_/session_start_info' in events.PluginTagToContent('hparams')
    assert 'args/text_summary' in events.Tags()['tensors']
    assert {'final/val/acc', 'best/val/acc'} <= set(events.Tags()['scalars'])
