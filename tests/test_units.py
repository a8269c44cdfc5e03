"""Unit tests of the pieces: options, data, models, metrics, recorder, loading and checkpoint files."""

import argparse
import contextlib
import hashlib
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from conftest import REPO, timeout
from data.list_dataset import ListDataset
from data.mem_list_dataset import MemListDataset
from data.shapes import generate_shape_boxes, generate_shapes
from metrics import accuracy_from_confusion, confusion_matrix, topk_hits
from model.submodules import ConvBNReLU, UpBlock
from options import parse_args, parse_test_args, parse_train_args
from utils.checkpoint import SameFolder, load_checkpoint, load_match_dict, load_weights, save_checkpoint, unwrap_model
from utils.errors import KilnError
from utils.recorder import Recorder


@pytest.mark.parametrize('script', ['train.py', 'eval.py'])
def test_help_answers_without_importing_torch(script):
    probe = (
        'import atexit, runpy, sys\n'
        "atexit.register(lambda: print('TORCH' if 'torch' in sys.modules else 'NO-TORCH'))\n"
        f"sys.argv = ['{script}', '--help']\n"
        f"runpy.run_path('{script}', run_name='__main__')\n"
    )
    result = subprocess.run([sys.executable, '-c', probe], cwd=REPO, capture_output=True, text=True, timeout=timeout())
    assert '--load_model_path' in result.stdout
    assert result.stdout.strip().endswith('NO-TORCH')


def test_train_and_test_share_the_common_options():
    train = parse_args(parse_train_args, [])
    test = parse_args(parse_test_args, [])
    shared = set(vars(train)) & set(vars(test))
    assert {
        'model_type',
        'data_type',
        'save_prefix',
        'load_model_path',
        'load_not_strict',
        'val_list',
        'gpus',
        'batch_size',
        'num_classes',
    } <= shared
    assert test.model_type is None and train.model_type is None  # eval: from the checkpoint; train: the task's


def test_config_values_are_checked_like_flags(tmp_path, capsys):
    config = tmp_path / 'bad.yaml'
    config.write_text('batch_size: -3\nepochs: 4\n')
    with pytest.raises(SystemExit) as exit_info:
        parse_args(parse_train_args, ['--config', str(config)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count('\n') == 1, error  # one line, naming the file, the key and what is wrong with its value
    assert error.startswith(f'error: --config {config}: batch_size: must be a positive integer, got -3'), error
    config.write_text('batch_size: 3\nepochs: 4\n')  # the same keys with good values: taken
    options = parse_args(parse_train_args, ['--config', str(config)])
    assert (options.batch_size, options.epochs) == (3, 4)


def _dataset_args(**overrides):
    values = dict(train_list=None, val_list=None, img_size=32, num_classes=None, data_type='list', data_root=None)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_list_file_relative_paths_comments_and_blank_lines(tiny_shapes, tmp_path):
    listing = tmp_path / 'sub' / 'my.txt'
    listing.parent.mkdir()
    image = os.path.join(tiny_shapes, 'images', 'val', '00001.png')
    os.symlink(image, tmp_path / 'sub' / 'a b.png')  # a name with a space
    listing.write_text(f'# my list\n\na b.png 1\n{image} 4  # absolute path, comment\n')
    dataset = ListDataset(_dataset_args(val_list=str(listing)), 'val')
    assert [label for _, label, _ in dataset.samples] == [1, 4]
    assert dataset.num_classes == 5  # no classes.txt here: the largest label + 1
    assert dataset.class_names is None
    sample = dataset[0]  # uint8: conversion and augmentation happen per batch on the device
    assert sample['image'].shape == (3, 32, 32) and sample['image'].dtype == torch.uint8 and sample['label'] == 1


def test_mem_list_dataset_matches_list_dataset(tiny_shapes):
    args = _dataset_args(val_list=os.path.join(tiny_shapes, 'val.txt'), img_size=24)
    on_disk, in_memory = ListDataset(args, 'val'), MemListDataset(args, 'val')
    assert len(on_disk) == len(in_memory) == 48 and in_memory.num_classes == 6
    assert in_memory.class_names[:2] == ['circle', 'square']
    for index in (0, 17, 47):
        assert torch.equal(on_disk[index]['image'], in_memory[index]['image'])
        assert on_disk[index]['label'] == in_memory[index]['label']
        assert on_disk[index]['image'].shape == (3, 24, 24)  # resized to --img_size


def _tree_digest(root):
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            with open(os.path.join(folder, name), 'rb') as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()


def test_shapes_generation_is_deterministic_and_reused(tmp_path):
    first = generate_shapes(str(tmp_path / 'a'), train_size=12, val_size=6, seed=3)
    second = generate_shapes(str(tmp_path / 'b'), train_size=12, val_size=6, seed=3)
    other = generate_shapes(str(tmp_path / 'c'), train_size=12, val_size=6, seed=4)
    assert _tree_digest(first) == _tree_digest(second) != _tree_digest(other)
    before = os.path.getmtime(os.path.join(first, 'train.txt'))
    generate_shapes(first, train_size=12, val_size=6, seed=3)  # complete copy: nothing rewritten
    assert os.path.getmtime(os.path.join(first, 'train.txt')) == before
    generate_shapes(first, train_size=13, val_size=6, seed=3)  # an old copy with other settings is replaced
    with open(os.path.join(first, 'train.txt')) as f:
        assert len(f.readlines()) == 13
    assert sorted(os.listdir(tmp_path)) == ['a', 'b', 'c']  # no staging or stale folders left
    mine = tmp_path / 'mine'
    mine.mkdir()
    (mine / 'photo.png').write_bytes(b'x')
    with pytest.raises(KilnError, match='not a generated shapes dataset'):  # someone else's: never replaced
        generate_shapes(str(mine), train_size=12, val_size=6)
    assert os.listdir(mine) == ['photo.png']


def test_shapes_generation_never_removes_data_or_files_it_did_not_make(tmp_path):
    """Any manifest.json (one of the user's own data) counted as a generated copy with other settings, and
    a copy generated again with other settings went with whatever had been added to it: the folder
    was removed whole."""
    own = tmp_path / 'own'
    (own / 'images').mkdir(parents=True)
    (own / 'manifest.json').write_text('{"dataset": "my labelled photos", "version": 3}')
    (own / 'images' / 'a.jpg').write_bytes(b'precious')
    with pytest.raises(KilnError, match='not a generated shapes dataset'):
        generate_shapes(str(own), train_size=12, val_size=6)
    assert (own / 'images' / 'a.jpg').read_bytes() == b'precious'
    generated = tmp_path / 'generated'
    generate_shapes(str(generated), train_size=12, val_size=6)
    (generated / 'NOTES.md').write_text('notes')
    (generated / 'images' / 'mine').mkdir()
    (generated / 'images' / 'train' / 'my_notes.txt').write_text('notes')
    with pytest.raises(KilnError, match=r'but NOTES.md, images/mine/, images/train/my_notes.txt differ from what'):
        generate_shapes(str(generated), train_size=13, val_size=6)
    assert (generated / 'NOTES.md').read_text() == 'notes' and len((generated / 'train.txt').read_text().split()) == 24
    assert sorted(os.listdir(tmp_path)) == ['generated', 'own']  # no staging or stale folder left
    for added in ('NOTES.md', 'images/mine', 'images/train/my_notes.txt'):
        (os.remove if '.' in added else os.rmdir)(generated / added)
    # a label mended by hand, or a bad image removed: lost when made again (the record compared names only)
    labels = (generated / 'train.txt').read_text()
    (generated / 'train.txt').write_text(labels.replace(' 0\n', ' 1\n', 1))
    with pytest.raises(KilnError, match=r'but train.txt differs from what the generator made \(added, edited or'):
        generate_shapes(str(generated), train_size=13, val_size=6)
    (generated / 'train.txt').write_text(labels)
    os.rename(generated / '.made.json', tmp_path / 'made.json')  # copied without its hidden files: no record
    with pytest.raises(KilnError, match=r'keeps no digests of what the generator made there \(\.made\.json'):
        generate_shapes(str(generated), train_size=13, val_size=6)
    os.rename(tmp_path / 'made.json', generated / '.made.json')
    generate_shapes(str(generated), train_size=13, val_size=6)  # as it was made: made again
    generate_shape_boxes(str(generated), train_size=8, val_size=4)  # another of its variants, with its own folders
    assert len((generated / 'train.txt').read_text().splitlines()) == 8


def test_conv_bn_relu_keeps_size_and_up_block_doubles_it():
    x = torch.randn(2, 4, 16, 16)
    assert ConvBNReLU(4, 8, kernel_size=5)(x).shape == (2, 8, 16, 16)
    assert ConvBNReLU(4, 8, dilation=2)(x).shape == (2, 8, 16, 16)
    assert ConvBNReLU(4, 8, stride=2)(x).shape == (2, 8, 8, 8)
    skip = torch.randn(2, 3, 32, 32)
    assert UpBlock(4, 6, skip_channels=3)(x, skip).shape == (2, 6, 32, 32)


@pytest.mark.parametrize('seed', [0, 1, 2, 3])
def test_topk_hits_agree_with_torch_topk(seed):
    """topk_hits counts the classes that score higher; without ties that is `topk`'s answer, for any k."""
    from metrics import topk_hits

    generator = torch.Generator().manual_seed(seed)
    classes = int(torch.randint(2, 50, (), generator=generator))
    logits = torch.randn(300, classes, generator=generator)
    targets = torch.randint(0, classes, (300,), generator=generator)
    for k in (1, 2, 5, classes, classes + 3):
        top = logits.topk(min(k, classes), dim=1).indices
        expected = (top == targets.unsqueeze(1)).any(dim=1)
        assert torch.equal(topk_hits(logits, targets, k), expected), f'seed {seed}, {classes} classes, k {k}'


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_topk_hits_break_ties_as_argmax_does(seed):
    """Tied scores (constant outputs, coarse bf16 logits) were all hits: a collapsed model scored top3 1.0
    with acc 0. Now top-1 is argmax's accuracy, and constant or NaN outputs hit only the first k classes."""
    from metrics import topk_hits

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (500, 10), generator=generator).float()  # many ties
    targets = torch.randint(0, 10, (500,), generator=generator)
    assert torch.equal(topk_hits(logits, targets, 1), logits.argmax(1) == targets), f'seed {seed}'
    for k in (2, 5):  # the rank of the true class when ties go to the lower index, counted by hand
        rank = torch.tensor([(row > row[t]).sum() + (row[:t] == row[t]).sum() for row, t in zip(logits, targets)])
        assert torch.equal(topk_hits(logits, targets, k), rank < k), f'seed {seed}, k {k}'
    constant = torch.zeros(10, 10)
    assert topk_hits(constant, torch.arange(10), 3).tolist() == [True] * 3 + [False] * 7
    assert topk_hits(torch.full((4, 10), float('nan')), torch.arange(4), 3).tolist() == [True] * 3 + [False]
    with_nan = torch.tensor([[float('nan'), 2.0, 1.0], [0.0, 2.0, 1.0]])  # another class NaN: argmax takes it
    assert topk_hits(with_nan, torch.tensor([1, 1]), 1).tolist() == (with_nan.argmax(1) == 1).tolist() == [False, True]


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_topk_hits_rank_nan_as_argmax_and_a_stable_sort_do(seed):
    """A NaN score on the true class was no hit in top-k but a hit in acc (argmax takes a NaN for the
    largest): with NaN outputs top1 and acc disagreed. Now NaN ranks above every number, NaNs tied."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (2000, 3), generator=generator).float()
    logits[torch.rand(logits.shape, generator=generator) < 0.2] = float('nan')
    targets = torch.randint(0, 3, (2000,), generator=generator)
    assert torch.equal(topk_hits(logits, targets, 1), logits.argmax(1) == targets), f'seed {seed}'
    order = logits.sort(dim=1, descending=True, stable=True).indices  # NaN first, ties by class index
    rank = (order == targets.unsqueeze(1)).int().argmax(1)
    assert torch.equal(topk_hits(logits, targets, 2), rank < 2), f'seed {seed}'


def test_metrics():
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 3.0, 2.0], [1.0, 2.0, 3.0], [3.0, 1.0, 2.0]])
    targets = torch.tensor([0, 2, 0, 1])
    assert topk_hits(logits, targets, 1).double().mean().item() == pytest.approx(0.25)
    assert topk_hits(logits, targets, 2).double().mean().item() == pytest.approx(0.5)
    assert topk_hits(logits, targets, 10).double().mean().item() == 1.0
    matrix = confusion_matrix(logits.argmax(1), targets, 3)
    assert matrix.tolist() == [[1, 0, 1], [1, 0, 0], [0, 1, 0]]
    overall, recall = accuracy_from_confusion(matrix)
    assert overall.item() == pytest.approx(0.25) and recall.tolist() == pytest.approx([0.5, 0.0, 0.0])
    _, recall = accuracy_from_confusion(torch.tensor([[2, 0, 1], [0, 0, 0], [0, 0, 3]]))  # no sample of class 1
    assert recall[0].item() == pytest.approx(2 / 3) and recall[1].isnan() and recall[2].item() == 1.0  # not 0.0


def test_recorder_weighs_by_batch_size_and_keeps_no_graph():
    recorder = Recorder()
    weight = torch.ones(1, requires_grad=True)
    recorder.record('train/loss', (weight * 2).sum(), n=3)
    recorder.record('train/loss', torch.tensor(4.0), n=1)
    recorder.record('train/loss', torch.tensor([4.0]), n=1)  # shape (1,) beside a 0-d one: a stack error came later
    recorder.record('train/loss', torch.tensor(1.0), n=2)
    recorder.record('train/lr', 0.5)
    assert not any(value.requires_grad for values in recorder.kept['train/loss'].values() for value in values)
    assert recorder.means() == {'train/loss': pytest.approx(16 / 7), 'train/lr': 0.5}
    assert recorder.summary() == {'train/loss': pytest.approx(16 / 7), 'train/lr': 0.5}
    assert recorder.summary() == {}  # reset after summary


def test_a_top_k_that_holds_every_class_is_left_out():
    """--topk 3 (the default) on 2 classes printed and logged `top3 1.0000` in every run: each label is
    among the 3 highest of 2 scores. A run that monitors it keeps it (one trained so before could not
    resume: its --monitor was no metric, and a resume may not change it)."""
    from metrics import ClassificationMetrics
    from tasks.classify import ClassifyTask
    from train import check_monitor

    for classes, names in ((2, ['acc']), (3, ['acc']), (4, ['acc', 'top3']), (None, ['acc', 'top3'])):
        options = argparse.Namespace(num_classes=classes, topk=3, monitor='val/acc')
        assert ClassifyTask.metric_names(options) == ['loss', *names]
        monitored = argparse.Namespace(num_classes=classes, topk=3, monitor='val/top3')
        assert ClassifyTask.metric_names(monitored) == ['loss', 'acc', 'top3']
        if classes:
            for monitor, expected in (('val/acc', names), ('val/top3', ['acc', 'top3'])):
                metrics = ClassificationMetrics(classes, topk=3, monitor=monitor)
                metrics.update(torch.eye(classes), {'label': torch.arange(classes)})
                assert list(metrics.compute()) == expected, (classes, monitor)
    check_monitor(argparse.Namespace(task='classify', monitor='val/top3', num_classes=2, topk=3), ClassifyTask)
    options = argparse.Namespace(task='classify', monitor='val/top2', num_classes=2, topk=3)
    with pytest.raises(KilnError, match='^--monitor val/top2 is not a metric .*: val/loss, val/acc, train/loss, '):
        check_monitor(options, ClassifyTask)


def test_batched_train_metrics_and_recorder_folds_add_up_like_step_by_step_updates():
    from metrics import BatchedUpdates, ClassificationMetrics

    seed = 7
    generator = torch.Generator().manual_seed(seed)
    direct, batched = ClassificationMetrics(5, topk=2), BatchedUpdates(ClassificationMetrics(5, topk=2), every=4)
    recorder, total, count = Recorder(), 0.0, 0
    for step in range(150):  # more than FOLD_EVERY values, two batch sizes
        n = 3 if step % 10 == 9 else 8
        logits, labels = torch.randn(n, 5, generator=generator), torch.randint(0, 5, (n,), generator=generator)
        direct.update(logits, {'label': labels})
        batched.update(logits, {'label': labels, 'image': torch.zeros(n, 3, 2, 2)})
        loss = logits.square().mean()
        recorder.record('train/loss', loss, n)
        total, count = total + loss.double().item() * n, count + n
        if step == 70:  # a checkpoint in between
            assert batched.state_dict()['matrix'].sum() == direct.state_dict()['matrix'].sum()
    assert batched.compute(list('abcde')) == direct.compute(list('abcde')), f'seed {seed}'
    assert recorder.means() == {'train/loss': pytest.approx(total / count, rel=1e-12)}, f'seed {seed}'


class _Net(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.head = nn.Linear(5, classes)


def test_load_match_dict_strips_wrapper_prefixes_and_reports(tmp_path):
    source = _Net(classes=3)
    wrapped = {f'module._orig_mod.{k}': v for k, v in source.state_dict().items()}
    wrapped['module.extra.weight'] = torch.zeros(2)
    path = str(tmp_path / 'dp.pth')
    torch.save({'model': wrapped, 'epoch': 3}, path)
    target = nn.DataParallel(_Net(classes=7))
    report = load_match_dict(target, path)
    assert sorted(report.loaded) == ['body.bias', 'body.weight']
    assert [name for name, _, _ in report.shape_mismatched] == ['head.weight', 'head.bias']
    assert report.unexpected == ['extra.weight'] and report.missing == []
    assert torch.equal(unwrap_model(target).body.weight.cpu(), source.body.weight)  # on a GPU, DataParallel moved it
    assert 'loaded 2 tensors, skipped 2 for shape' in str(report)


def test_strict_load_explains_a_mismatch(tmp_path):
    path = str(tmp_path / 'net.pth')
    torch.save(_Net(classes=3).state_dict(), path)
    load_weights(_Net(classes=3), path)  # fits
    with pytest.raises(KilnError, match='--load_not_strict'):
        load_weights(_Net(classes=4), path)


def test_a_mismatch_in_inference_never_advises_loading_what_fits(tmp_path):
    """eval.py and predict.py advised --load_not_strict: followed, they scored a head left at its init."""
    path = str(tmp_path / 'net.pth')
    torch.save(_Net(classes=3).state_dict(), path)  # bare weights: nothing says what they were trained as
    with pytest.raises(KilnError, match=r'give the --model_type, --num_classes and --img_size it was trained with$'):
        load_weights(_Net(classes=4), path, inference=True)
    checkpoint = {'model': _Net(classes=3).state_dict(), 'args': {'num_classes': None}, 'class_names': list('abc')}
    built = argparse.Namespace(num_classes=4, img_size=None)
    with pytest.raises(KilnError, match=r'--num_classes 4 \(it was trained with 3\): drop them \(eval.py and predict'):
        load_weights(_Net(classes=4), checkpoint, inference=True, built_with=built)
    # the option given that differs is named, not --num_classes (it blamed --num_classes for an --img_size)
    checkpoint['args'] = {'num_classes': None, 'img_size': 32}
    built = argparse.Namespace(num_classes=None, img_size=64)
    with pytest.raises(KilnError, match=r'; --img_size 64 \(it was trained with 32\): drop them'):
        load_weights(_Net(classes=4), checkpoint, inference=True, built_with=built)


def test_a_checkpoint_whose_path_is_no_utf8_loads_mapped_or_not(tmp_path):
    """A run of --save_prefix $'bad\\xffname' trained, then could never be resumed: its mapped load said the
    file was damaged (torch's mmap cannot open such a name)."""
    from utils.checkpoint import load_checkpoint

    folder = os.path.join(os.fsencode(tmp_path), b'bad\xffname')
    os.mkdir(folder)
    path = os.fsdecode(os.path.join(folder, b'last.pth'))
    torch.save({'w': torch.arange(3)}, path)
    for mmap in (False, True):
        assert torch.equal(load_checkpoint(path, mmap=mmap)['w'], torch.arange(3))


def test_checkpoint_loading_refuses_pickled_code(tmp_path):
    path = str(tmp_path / 'evil.pth')
    torch.save({'model': {}, 'payload': argparse.Namespace(a=1)}, path)  # an arbitrary class: not allowed
    with pytest.raises(KilnError, match='refusing to load'):
        load_checkpoint(path)


def test_checkpoint_write_failure_keeps_the_previous_file(tmp_path, monkeypatch):
    path = str(tmp_path / 'last.pth')
    save_checkpoint({'step': torch.tensor(1)}, path)

    def full_disk(*args):
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(os, 'replace', full_disk)
    with pytest.raises(OSError, match='No space left') as error:
        save_checkpoint({'step': torch.tensor(2)}, path)
    assert error.value.filename == path  # what the one-line error names (the disk's own error names no file)
    assert load_checkpoint(path)['step'].item() == 1
    assert os.listdir(tmp_path) == ['last.pth']  # the temporary file was cleaned up


def test_same_folder_holds_the_folder_and_never_drops_the_runs_lock(tmp_path):
    """Checking the folder opened and closed its lock file, which drops this process's POSIX lock on it: a
    second run of the folder was let in (seen once as a resume reading a checkpoint the run had pruned)."""
    from utils.run_folder import FolderLock

    folder = tmp_path / 'run'
    folder.mkdir()
    lock = FolderLock(str(folder))
    same = SameFolder(str(folder))
    same.check()
    code = f'import sys; sys.path.insert(0, {REPO!r}); from utils.run_folder import FolderLock; '
    code += f'FolderLock.refuse_if_held({str(folder)!r})'
    held = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=timeout(60))
    assert held.returncode != 0 and 'is in use by process' in held.stderr, held.stderr  # still locked
    os.rename(folder, tmp_path / 'elsewhere')
    with pytest.raises(KilnError, match='was moved or removed while this run wrote into it'):
        same.check()
    (tmp_path / 'run').mkdir()  # another folder at the path
    with pytest.raises(KilnError, match='--resume from where its folder is now'):
        same.check()
    lock.release()
    (tmp_path / 'parent' / 'run').mkdir(parents=True)
    inner = SameFolder(str(tmp_path / 'parent' / 'run'))
    os.rename(tmp_path / 'parent', tmp_path / 'parent_moved')
    (tmp_path / 'parent').write_text('a file where a folder on its path was')  # os.stat: NotADirectoryError
    with pytest.raises(KilnError, match='was moved or removed'):
        inner.check()
    with pytest.raises(FileNotFoundError):  # a folder that is not there: no half-made object left to close
        SameFolder(str(tmp_path / 'nowhere'))


def test_random_states_come_back_through_a_safe_load_and_from_the_older_format(tmp_path):
    """Python's generator state is saved as one tensor; checkpoints that kept it as a tuple of ints
    (before) still resume."""
    import random

    from utils.seeding import rng_states, set_rng_states

    random.seed(11)
    torch.manual_seed(11)
    states = rng_states()
    expected = (random.random(), torch.rand(3))
    save_checkpoint(states, str(tmp_path / 'rng.pth'))
    for saved in (load_checkpoint(str(tmp_path / 'rng.pth')), dict(states, python=random_state_as_tuple(states))):
        set_rng_states(saved)
        assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])


def random_state_as_tuple(states):
    version, internal, gauss = states['python']
    return version, tuple(internal.tolist()), gauss


def test_sampler_counts_batches_without_drawing_an_order(monkeypatch):
    from data.sampler import ResumableBatchSampler

    cases = [
        (96, 16, True, 1, None),
        (100, 7, False, 3, None),
        (5, 16, True, 2, None),
        (48, 16, True, 2, 0.5),
        (48, 8, False, 2, 2),
        (1, 4, False, 3, None),
    ]
    drawn = {  # the batches themselves, with an order drawn
        (case, rank): len(ResumableBatchSampler(*case[:3], 0, rank, case[3], case[4]).batches())
        for case in cases
        for rank in range(case[3])
    }

    def no_order(self, epoch=None):
        raise AssertionError('len() drew an order')

    with monkeypatch.context() as patch:
        patch.setattr(ResumableBatchSampler, 'order', no_order)
        patch.setattr(torch, 'randperm', no_order)
        for (case, rank), count in drawn.items():
            assert len(ResumableBatchSampler(*case[:3], 0, rank, case[3], case[4])) == count, (case, rank)
    sampler = ResumableBatchSampler(100, 10, True, 0, limit=0.3)
    assert [len(b) for b in sampler.batches()] == [10, 10, 10]


@pytest.mark.parametrize('length, batch_size', [(5, 4), (3, 4), (2, 16)])
def test_data_smaller_than_one_global_batch_are_dealt_to_every_process(length, batch_size):
    """5 samples, batches of 4, 2 processes: rank 1's slice of the one global batch was 1 sample, and
    with 3 samples it was empty (a traceback in the collate, the other process waiting). Now the samples
    are dealt out round-robin, each once; fewer samples than processes are refused in one line."""
    from data.sampler import ResumableBatchSampler
    from utils.errors import KilnError

    dealt = [ResumableBatchSampler(length, batch_size, True, 0, rank, 2).batches() for rank in (0, 1)]
    assert all(len(batches) == 1 and batches[0] for batches in dealt)
    positions = sorted(position for batches in dealt for position, _ in batches[0])
    assert positions == list(range(length)) and abs(len(dealt[0][0]) - len(dealt[1][0])) <= 1
    with pytest.raises(KilnError, match='have 1 sample, fewer than the 2 processes'):
        ResumableBatchSampler(1, batch_size, True, 0, 0, 2)


def test_monitor_never_takes_a_nonfinite_value_as_best_and_counts_patience_from_real_gains():
    from utils.monitor import Monitor

    monitor = Monitor('val/loss', 'min', patience=2, min_delta=0.1)
    assert monitor.update(1.0) and monitor.best == 1.0
    assert not monitor.update(float('nan')) and not monitor.update(float('inf'))
    assert monitor.best == 1.0 and monitor.exhausted()  # two validations without a (finite) gain
    creeping = Monitor('val/acc', 'max', patience=3, min_delta=0.1)
    for value in (0.50, 0.55, 0.58, 0.59):  # better each time, but never by more than 0.1 over 0.50
        assert creeping.update(value)
    assert creeping.best == 0.59 and creeping.waited == 3 and creeping.exhausted()


def test_a_nonfinite_model_statistic_stops_the_run_and_names_it():
    from utils.stopping import Stopper, StopReason

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    stopper = Stopper()
    assert stopper.check_finite(model) and stopper.stop is None
    model[1].running_var[2] = float('inf')
    assert not stopper.check_finite(model)
    assert stopper.stop.reason == StopReason.NONFINITE and '1.running_var' in stopper.stop.message


def test_run_cli_turns_file_system_and_memory_failures_into_one_line(capsys):
    from utils.errors import run_cli

    def full_disk(argv):
        raise OSError(28, 'No space left on device', '/data/run/args.txt')

    def out_of_memory(argv):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    def peer_lost(argv):  # gloo's words in a validation all_reduce after the launcher was killed
        raise RuntimeError(
            '[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:9124'
        )

    def not_deterministic(argv):  # torch's words for an op --deterministic refuses on a GPU
        raise RuntimeError(
            'upsample_bilinear2d_backward_out_cuda does not have a deterministic implementation, but you set '
            "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation"
        )

    def disk_full_in_an_open_file(argv):  # a write to an open file names no file: "cannot use: No space..."
        raise OSError(28, 'No space left on device')

    def out_of_file_descriptors(argv):  # a process's own open() or socket
        raise OSError(24, 'Too many open files')

    def workers_out_of_file_descriptors(argv):  # torch's words, DataLoader workers handing over batches
        raise RuntimeError('Too many open files. Communication with the workers is no longer possible. Please ...')

    def not_yours(argv):  # another user's file: disk space has nothing to do with it
        raise PermissionError(13, 'Permission denied', '/shared/run/.lock')

    def read_only(argv):
        raise OSError(30, 'Read-only file system', '/mnt/ro/run')

    def no_more_processes(argv):  # os.fork at `ulimit -u` (it said: free disk space or fix the permissions)
        raise BlockingIOError(11, 'Resource temporarily unavailable')

    def no_more_threads(argv):  # a thread at the same limit (it was a traceback)
        raise RuntimeError("can't start new thread")

    def no_temporary_folder(argv):  # tempfile's, which torch asks for a cache folder
        raise FileNotFoundError(2, "No usable temporary directory found in ['/nowhere', '/tmp']")

    def peer_lost_in_training(argv):  # what Trainer.run adds to it
        error = RuntimeError('Connection closed by peer [127.0.0.1]:9124')
        error.add_note('the newest checkpoint is whole: continue with --resume')
        raise error

    for main, needle, code in (
        # eval.py's said 'continue with --resume' too
        (peer_lost, 'Connection closed by peer [127.0.0.1]:9124); its own error says why (--debug', 3),
        (peer_lost_in_training, '; the newest checkpoint is whole: continue with --resume (--debug', 3),
        (full_disk, 'cannot use /data/run/args.txt: No space left on device; free disk space (--debug', 2),
        (disk_full_in_an_open_file, 'error: No space left on device; free disk space (--debug', 2),
        (not_yours, '/shared/run/.lock: Permission denied; fix its permissions, or give a path of your own (', 2),
        (read_only, '/mnt/ro/run: Read-only file system; give a path on a file system that can be written (', 2),
        (no_more_processes, 'the limit on processes of this user is reached (ulimit -u, ', 2),
        (no_more_threads, 'the limit on processes of this user is reached (ulimit -u, ', 2),
        (no_temporary_folder, "['/nowhere', '/tmp']; set TMPDIR to a folder you can write to (--debug", 2),
        (out_of_file_descriptors, 'error: too many open files (this process may open ', 2),
        (workers_out_of_file_descriptors, 'lower --num_workers (--debug shows where)', 2),  # a traceback
        (not_deterministic, '--deterministic: upsample_bilinear2d_backward_out_cuda does not have', 2),
        (out_of_memory, 'out of memory', 2),
        (peer_lost, 'another process of this torchrun job is gone', 3),  # it was a traceback
    ):
        with pytest.raises(SystemExit) as exit_info:
            run_cli(main, [])
        line = capsys.readouterr().err
        assert exit_info.value.code == code and line.startswith('error: ') and needle in line and line.count('\n') == 1


def test_shared_and_read_only_places_are_said_before_any_work_in_one_line(tiny_shapes, tmp_path, monkeypatch):
    """Found in a shared, read-only install: a dataset generated into a set-group-ID folder lost its group
    (teammates could not read it, and were told to move it away); a data root that cannot be written was
    named by a random temporary folder, without the option to change; a resume of a folder that cannot
    be written trained up to its first checkpoint, then failed, losing that work; a list behind a
    folder that is not open to the user "did not exist"."""
    import stat

    from data import list_file, shapes
    from tests.conftest import experiment_of, run_script, tiny_run_args
    from utils import run_folder

    shared = tmp_path / 'shared'
    shared.mkdir()
    os.chmod(shared, 0o2775)
    assert os.stat(shapes.staging_folder(str(shared), '.shapes-', '--data_root')).st_mode & stat.S_ISGID
    with monkeypatch.context() as patch:
        patch.setattr(shapes.tempfile, 'mkdtemp', lambda **_: (_ for _ in ()).throw(PermissionError(13, 'Denied')))
        with pytest.raises(KilnError, match=r'^cannot write a dataset into .*/shared \(Denied\); give a folder you '):
            shapes.generate_shapes(str(shared / 'shapes'), train_size=6, val_size=6, where_option='--data_root')
        (shared / 'mine').mkdir()
        (shared / 'mine' / 'manifest.json').write_text('{}')
        real_open = open
        patch.setattr('builtins.open', lambda path, *a, **k: (_ for _ in ()).throw(PermissionError(13, 'Denied'))
            if str(path).endswith('manifest.json') else real_open(path, *a, **k))  # fmt: skip
        with pytest.raises(KilnError, match=r'manifest.json \(Denied\): ask its owner to open the dataset and the'):
            shapes.generate_shapes(str(shared / 'mine'), train_size=6, val_size=6, where_option='--data_root')
        patch.setattr(list_file.os, 'stat', lambda path, **k: (_ for _ in ()).throw(PermissionError(13, 'Denied')))
        assert list_file.not_open_to_you(str(tmp_path / 'closed' / 'train.txt')).startswith('cannot be reached (')
    args = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--model_type', 'linear', '--max_iteration', '1']
    assert run_script('train.py', *args).returncode == 0
    folder = experiment_of(args, 'linear')
    monkeypatch.setattr(run_folder.os, 'access', lambda path, mode: os.path.realpath(path) != os.path.realpath(folder))
    resumed = run_script('train.py', '--resume', folder, '--max_iteration', '3')
    assert resumed.returncode == 2 and resumed.stderr.startswith(f'error: cannot write in {folder} ('), resumed.stderr
    assert 'copy the folder to a place of yours and resume the copy' in resumed.stderr
    assert 'step 2' not in resumed.stdout  # refused before training


def test_too_many_open_files_suggests_only_a_limit_the_system_allows(monkeypatch):
    """The advice said `ulimit -n 80000` where the hard limit (a container's) was 20000: refused."""
    import resource

    from utils.errors import too_many_open_files

    for limits, needle in (
        ((1024, 1048576), 'may open 1024); raise the limit (ulimit -n 4096) or lower --num_workers'),
        ((64, 1000), 'raise the limit (ulimit -n 1000)'),
        ((20000, 20000), '20000 is the most this system allows a process here: lower --num_workers'),
    ):
        monkeypatch.setattr(resource, 'getrlimit', lambda kind, limits=limits: limits)
        assert needle in too_many_open_files(), (limits, too_many_open_files())
    assert 'the system has too many open files' in too_many_open_files(system_wide=True)


def test_an_in_memory_dataset_on_a_full_disk_is_decoded_without_its_cache(tiny_shapes, tmp_path, monkeypatch):
    """torch.save's file writer raises a RuntimeError for a full disk (not an OSError): the cache that
    should have been skipped stopped the run with a traceback."""

    def full_disk(*args, **kwargs):
        raise RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 896 vs 790')

    monkeypatch.setattr(torch, 'save', full_disk)
    args = _dataset_args(val_list=os.path.join(tiny_shapes, 'val.txt'), data_root=str(tmp_path / 'root'))
    assert MemListDataset(args, 'val').tensors()['image'].shape[0] > 0
    assert not [name for _, _, names in os.walk(tmp_path / 'root') for name in names]  # nor a temporary left


def test_an_in_memory_dataset_too_big_for_memory_is_refused(tiny_shapes, monkeypatch):
    import data.mem_list_dataset as mem

    monkeypatch.setattr(mem, 'available_memory', lambda: 10_000)
    dataset = MemListDataset(_dataset_args(val_list=os.path.join(tiny_shapes, 'val.txt'), img_size=512), 'val')
    with pytest.raises(KilnError, match='need .* GiB in memory'):
        dataset.tensors()
    # past the check (memory taken by something else meanwhile): said so, not "lower --batch_size"
    monkeypatch.setattr(mem, 'available_memory', lambda: None)
    monkeypatch.setattr(dataset, 'decode_all', lambda: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(KilnError, match=r'^out of memory while 48 images .* read them from disk \(--data_type list\)$'):
        dataset.tensors()


def test_every_checkpoint_is_loaded_onto_the_cpu(tmp_path, monkeypatch):
    """A checkpoint written on a GPU loads on a machine without one: every entry point (resume, eval,
    predict, --load_model_path) reads through load_checkpoint, which maps tensors to the CPU."""
    path = str(tmp_path / 'x.pth')
    torch.save({'model': {'w': torch.ones(2)}}, path)
    seen = []
    original = torch.load
    monkeypatch.setattr(torch, 'load', lambda *a, **k: seen.append(k) or original(*a, **k))
    assert load_checkpoint(path)['model']['w'].device.type == 'cpu'
    (options,) = seen
    assert options['map_location'] == 'cpu' and options['weights_only'] is True


def test_registry_mistakes_are_one_line_naming_the_file(tmp_path, monkeypatch):
    import options
    from data.data_entry import DATASETS, dataset_class

    monkeypatch.setitem(DATASETS, 'digits', 'data.digits:DigitsDataset')  # registered, but no such file
    with pytest.raises(KilnError, match=r"data/data_entry.py: the entry 'digits' cannot import data.digits"):
        dataset_class('digits')
    monkeypatch.setitem(DATASETS, 'mine', 'MyDataset')  # not 'module:Class'
    with pytest.raises(KilnError, match=r"data/data_entry.py: the entry 'mine'"):
        dataset_class('mine')
    (tmp_path / 'broken_entry.py').write_text("DATASETS = {\n    'a': 'data.a:A'\n    'b': 'data.b:B',\n}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(options.REGISTRIES, 'data_type', ('broken_entry', 'DATASETS', 'data/data_entry.py'))
    with pytest.raises(KilnError, match='^data/data_entry.py line 3: SyntaxError'):
        options.registry_names('data_type')


def test_unknown_names_are_answered_before_torch_loads():
    probe = (
        'import atexit, runpy, sys\n'
        "atexit.register(lambda: print('TORCH' if 'torch' in sys.modules else 'NO-TORCH'))\n"
        "sys.argv = ['train.py', '--model_type', 'small_cn']\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    result = subprocess.run([sys.executable, '-c', probe], cwd=REPO, capture_output=True, text=True, timeout=timeout())
    assert "unknown --model_type 'small_cn'" in result.stderr and 'small_cnn' in result.stderr
    assert result.stdout.strip().endswith('NO-TORCH')


def test_more_processes_than_gpus_is_one_line_naming_both_counts_and_the_fixes(monkeypatch):
    from utils import distributed

    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '2')
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    with pytest.raises(KilnError) as error:
        distributed.init_distributed(cpu=False)
    message = str(error.value)
    assert '2 processes' in message and '1 GPU' in message and '--cpu' in message and '--nproc-per-node 1' in message


def test_the_small_image_resnet18_runs_and_has_layer_groups():
    from model.model_entry import select_model
    from utils.finetune import ModelFreezer

    model = select_model(argparse.Namespace(model_type='resnet18', num_classes=6, img_size=32))
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 6)
    groups = [type(g).__name__ for g in ModelFreezer(model).get_layer_groups()]
    assert groups[0] == 'Conv2d' and groups[-1] == 'Linear' and groups.count('Sequential') == 4


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_png_writer_round_trips_through_pillow(tmp_path, seed):
    """Kiln writes PNGs itself (utils/viz.png_bytes): Pillow must read back every pixel, for any size."""
    import io

    import numpy as np
    from PIL import Image

    from utils.viz import png_bytes, save_png

    rng = np.random.default_rng(seed)
    height, width = rng.integers(1, 90, size=2)
    for shape, mode in [((height, width, 3), 'RGB'), ((height, width), 'L'), ((height, width, 4), 'RGBA')]:
        image = rng.integers(0, 256, size=shape, dtype=np.uint8)
        for level in (1, 9):
            decoded = Image.open(io.BytesIO(png_bytes(image, level)))
            assert decoded.mode == mode and (np.asarray(decoded) == image).all(), f'seed {seed}, {mode}, level {level}'
    image = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    save_png(image, tmp_path / 'picture.png')
    assert (np.asarray(Image.open(tmp_path / 'picture.png')) == image).all(), f'seed {seed}'


@pytest.mark.parametrize('seed', [0, 1])
def test_picture_tiles_enlarge_small_images_sharply_and_shrink_large_ones_by_averaging(seed):
    """Each source pixel of a small image becomes a whole block of one colour (rounded from [0, 1] to
    bytes); an image larger than the tile is shrunk to the tile by averaging (mode 'area')."""
    from utils.viz import tiles

    generator = torch.Generator().manual_seed(seed)
    small = torch.rand(2, 3, 20, 20, generator=generator) * 1.2 - 0.1  # a little outside [0, 1]: clamped
    out = tiles(small, 96)
    assert out.shape == (2, 80, 80, 3) and out.dtype.name == 'uint8', f'seed {seed}'  # 4x: the whole factor below 96
    expected = (small.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1)
    assert (torch.from_numpy(out[:, ::4, ::4]) == expected).all(), f'seed {seed}'
    assert (out[:, 1::4, 3::4] == out[:, ::4, ::4]).all(), f'seed {seed}: a block is one colour'
    large = torch.rand(1, 3, 192, 192, generator=generator)
    shrunk = tiles(large, 96)
    means = large.unfold(2, 2, 2).unfold(3, 2, 2).mean((-1, -2))  # each 2x2 block's mean
    assert shrunk.shape == (1, 96, 96, 3), f'seed {seed}'
    assert (torch.from_numpy(shrunk).permute(0, 3, 1, 2).int() - (means * 255).round().int()).abs().max() <= 1


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_picture_shrinking_averages_what_torch_area_interpolation_averages(seed):
    """tiles shrinks in numpy (pictures are drawn beside the training step's torch threads): for every
    ratio, whole or not, each pixel is the mean torch's interpolate(mode='area') gives."""
    from utils.viz import area_resize

    generator = torch.Generator().manual_seed(seed)
    for height, width, size in [(224, 224, 96), (100, 97, 96), (150, 301, 64), (97, 97, 1)]:
        images = torch.rand(2, 3, height, width, generator=generator)
        expected = torch.nn.functional.interpolate(images, size=(size, size), mode='area')
        got = torch.from_numpy(area_resize(images.numpy(), size))
        assert got.shape == expected.shape, f'seed {seed}, {height}x{width} to {size}'
        assert torch.allclose(got, expected, atol=1e-5), f'seed {seed}, {height}x{width} to {size}'


def test_pictures_draw_class_names_with_a_font_that_has_their_letters():
    """Pillow's own font has ASCII only: 'élan' came out as '□lan'. A name it cannot draw is drawn with
    a system font that can (where the system has one)."""
    from utils.viz import _default_font, _has_glyphs, _system_fonts, font_for

    assert font_for('cat / dog') is _default_font(11)
    assert _has_glyphs(_default_font(11), 'cat / dog') and not _has_glyphs(_default_font(11), 'cat \U000ffffd')
    name = 'élan / zèbre'
    if not any(_has_glyphs(font, name) for font in [_default_font(11), *_system_fonts(11)]):
        pytest.skip('no font on this system has accented letters (DejaVu, Noto or Arial)')
    assert _has_glyphs(font_for(name), name)


@pytest.mark.parametrize(
    'argv, mode',
    [
        ([], 'max'),  # the task's own monitor, val/acc
        (['--monitor', 'val/loss'], 'min'),  # it kept max: best.pth was the highest loss
        (['--monitor', 'train/loss'], 'min'),
        (['--monitor', 'val/top3'], 'max'),
        (['--monitor', 'val/loss', '--monitor_mode', 'max'], 'max'),  # asked for
        (['--task', 'segment', '--monitor', 'val/loss'], 'min'),
    ],
)
def test_a_monitored_loss_is_minimized(argv, mode):
    from options import parse_args, parse_train_args, resolve

    assert resolve(parse_args(parse_train_args, argv)).monitor_mode == mode


def test_a_monitored_error_of_a_new_task_is_minimized():
    """A regression task's --monitor val/rmse was maximized (its name says neither loss nor error): best.pth
    was the worst checkpoint. The usual names of errors are minimized, and a task can name its own."""
    from options import monitor_mode_of
    from tasks.task import Task

    class Regress(Task):
        monitor, monitor_mode, minimized = 'val/mae', 'min', ('spread',)

    expected = {
        'val/mae': 'min',  # its own
        'val/rmse': 'min',
        'train/mse': 'min',
        'val/top1_err': 'min',
        'val/spread': 'min',  # the task's `minimized`
        'val/r2': 'max',
        'val/map': 'max',
        'val/acc': 'max',
    }
    assert {name: monitor_mode_of(name, Regress) for name in expected} == expected


def test_config_values_are_read_as_their_options_take_them(tmp_path, capsys):
    """A config can be overridden both ways, a value may start with '-', `resume: true` is --resume alone,
    a prefix map may be a YAML mapping, and eval.py takes a training run's args.yaml."""
    from options import RESUME_LATEST, parse_args, parse_test_args, parse_train_args

    config = tmp_path / 'config.yaml'
    config.write_text('cpu: true\ndeterministic: true\nsave_prefix: -x\nresume: true\nload_prefix_map: {"net.": ""}\n')
    args = parse_args(parse_train_args, ['--config', str(config), '--no-cpu'])
    assert (args.cpu, args.deterministic, args.save_prefix) == (False, True, '-x')
    assert args.resume == RESUME_LATEST and args.load_prefix_map == ['net.=']
    training = tmp_path / 'args.yaml'
    training.write_text('augment: [crop, hflip]\nloss: ce\nlr: 0.01\nviz_freq: 3\n')  # train's keys and eval's
    assert parse_args(parse_test_args, ['--config', str(training)]).viz_freq == 3
    # YAML 1.1 reads an unquoted off as false: `amp: off` means --amp off; a bool where no choice is
    # spelled so is one line that says to quote the text
    written = tmp_path / 'written.yaml'
    written.write_text('amp: off\n')
    assert parse_args(parse_train_args, ['--config', str(written)]).amp == 'off'
    for text in ('save_prefix: no\n', 'normalize: yes\n', 'lr: on\n'):
        written.write_text(text)
        with pytest.raises(SystemExit):
            parse_args(parse_train_args, ['--config', str(written)])
        assert f'{text.split(":")[0]}: YAML read this value as' in capsys.readouterr().err, text


def test_a_folder_without_best_pth_points_at_its_last_pth(tmp_path):
    """A run stopped before its first validation has last.pth only: the error said only that best.pth was missing."""
    from utils.run_folder import checkpoint_path

    (tmp_path / 'last.pth').write_bytes(b'')
    with pytest.raises(
        KilnError, match=f'has no best.pth yet; give its last.pth instead: --load_model_path {tmp_path}/last.pth'
    ):
        checkpoint_path(str(tmp_path))
    assert checkpoint_path(str(tmp_path / 'last.pth')) == str(tmp_path / 'last.pth')


def test_number_options_say_what_they_take(capsys):
    """It read "invalid a positive integer value: '2.5'"."""
    from options import parse_args, parse_train_args

    with pytest.raises(SystemExit):
        parse_args(parse_train_args, ['--epochs', '2.5'])
    assert 'argument --epochs: must be a positive integer, got 2.5' in capsys.readouterr().err


def test_segmentation_pictures_name_their_columns():
    """Image, predicted and true masks side by side had no labels: which mask was the prediction?"""
    from utils.viz import CAPTION, caption, segmentation_grid

    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    predicted, true = torch.zeros(2, 16, 16, dtype=torch.long), torch.ones(2, 16, 16, dtype=torch.long)
    grid = segmentation_grid(images, predicted, true, num_classes=3, tile=32, class_names=['sky', 'cat', 'dog'])
    assert grid.shape[1:] == (3 * 32, 3) and grid.shape[0] > CAPTION + 2 * 32  # the classes' colours under
    assert (grid[:CAPTION, 32:64] == caption('predicted', (0, 0, 0), 32)).all()
    assert (grid[CAPTION + 5, 40] != grid[CAPTION + 5, 72]).any()  # predicted and true masks differ in colour
    # the key: which colour is which class (there was none: a star and a cross were two similar pinks)
    key = grid[CAPTION + 64 :]
    assert (key[8, 8] == grid[CAPTION + 5, 40]).all() and (key == grid[CAPTION + 5, 72]).all(-1).any()
    # the void (--ignore_index 255) was drawn black, as the background: its own colour now, in the key too
    from utils.viz import VOID_COLOUR

    true[:, :8] = 255
    grid = segmentation_grid(images, predicted, true, num_classes=3, tile=32, class_names=['sky', 'cat', 'dog'])
    assert tuple(grid[CAPTION + 2, 72]) == VOID_COLOUR and tuple(grid[CAPTION + 20, 72]) != VOID_COLOUR
    assert (grid[CAPTION + 64 :] == VOID_COLOUR).all(-1).any()


def test_prediction_captions_fit_their_tiles():
    """At --img_size 64 the captions were cut at the tile's edge ('retina / astrc'): now the names go on
    two lines when one does not fit, tiles are at least 96 pixels wide, and a name too long ends in '…'."""
    from utils.viz import BAD, CAPTION, GOOD, caption, labeled_grid, text_width

    images = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    names = ['astronaut', 'retina', 'a class name far too long for a tile']
    grid = labeled_grid(images, [0, 1, 2], [1, 1, 2], names)
    assert grid.shape == (CAPTION + 96 + 2 * CAPTION, 3 * 96, 3)  # under a line saying which name is which
    assert (grid[:CAPTION] == caption('predicted / true', (0, 0, 0), 3 * 96)).all()
    assert (grid[CAPTION + 96 :, :96] == caption('astronaut /\nretina', BAD, 96)).all()
    assert (grid[CAPTION + 96 :, 96:192] == caption('retina /\nretina', GOOD, 96)).all()
    assert text_width(f'{names[2]} / {names[2]}') > 92  # so every caption of this grid takes two lines
    short = labeled_grid(images[:2], [0, 1], [0, 1], ['cat', 'dog'])[CAPTION:]  # one line where all fit
    assert short.shape == (96 + CAPTION, 2 * 96, 3) and (short[96:, :96] == caption('cat / cat', GOOD, 96)).all()
    drawn = caption(names[2], GOOD, 96)
    assert drawn.shape == (CAPTION, 96, 3) and (drawn[:, -2:] == 255).all()  # cut short: nothing at the edge
    # the confusion matrix's class names too (its headers ran into each other: 'backgrored thi blue th')
    from utils.viz import fitted

    assert fitted('background', 40).endswith('…') and text_width(fitted('background', 40)) <= 40
    assert fitted('cat', 40) == 'cat'


def test_the_confusion_matrix_shows_whole_counts_and_names_and_how_to_read_it():
    """A segmentation's 14497110 pixels showed as '144971' (the rest under the next cell), and column names
    were cut to about five characters ('turtle_…' four times)."""
    import numpy as np

    from utils.viz import compact_count, confusion_matrix_image, text_width

    assert [compact_count(n) for n in (0, 99_999, 144_971, 14_497_110, 999_600, 3 * 10**12)] == [
        '0', '99999', '145k', '14.5M', '1M', '3T'
    ]  # fmt: skip
    names = ['turtle_green_sea', 'turtle_leatherback', 'Élan café crème']
    picture = confusion_matrix_image(np.array([[14_497_110, 3, 0], [1, 2, 3], [0, 0, 5]]), names)
    margin = int(max(text_width(name) for name in names)) + 8  # the widest name, whole, beside the rows
    assert picture.shape[1] >= margin + 3 * 44 and picture.shape[0] >= margin + 3 * 44
    # 1000 classes drew a 44,068-pixel square (19.6 GB of memory, 90 s, too large for Pillow to open)
    many = confusion_matrix_image(np.eye(1000, dtype=np.int64) * 7, [f'class {i}' for i in range(1000)])
    assert max(many.shape[:2]) < 2100 and (many[1000] != 255).any()  # a diagonal cell on a middle row
    # 5000 classes drew 5024 pixels a side (cells of one pixel): now a pixel adds up 3x3 classes
    more = confusion_matrix_image(np.eye(5000, dtype=np.int64), [f'class {i}' for i in range(5000)])
    assert max(more.shape[:2]) < 2100 and (more[1000] != 255).any()


def test_train_accuracy_keeps_three_counts_not_a_confusion_matrix():
    """The training curves' metrics kept a C x C matrix, in every checkpoint (200 MB with 5000 classes),
    and built one every 32 batches; and result.json wrote a line per cell of the confusion matrix (a
    million lines for 1000 classes). The counts give the same acc and top-k, and a checkpoint of a Kiln
    that kept the matrix resumes into them."""
    import json

    from metrics import ClassificationMetrics
    from utils.checkpoint import json_text

    seed = 3
    generator = torch.Generator().manual_seed(seed)
    with_matrix, counts = ClassificationMetrics(1000, topk=5), ClassificationMetrics(1000, topk=5, per_class=False)
    for _ in range(3):
        logits, labels = torch.randn(64, 1000, generator=generator), torch.randint(0, 1000, (64,), generator=generator)
        logits[:20, 7] = 10.0  # some right answers
        labels[:20] = 7
        with_matrix.update(logits, {'label': labels})
        counts.update(logits, {'label': labels})
    state = counts.state_dict()
    assert sum(tensor.numel() for tensor in state.values()) == 3, f'seed {seed}'
    resumed = ClassificationMetrics(1000, topk=5, per_class=False)
    resumed.load_state_dict(with_matrix.state_dict())
    assert counts.compute() == with_matrix.compute() == resumed.compute(), f'seed {seed}'
    assert counts.compute()['acc'] >= 60 / 192
    text = json_text({'confusion_matrix': with_matrix.confusion.tolist(), 'recall': [0.5, float('nan')], 'name': 'x'})
    assert len(text.splitlines()) == 1000 + 6 and json.loads(text)['recall'] == [0.5, None]
    assert json.loads(json_text({'rows': [[1, 2]], 'name': 'a\x000'})) == {'rows': [[1, 2]], 'name': 'a\x000'}


def test_checkpoints_to_evaluate_names_each_once_and_skips_non_experiments(tmp_path):
    """'checkpoints/*' matched Kiln's own comparisons/ folder (no best.pth: the comparison stopped), and a
    folder given with its best.pth was evaluated twice, the second time refused after the first ran."""
    from utils.run_folder import checkpoints_to_evaluate

    for name in ('a', 'b'):
        (tmp_path / name).mkdir()
        (tmp_path / name / 'args.yaml').write_text('lr: 0.1\n')
        (tmp_path / name / 'best.pth').write_bytes(b'')
    (tmp_path / 'comparisons').mkdir()
    found = checkpoints_to_evaluate([str(tmp_path / '*'), str(tmp_path / 'a'), str(tmp_path / 'a' / 'best.pth')])
    assert found == [str(tmp_path / 'a' / 'best.pth'), str(tmp_path / 'b' / 'best.pth')]
    # a run named with wildcards (--save_prefix 'exp[1]', as train.py printed it): the path that exists
    (tmp_path / 'exp[1]').mkdir()
    (tmp_path / 'exp[1]' / 'best.pth').write_bytes(b'')
    for named in (tmp_path / 'exp[1]', tmp_path / 'exp[1]' / 'best.pth'):
        assert checkpoints_to_evaluate([str(named)]) == [str(tmp_path / 'exp[1]' / 'best.pth')]


def test_a_graphed_models_outputs_are_copies_that_train_and_unwrap():
    """CUDA graphs replay into the same memory: CopiedOutputs hands out copies (of every tensor in a dict
    too), gradients still reach the weights, and unwrap_model / state dicts see the plain model."""
    from utils.model_setup import CopiedOutputs

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(2, 3)
            self.last = None

        def forward(self, x):
            self.last = self.body(x)
            return {'scores': self.last, 'count': 2}

    inner = TwoHeads()
    model = CopiedOutputs(inner)
    outputs = model(torch.ones(4, 2))
    assert outputs['count'] == 2
    assert outputs['scores'].data_ptr() != inner.last.data_ptr() and torch.equal(outputs['scores'], inner.last)
    outputs['scores'].sum().backward()
    assert inner.body.weight.grad is not None and inner.body.weight.grad.abs().sum() > 0
    assert unwrap_model(model) is inner
    assert sorted(model.state_dict()) == ['module.body.bias', 'module.body.weight']


@pytest.fixture
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for one test."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def test_under_deterministic_algorithms_upblock_and_pixel_cross_entropy_keep_their_values(deterministic_algorithms):
    """--deterministic swaps two ops whose CUDA kernels it refuses (bilinear upsampling's gradient, the
    2-d cross entropy) for equivalent ones: the same outputs and gradients as the usual ops."""
    from loss import CrossEntropyLoss
    from model.submodules import upsample_2x

    seed = 7
    generator = torch.Generator().manual_seed(seed)
    for shape in [(2, 3, 5, 7), (1, 2, 1, 1), (2, 4, 8, 6)]:
        x = torch.randn(*shape, dtype=torch.float64, generator=generator, requires_grad=True)
        (ours,) = torch.autograd.grad((upsample_2x(x) ** 2).sum(), x)
        expected = torch.nn.functional.interpolate(x, scale_factor=2, mode='bilinear', align_corners=False)
        assert torch.allclose(upsample_2x(x), expected, atol=1e-12), f'{shape} (seed {seed})'
        (reference,) = torch.autograd.grad((expected**2).sum(), x)
        assert torch.allclose(ours, reference, atol=1e-12), f'{shape} (seed {seed})'
    block = UpBlock(4, 3).double().eval()
    x = torch.randn(2, 4, 6, 5, dtype=torch.float64, generator=generator)
    swapped = block(x)
    torch.use_deterministic_algorithms(False)
    assert torch.allclose(swapped, block(x), atol=1e-12)
    scores = torch.randn(2, 4, 5, 6, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, 4, (2, 5, 6), generator=generator)
    labels[0, 0, :3] = -100  # ignored pixels count in neither loss
    shares = torch.softmax(torch.randn(2, 4, 5, 6, dtype=torch.float64, generator=generator), 1)
    for options in ({}, {'label_smoothing': 0.1}):
        for target in (labels, shares):
            usual = torch.nn.CrossEntropyLoss(**options)(scores, target)
            torch.use_deterministic_algorithms(True)
            assert torch.allclose(CrossEntropyLoss(**options)(scores, target), usual, atol=1e-12), options
            torch.use_deterministic_algorithms(False)


def test_cuda_graphs_with_gradient_accumulation_are_refused_in_one_line():
    """pytorch/pytorch#169545: a graph's gradient outputs become .grad and the next replay overwrites them."""
    from utils.model_setup import setup_model

    options = argparse.Namespace(compile=True, compile_mode='reduce-overhead', grad_accum_steps=2)
    with pytest.raises(KilnError, match=r'--compile_mode reduce-overhead captures CUDA graphs.*--grad_accum_steps 1$'):
        setup_model(options, torch.device('cuda'))  # refused before anything touches the GPU


# Three 12 MiB blocks allocated and freed per step, after a 16 MiB one was freed once: glibc's own
# thresholds (raised to 16 MiB by that free) give the 36 MiB back to the system at every step, so each
# step touches fresh pages; with Kiln's setting they are reused. Prints the page faults of 10 steps.
FREED_MEMORY_PATTERN = """
import resource, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
if sys.argv[1] == 'kiln':
    from utils.allocator import keep_freed_memory
    assert keep_freed_memory()
del_me = np.ones(4 << 20, np.float32)
del del_me
def step():
    blocks = [np.ones(3 << 20, np.float32) for _ in range(3)]
    del blocks
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='the malloc thresholds are glibc (Linux) ones')
def test_memory_freed_by_a_step_is_reused_by_the_next_without_page_faults():
    def faults(mode):
        env = {k: v for k, v in os.environ.items() if not k.startswith('MALLOC_') and k != 'GLIBC_TUNABLES'}
        run = subprocess.run(
            [sys.executable, '-c', FREED_MEMORY_PATTERN, mode, REPO],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout(120),
        )
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    pages_per_step = 3 * (12 << 20) // 4096
    default = faults('default')
    if default < pages_per_step:  # this libc keeps the memory by itself: nothing to show
        pytest.skip(f"this libc's own malloc thresholds already reuse the memory ({default} page faults)")
    assert faults('kiln') < pages_per_step // 10, f"glibc's default: {default} page faults in 10 steps"


@pytest.mark.parametrize(
    ('name', 'value'), [('MALLOC_TRIM_THRESHOLD_', '131072'), ('GLIBC_TUNABLES', 'glibc.malloc.mmap_threshold=65536')]
)
def test_the_users_own_malloc_settings_are_left_alone(monkeypatch, name, value):
    from utils.allocator import keep_freed_memory

    monkeypatch.setenv(name, value)
    assert keep_freed_memory() is False


def test_evaluation_hands_each_pictured_batch_over_as_soon_as_it_is_copied():
    """The chosen batches' first samples go to `pictures` while the evaluation goes on (so they are drawn
    meanwhile, not all kept until the end), as host copies the later batches cannot change."""
    from tasks.classify import ClassifyTask
    from utils.evaluation import evaluate

    options = argparse.Namespace(num_classes=3, loss=None, topk=2)
    task = ClassifyTask(options)
    generator = torch.Generator().manual_seed(0)
    batches = [
        {
            'image': torch.rand(20, 3, 4, 4, generator=generator),
            'label': torch.randint(0, 3, (20,), generator=generator),
        }
        for _ in range(5)
    ]

    class Split:
        def numbers(self):
            return range(len(batches))

        def epoch(self, epoch):
            yield from batches

    evaluated, handed = [], []

    class Model(nn.Module):
        def forward(self, images):
            evaluated.append(len(images))
            return images.mean((2, 3)) * torch.arange(1.0, 4.0)

    def pictures(number, source):
        batch, outputs = source.get()
        handed.append((number, len(evaluated), batch, outputs))

    result = evaluate(Model(), Split(), task, contextlib.nullcontext, picture_batches={0, 3}, pictures=pictures)
    assert [(number, seen) for number, seen, _, _ in handed] == [(0, 1), (3, 4)]  # right after batches 0 and 3
    for number, _, batch, outputs in handed:
        torch.testing.assert_close(batch['image'], batches[number]['image'][: task.pictured])
        torch.testing.assert_close(batch['label'], batches[number]['label'][: task.pictured])
        torch.testing.assert_close(
            outputs, batches[number]['image'][: task.pictured].mean((2, 3)) * torch.arange(1.0, 4.0)
        )
    assert result.metric_object.confusion.sum() == 100


@pytest.mark.parametrize('seed', [0, 1])
def test_a_segmentation_loss_with_void_pixels_is_the_same_for_any_batch_size(seed):
    """With --ignore_index, each batch's loss (a mean over its kept pixels) was weighed by its images: the
    split's loss depended on the batch size (eval.py's differed from training's validation), and a batch
    of void pixels alone made it NaN (and stopped a training run as non-finite)."""
    from tasks.segment import SegmentTask
    from utils.evaluation import evaluate

    task = SegmentTask(argparse.Namespace(num_classes=3, loss=None, ignore_index=255))
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(8, 3, 6, 6, generator=generator)
    masks = torch.randint(0, 3, (8, 6, 6), generator=generator)
    for index in range(8):  # void bands of every height; the last image void alone
        masks[index, : index if index < 7 else 6] = 255
    images = torch.arange(8.0).view(8, 1, 1, 1).expand(8, 3, 6, 6)  # the model looks its scores up by this

    class Model(nn.Module):
        def forward(self, batch_images):
            return scores[batch_images[:, 0, 0, 0].long()]

    def split_loss(sizes):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        batches = [{'image': images[a : a + n], 'mask': masks[a : a + n]} for a, n in zip(starts, sizes)]

        class Split:
            def numbers(self):
                return range(len(batches))

            def epoch(self, epoch):
                yield from batches

        return evaluate(Model(), Split(), task, contextlib.nullcontext).metrics['loss']

    expected = nn.functional.cross_entropy(scores, masks, ignore_index=255).item()  # over every kept pixel
    for sizes in ([8], [4, 4], [1] * 8, [5, 3], [7, 1]):
        assert split_loss(sizes) == pytest.approx(expected, rel=1e-6), (seed, sizes)
    void = task.loss(scores[7:], {'mask': masks[7:]})
    assert void.item() == 0  # not NaN


def test_normalization_follows_the_backbone_and_old_checkpoints_keep_kiln_s():
    """Pretrained ImageNet backbones were fed Kiln's normalization (mean 0.5, std 0.25): ImageNet's mean
    colour came in as (-0.06, -0.18, -0.37) instead of 0; a checkpoint of an earlier Kiln keeps its own."""
    from data.augment import BatchTransform
    from options import inherit, parse_test_args, resolve

    def resolved(*argv):
        return resolve(parse_args(parse_train_args, list(argv))).normalize

    assert resolved('--model_type', 'tv_resnet18') == resolved('--model_type', 'timm:resnet18') == 'imagenet'
    assert resolved('--model_type', 'small_cnn') == 'kiln'
    assert resolved('--model_type', 'tv_resnet18', '--normalize', 'kiln') == 'kiln'
    mean_colour = torch.tensor([0.485, 0.456, 0.406]).mul(255).round().to(torch.uint8).view(1, 3, 1, 1)
    images = {'image': mean_colour.expand(2, 3, 4, 4).clone()}
    imagenet = argparse.Namespace(normalize='imagenet')
    normalized = BatchTransform((), 4, options=imagenet)(images)['image']
    assert normalized.abs().max() < 0.01, normalized[0, :, 0, 0]
    test_args = parse_args(parse_test_args, ['--load_model_path', 'x.pth'])
    trained = {'model_type': 'tv_resnet18', 'task': 'classify', 'num_classes': 3}
    assert inherit(test_args, set(), trained).normalize == 'kiln'  # no 'normalize' saved: Kiln's, as it trained
    assert inherit(test_args, set(), {**trained, 'normalize': 'imagenet'}).normalize == 'imagenet'


def test_a_training_run_whose_peer_is_gone_says_to_resume(monkeypatch):
    """The advice to resume was in every script's line, eval.py's too; a training run's error carries it."""
    import train

    class Gone(train.Trainer):
        def __init__(self, saved_step):  # nothing built: run() only calls these
            self.logger = train.Logger()
            self.options = argparse.Namespace(resume_from=None)
            self.saved_step = saved_step

        def summary_line(self):
            return ''

        def work_left(self):
            return True

        def train(self):
            raise RuntimeError('[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:9124')

    with pytest.raises(RuntimeError) as raised:
        Gone(saved_step=6).run()
    assert raised.value.__notes__ == ['the newest checkpoint is whole: continue with --resume']
    with pytest.raises(RuntimeError) as raised:  # gone before the first checkpoint: it told to resume
        Gone(saved_step=0).run()
    assert raised.value.__notes__ == ['nothing was saved yet']


def test_a_checkpoint_whose_optimizer_groups_differ_says_an_earlier_kiln_may_have_grouped_the_layers():
    """Today's layer groups put a ViT's own parameters with group 0 and both heads of a distilled one
    last: a checkpoint saved before has other optimizer groups, and 'resume with the options it was
    trained with' was the only advice, though the options were those."""
    from utils.checkpointer import Checkpointer

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    before = torch.optim.SGD([{'params': [*model[0].parameters(), model[1].weight]}, {'params': [model[1].bias]}])
    now = torch.optim.SGD([{'params': list(model[0].parameters())}, {'params': list(model[1].parameters())}])
    checkpoint = {'optimizer': before.state_dict()}
    with pytest.raises(KilnError, match='grouped the layers otherwise: start a new run from its weights'):
        Checkpointer({'optimizer': now}).load(checkpoint, 'old.pth')


def test_every_augmentation_is_an_augment_choice():
    """options.py (no torch: --augment is checked before torch loads) keeps the augmentation names beside
    data/augment.py's AUGMENTATIONS and MIXES; one registered only there was refused by --augment."""
    import options
    from data.augment import AUGMENTATIONS, MIXES

    assert set(options.AUGMENTATIONS) == set(AUGMENTATIONS) | set(MIXES), 'add the name to options.AUGMENTATIONS'
    assert set(options.MIX_NAMES) == set(MIXES)


def test_help_gives_the_defaults_and_what_eval_and_predict_take_from_the_checkpoint():
    """--help gave no default for most options (12 epochs, adamw, ...), and eval.py's and predict.py's said
    only "task, model, dataset and image size" come from the checkpoint, where every option that decides
    the numbers does."""
    from options import INHERITED, NOT_USED_IN_PREDICTION, KilnArgumentParser, parse_predict_args, parse_test_args

    help_text = ' '.join(parse_train_args(KilnArgumentParser()).format_help().split())
    for shown in ('--epochs EPOCHS passes over the training data (default: 12)', '(default: adamw)', '(default: 128)'):
        assert shown in help_text, shown
    for add_args in (parse_test_args, parse_predict_args):  # their docstrings are their --help's description
        flags = [name for name in INHERITED if f'--{name}' in add_args(KilnArgumentParser())._option_string_actions]
        flags = [name for name in flags if add_args is parse_test_args or name not in NOT_USED_IN_PREDICTION]
        description = ' '.join(add_args.__doc__.split())
        assert len(flags) >= 10 and [name for name in flags if f'--{name}' not in description] == [], flags


def test_a_cpu_run_resumed_under_torchrun_joins_a_cpu_group(tiny_shapes, tmp_path, monkeypatch):
    """train.py joined torchrun's group with the command line's --cpu, before the options were merged with
    the resumed run's: on a GPU machine the "train more" line it printed for a --cpu run (no --cpu in it)
    was refused with one GPU, and joined NCCL with several, for a model on the CPU."""
    import train
    from options import parse_args, parse_train_args
    from tests.conftest import experiment_of, run_script, tiny_run_args
    from utils.run_folder import resumed_on_cpu

    args = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--model_type', 'linear', '--max_iteration', '1']
    assert run_script('train.py', *args).returncode == 0
    folder = experiment_of(args, 'linear')
    options = [*args[: args.index('--cpu')], *args[args.index('--cpu') + 1 :]]  # the same run, --cpu not given
    monkeypatch.chdir(folder)
    for resume in (['--resume', folder], ['--resume', 'last.pth'], [*options, '--resume']):
        assert resumed_on_cpu(parse_args(parse_train_args, resume), resume), resume
    for argv in (options, ['--resume', folder, '--no-cpu']):  # a new run, a resume moved to the GPU: as given
        assert not resumed_on_cpu(parse_args(parse_train_args, argv), argv), argv
    joined = []

    def record_and_stop(cpu, gpus):
        joined.append(cpu)
        raise KilnError('stop here')

    monkeypatch.setattr(train, 'init_distributed', record_and_stop)
    with pytest.raises(KilnError, match='stop here'):
        train.main(['--resume', folder, '--max_iteration', '2'])
    assert joined == [True]


def test_the_memory_an_in_memory_dataset_may_take_counts_a_container_s_limits(tmp_path, monkeypatch):
    """The check read the machine's MemAvailable only: in a container (`docker run --memory`, a cgroup) or
    under `ulimit -v` the data were decoded past the limit, and the kernel killed the run without a word
    (or it said out of memory, lower --batch_size)."""
    import resource

    import data.mem_list_dataset as mem

    for version, own, files in (
        ('v2', '0::/job\n', {'job/memory.max': '3000000000', 'job/memory.current': '1000000000'}),
        (
            'v1',
            '4:memory:/docker/x\n1:cpu:/\n',
            {'memory/memory.limit_in_bytes': '2000000000\n', 'memory/memory.usage_in_bytes': '500000000\n'},
        ),  # fmt: skip
        ('none', '0::/\n', {'memory.max': 'max', 'memory.current': '5'}),
    ):
        tree = tmp_path / version
        for name, text in files.items():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            (tree / name).write_text(text)
        (tree / 'cgroup').write_text(own)
        expected = {'v2': 2_000_000_000, 'v1': 1_500_000_000, 'none': None}[version]
        assert mem._cgroup_headroom(str(tree / 'cgroup'), str(tree)) == expected, version
    size = mem._meminfo('/proc/self/status', 'VmSize:')
    if size is not None:
        monkeypatch.setattr(resource, 'getrlimit', lambda kind: (size + 50_000_000, resource.RLIM_INFINITY))
        assert mem.available_memory() <= 50_000_000


def test_rows_name_the_class_the_metrics_count_when_softmax_ties_two_scores():
    """predictions.csv and predict.py took the class from softmax's max: two logits a rounding apart
    became one probability and it named the lower class, where the metrics (argmax) counted the higher."""
    from metrics import ClassificationMetrics
    from tasks.classify import ClassifyTask

    task = ClassifyTask(argparse.Namespace(num_classes=2, loss=None, topk=1), ['cat', 'dog'])
    logits = torch.tensor([[0.1, torch.nextafter(torch.tensor(0.1), torch.tensor(1.0)).item()]])
    batch = {'label': torch.tensor([1])}
    metrics = ClassificationMetrics(2, topk=1)
    metrics.update(logits, batch)
    assert metrics.compute()['acc'] == 1.0
    assert task.eval_rows(batch, logits) == [[[1, 1, '0.5000', 'dog', 'dog']]]
    assert task.predict_rows(batch, logits, ['x.png'], None) == [[[1, 'dog', '0.5000']]]


def test_the_confusion_matrix_counts_uint8_targets_without_wrapping():
    """targets * num_classes was computed in the targets' type: uint8 masks of 21 classes wrapped past 255."""
    targets = torch.tensor([20, 13, 5, 0], dtype=torch.uint8)
    counts = confusion_matrix(targets.long(), targets, 21)
    assert counts.sum() == 4 and torch.equal(counts.diagonal()[targets.long()], torch.ones(4, dtype=torch.long))


def test_masks_of_more_than_255_classes_keep_class_255_apart_from_unseen(tmp_path):
    """A 256-class model's class 255 was written as 255, the value of pixels the model did not see."""
    import numpy as np
    from PIL import Image

    from tasks.segment import SegmentTask

    task = SegmentTask(argparse.Namespace(num_classes=256, loss=None))
    logits = torch.zeros(1, 256, 4, 4)
    logits[0, 255] = 1.0  # every pixel: class 255
    batch = {'region': torch.tensor([[2.0, 0.0, 6.0, 4.0]]), 'image_size': torch.tensor([[8, 4]])}
    ((path,),) = task.predict_rows(batch, logits, ['a.png'], str(tmp_path))[0]
    mask = np.asarray(Image.open(path))
    assert mask.dtype == np.uint16 and (mask[:, 2:6] == 255).all()
    assert (mask[:, :2] == 65535).all() and (mask[:, 6:] == 65535).all()
    task = SegmentTask(argparse.Namespace(num_classes=255, loss=None))  # below 255: 8-bit, as before
    ((path,),) = task.predict_rows(batch, logits[:, :255], ['a.png'], str(tmp_path))[0]
    assert np.asarray(Image.open(path)).dtype == np.uint8


def test_a_checkpoint_that_kept_the_sample_order_is_checked_by_its_length():
    """Earlier Kilns kept the epoch's whole sample order (4 bytes a sample, in every checkpoint); a
    checkpoint now keeps the count and a digest of the samples, and one of an earlier Kiln still loads."""
    from utils.checkpointer import TrainingData

    class Listed:
        def __init__(self, samples):
            self.samples = samples

        def __len__(self):
            return len(self.samples)

    class Batches:
        def __init__(self, samples):
            self.dataset = Listed(samples)

    data = TrainingData(Batches([('a/1.png', 0, 1), ('a/2.png', 1, 2)]))
    data.load_state_dict({'order': torch.tensor([1, 0], dtype=torch.int32)})
    with pytest.raises(KilnError, match='have 2 samples now, the checkpoint was trained on 3'):
        data.load_state_dict({'order': torch.tensor([1, 0, 2], dtype=torch.int32)})
    state = data.state_dict()
    assert state['samples'] == 2 and len(state['digest']) == 64
    TrainingData(Batches([('b/1.png', 0, 1), ('b/2.png', 1, 2)])).load_state_dict(state)  # moved: the same
    with pytest.raises(KilnError, match='differ from those the checkpoint was trained on'):
        TrainingData(Batches([('a/1.png', 1, 1), ('a/2.png', 0, 2)])).load_state_dict(state)
    # samples of another kind (tensors and labels, dicts): the count alone (the digest read a tensor as a path)
    for samples in ([(torch.zeros(3), 0), (torch.ones(3), 1)], [{'path': 'a'}, {'path': 'b'}]):
        other = TrainingData(Batches(samples))
        assert other.state_dict() == {'samples': 2, 'digest': None}
        other.load_state_dict(state)


def test_ignore_index_leaves_its_pixels_out_of_the_confusion_matrix_and_the_loss():
    """--ignore_index: counted nowhere (no host sync: the pixels add 0), and no part of the loss."""
    from loss import select_loss
    from metrics import SegmentationMetrics

    seed = 5
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, 4, 4, generator=generator)
    mask = torch.randint(0, 3, (2, 4, 4), generator=generator)
    mask[:, 0] = 255  # a void row
    counts = confusion_matrix(logits.argmax(1), mask, 3, ignore=255)
    kept = mask != 255
    assert counts.sum() == kept.sum(), f'seed {seed}'
    assert counts.trace() == (logits.argmax(1) == mask)[kept].sum(), f'seed {seed}'
    metrics = SegmentationMetrics(3, ignore=255)
    metrics.update(logits, {'mask': mask})
    assert metrics.compute()['pixel_acc'] == pytest.approx(((logits.argmax(1) == mask)[kept]).double().mean().item())
    loss = select_loss('cross_entropy', ignore_index=255)(logits, mask)
    scores = logits.movedim(1, -1)[kept]
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(scores, mask[kept])), f'seed {seed}'


def test_a_stop_signal_in_the_middle_of_a_write_to_stderr_still_says_so(capfd, monkeypatch):
    """The handler printed to sys.stderr: a Ctrl-C that came while the progress bar was writing there
    ended the run with "RuntimeError: reentrant call inside <_io.BufferedWriter name='<stderr>'>" (2 of 10
    tries in a terminal), unsaved. It writes to the file descriptor now."""
    import signal
    import sys

    from utils.stopping import StopSignals

    class BusyStream:  # a buffered stream in the middle of a write, as the interrupted code left it
        encoding = 'utf-8'

        def fileno(self):
            return sys.__stderr__.fileno()

        def isatty(self):
            return False

        def write(self, text):
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

        flush = write

    from utils.errors import STOPPING

    signals = StopSignals()
    monkeypatch.setattr(sys, 'stderr', BusyStream())
    try:
        signals._handle(signal.SIGINT, None)
    finally:
        STOPPING.clear()  # (the handler notes the stop for the run it would end)
    assert signals.received == signal.SIGINT
    assert 'SIGINT received: finishing the current step and saving' in capfd.readouterr().err


def test_data_parallel_refuses_bf16_and_compile():
    """DataParallel's replicas run in threads of their own, which enter autocast in float16 whatever --amp
    says (bf16 trained in fp16, with no scaler); a compiled model's replicas all call the first GPU's module."""
    from utils.distributed import check_data_parallel

    for changes, said in (({'amp': 'bf16'}, '--amp bf16'), ({'compile': True}, '--compile')):
        options = argparse.Namespace(**{'gpus': [0, 1], 'amp': 'off', 'compile': False, **changes})
        with pytest.raises(KilnError, match=f'^--gpus 0 1 \\(DataParallel\\) does not work with {said} .*torchrun'):
            check_data_parallel(options)
    check_data_parallel(argparse.Namespace(gpus=[0, 1], amp='fp16', compile=False))  # what it can do


def test_an_in_memory_dataset_too_large_for_the_gpu_stays_in_host_memory_as_it_is(monkeypatch):
    """It was copied whole into pinned memory: twice the host memory (pinned blocks round up to a power of
    two), for batches that index_select copies into ordinary memory and pins again anyway."""
    from data.loader import place_in_memory

    monkeypatch.setattr(torch.cuda, 'mem_get_info', lambda device=None: (1000, 8000))
    tensors = {'image': torch.zeros(10, 3, 8, 8, dtype=torch.uint8), 'label': torch.zeros(10, dtype=torch.int64)}
    placed = place_in_memory(tensors, torch.device('cuda', 0))  # 2000 bytes: over a quarter of 1000 free
    assert all(placed[key] is tensors[key] for key in tensors)


def test_a_resume_that_sees_another_number_of_gpus_restores_its_own_gpu_s_generator(monkeypatch):
    """The GPU generators were restored only where as many GPUs were visible: resumed under another
    CUDA_VISIBLE_DEVICES, the process's GPU drew other dropout masks, without a word."""
    from utils.seeding import rng_states, set_rng_states

    states = dict(rng_states(), cuda=[torch.tensor([0], dtype=torch.uint8), torch.tensor([1], dtype=torch.uint8)])
    restored = []
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    monkeypatch.setattr(torch.cuda, 'set_rng_state', lambda state, device='cuda': restored.append(state.item()))
    set_rng_states(dict(states, cuda_device=1))  # it computed on its second GPU, the one now visible
    assert restored == [1]
    set_rng_states(dict(states, cuda_device=None))  # a checkpoint of an earlier Kiln: as before, none
    assert restored == [1]


def test_a_checkpoint_trained_on_another_machine_reads_its_generated_data_here(tmp_path):
    """The checkpoint's --data_root, saved as an absolute path, named a folder of the machine it trained on:
    eval.py made it there (the shapes generated at /home/someone_else/...), or failed to."""
    from options import inherit, parse_args, parse_test_args

    args = parse_args(parse_test_args, ['--load_model_path', 'x.pth'])
    trained = {'model_type': 'small_cnn', 'task': 'classify', 'num_classes': 6}
    elsewhere = inherit(args, set(), {**trained, 'data_root': str(tmp_path / 'not_here')}).data_root
    assert elsewhere == os.path.abspath(args.data_root)  # this project's own
    assert inherit(args, set(), {**trained, 'data_root': str(tmp_path)}).data_root == str(tmp_path)  # it is here
