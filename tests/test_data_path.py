"""The data path: uint8 batches augmented per batch on the device, with random parameters fixed by
(seed, epoch, sample position), so batches come out the same from memory or from disk, with any
number of workers or processes, and after a resume; masks and boxes move with their pixels."""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, run_script, timeout
from data.augment import BatchTransform, RandomCrop, _reflect, _shifted
from data.list_dataset import ListDataset
from data.loader import Batches, pad_collate
from data.mem_list_dataset import MemListDataset

CPU = torch.device('cpu')


def _args(shapes_dir, **overrides):
    values = dict(
        train_list=os.path.join(shapes_dir, 'train.txt'),
        val_list=os.path.join(shapes_dir, 'val.txt'),
        img_size=32,
        num_classes=None,
        data_type='list',
        data_root=None,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def _epoch(batches, epoch, start=0):
    return [{key: value.clone() for key, value in batch.items()} for batch in batches.epoch(epoch, start)]


def test_batches_are_the_same_from_memory_or_disk_with_any_workers(tiny_shapes):
    args = _args(tiny_shapes)
    common = dict(batch_size=16, shuffle=True, seed=3, augment=('crop', 'hflip'))
    in_memory = _epoch(Batches(MemListDataset(args, 'train'), CPU, **common), epoch=1)
    for workers in (0, 2):
        from_disk = _epoch(Batches(ListDataset(args, 'train'), CPU, workers=workers, **common), epoch=1)
        assert len(from_disk) == len(in_memory) == 6
        for a, b in zip(from_disk, in_memory):
            assert torch.equal(a['image'], b['image']) and torch.equal(a['label'], b['label'])


@pytest.mark.parametrize('workers', [0, 1])
def test_reading_batches_leaves_the_global_random_state_alone(tiny_shapes, workers):
    """Each DataLoader iterator drew its workers' base seed from the global generator: with persistent
    workers an uninterrupted run drew it once, before its first checkpoint, and a resumed run again
    after loading that checkpoint's state, so a model with dropout resumed differently."""
    batches = Batches(
        ListDataset(_args(tiny_shapes), 'train'), CPU, batch_size=16, shuffle=True, seed=3, workers=workers
    )
    try:
        state = torch.get_rng_state()
        _epoch(batches, epoch=0)
        _epoch(batches, epoch=1)
        assert torch.equal(torch.get_rng_state(), state)
    finally:
        batches.close()


def test_the_decoded_cache_follows_a_classes_file_edited_since(tmp_path):
    """A validation list renumbered to the training classes (match_classes) kept the labels of its old
    classes.txt from the cache after the file was corrected: the list and the final class order, the
    cache's key, had not changed."""
    from PIL import Image

    from data.list_dataset import match_classes

    for index in range(2):
        Image.new('RGB', (8, 8), (index * 200, 0, 0)).save(tmp_path / f'{index}.png')
    (tmp_path / 'val.txt').write_text('0.png 0\n1.png 1\n')
    args = argparse.Namespace(
        val_list=str(tmp_path / 'val.txt'), img_size=8, num_classes=None, data_type='mem_list',
        data_root=str(tmp_path / 'root'), resize=None, crop_pct=None,
    )  # fmt: skip
    for names, labels in (('dog\ncat\n', [1, 0]), ('cat\ndog\n', [0, 1])):
        (tmp_path / 'classes.txt').write_text(names)
        dataset = MemListDataset(args, 'val')
        match_classes(dataset, ['cat', 'dog'], 'train.txt')
        assert dataset.tensors()['label'].tolist() == labels, names


def test_the_decoded_cache_sees_a_file_rewritten_with_its_size_and_time_kept(tmp_path):
    """The cache was checked against each file's size and modification time only: an image rewritten
    with both kept (`cp -p`, `rsync -a`, an archive unpacked again; fixed-size formats such as BMP)
    gave the old pixels. And a run killed while writing the cache left its temporary copy forever."""
    from PIL import Image

    from data.list_dataset import CACHE_FOLDER

    image = tmp_path / 'a.bmp'
    Image.new('RGB', (8, 8), (0, 0, 0)).save(image)
    (tmp_path / 'val.txt').write_text('a.bmp 0\n')
    args = argparse.Namespace(
        val_list=str(tmp_path / 'val.txt'), img_size=8, num_classes=None, data_type='mem_list',
        data_root=str(tmp_path / 'root'), resize=None, crop_pct=None,
    )  # fmt: skip
    assert MemListDataset(args, 'val').tensors()['image'].max() == 0  # decoded, and cached
    stat = os.stat(image)
    Image.new('RGB', (8, 8), (255, 255, 255)).save(image)  # the same size: 8x8 BMP
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(image).st_size == stat.st_size
    cache = tmp_path / 'root' / CACHE_FOLDER
    dead = subprocess.Popen([sys.executable, '-c', 'pass'])
    dead.wait()  # a process that is gone, and one that runs (this one)
    here = socket.gethostname()
    for pid, host in ((dead.pid, here), (os.getpid(), here), (dead.pid, 'another-host')):
        (cache / f'.MemListDataset_val.pt.tmp{pid}@{host}').write_bytes(b'half written')
    assert MemListDataset(args, 'val').tensors()['image'].min() == 255
    assert {name for name in os.listdir(cache) if '.tmp' in name} == {
        f'.MemListDataset_val.pt.tmp{dead.pid}@another-host',  # its process cannot be seen from here
        f'.MemListDataset_val.pt.tmp{os.getpid()}@{here}',
    }


def test_a_data_root_that_is_the_class_folders_itself_trains_again(tmp_path):
    """Its cache folder, made inside by the first run's header check, was read as a class by the next
    split or run: 'cache holds no images', and again after deleting it."""
    from PIL import Image

    for name in ('black', 'white'):
        (tmp_path / 'data' / name).mkdir(parents=True)
        for index in range(2):
            Image.new('RGB', (8, 8), (255 * (name == 'white'),) * 3).save(tmp_path / 'data' / name / f'{index}.png')
    data = str(tmp_path / 'data')
    args = argparse.Namespace(train_list=data, val_list=data, img_size=8, num_classes=None, data_type='list',
                              data_root=data, resize=None, crop_pct=None)  # fmt: skip
    for _ in range(2):
        for split in ('train', 'val'):
            dataset = ListDataset(args, split)
            dataset.check_files()
            assert dataset.class_names == ['black', 'white'] and len(dataset) == 4


def test_the_epochs_augmentation_draws_are_seeded_apart_from_every_sample():
    """The epoch's augmentation generator was seeded as the sample at position 2566 was (mix(seed, epoch,
    0xA06)): their random numbers were the same."""
    from data.loader import AUGMENT_STREAM
    from data.sampler import mix

    for seed, epoch in ((0, 0), (0, 3), (7, 1)):
        stream = mix(seed, epoch, AUGMENT_STREAM)
        assert all(stream != mix(seed, epoch, position) for position in range(100_000)), (seed, epoch)


def test_augmentation_varies_per_sample_and_depends_only_on_seed_epoch_and_position(tiny_shapes):
    dataset = MemListDataset(_args(tiny_shapes), 'train')
    plain = Batches(dataset, CPU, batch_size=96, shuffle=False, seed=0)
    augmented = Batches(dataset, CPU, batch_size=96, shuffle=False, seed=0, augment=('crop', 'hflip'))
    before, after = _epoch(plain, 0)[0]['image'], _epoch(augmented, 0)[0]['image']
    changed = (before != after).flatten(1).any(1)
    assert 20 < changed.sum() <= 96  # most samples moved or flipped, each its own way
    shifts = RandomCrop(32).draw(96, torch.Generator().manual_seed(0))['shift']
    assert len({tuple(s) for s in shifts.tolist()}) > 10
    # another batch size, a start part-way (a resume) and another epoch
    whole = torch.cat(
        [
            b['image']
            for b in _epoch(Batches(dataset, CPU, batch_size=8, shuffle=True, seed=5, augment=('crop', 'hflip')), 2)
        ]
    )
    halves = _epoch(Batches(dataset, CPU, batch_size=16, shuffle=True, seed=5, augment=('crop', 'hflip')), 2)
    assert torch.equal(whole, torch.cat([b['image'] for b in halves]))
    resumed = _epoch(Batches(dataset, CPU, batch_size=16, shuffle=True, seed=5, augment=('crop', 'hflip')), 2, start=3)
    assert torch.equal(torch.cat([b['image'] for b in resumed]), torch.cat([b['image'] for b in halves[3:]]))
    other = _epoch(Batches(dataset, CPU, batch_size=16, shuffle=True, seed=5, augment=('crop', 'hflip')), 3)
    assert not torch.equal(torch.cat([b['image'] for b in other]), whole)


def test_two_processes_see_the_halves_of_one_process_batches(tiny_shapes, monkeypatch):
    import data.loader as loader

    dataset = MemListDataset(_args(tiny_shapes), 'train')
    one = _epoch(Batches(dataset, CPU, batch_size=16, shuffle=True, seed=1, augment=('crop', 'hflip')), 0)
    ranks = []
    for rank in (0, 1):
        monkeypatch.setattr(loader, 'rank', lambda rank=rank: rank)
        monkeypatch.setattr(loader, 'world_size', lambda: 2)
        ranks.append(_epoch(Batches(dataset, CPU, batch_size=8, shuffle=True, seed=1, augment=('crop', 'hflip')), 0))
    for whole, first, second in zip(one, *ranks):
        assert torch.equal(whole['image'], torch.cat([first['image'], second['image']]))


def test_the_crop_is_torchvision_s_reflect_padded_random_crop():
    image = torch.arange(2 * 3 * 8 * 8, dtype=torch.uint8).view(2, 3, 8, 8)
    shift = torch.tensor([[-1, 1], [2, -2]])  # (dy, dx) per sample
    out = RandomCrop(32).apply({'image': image.clone()}, {'shift': shift})['image']
    padded = torch.nn.functional.pad(image.float(), (2, 2, 2, 2), mode='reflect')
    for i, (dy, dx) in enumerate(shift.tolist()):
        assert torch.equal(out[i].float(), padded[i, :, 2 + dy : 10 + dy, 2 + dx : 10 + dx])
    assert _reflect(torch.tensor([-2, -1, 0, 7, 8, 9]), 8).tolist() == [2, 1, 0, 7, 6, 5]


@pytest.mark.parametrize('seed', range(4))
def test_the_batched_crop_moves_every_pixel_where_reflection_says(seed):
    """Against the per-pixel definition (row r of sample i is input row reflect(r + dy_i)), for images,
    masks and extra dimensions of several dtypes, also images smaller than the padding."""
    generator = torch.Generator().manual_seed(seed)
    for shape, dtype in [
        ((5, 3, 17, 9), torch.uint8),
        ((4, 11, 6), torch.int64),
        ((3, 2, 2, 7, 8), torch.float32),
        ((6, 1, 2, 3), torch.uint8),  # smaller than a padding of 4
        ((2, 9, 10), torch.bool),  # masks as some datasets give them (torch pads no bool by reflection)
    ]:
        tensor = torch.randint(0, 2 if dtype == torch.bool else 200, shape, generator=generator).to(dtype)
        padding = int(torch.randint(1, 5, (), generator=generator))
        shift = torch.randint(-padding, padding + 1, (shape[0], 2), generator=generator)
        height, width = shape[-2:]
        rows = _reflect(torch.arange(height) + shift[:, :1], height)  # (N, H)
        columns = _reflect(torch.arange(width) + shift[:, 1:], width)
        expected = torch.stack([tensor[i][..., rows[i], :][..., columns[i]] for i in range(shape[0])])
        moved = _shifted(tensor, shift, padding)
        assert moved.dtype == dtype and torch.equal(moved, expected), f'seed {seed}, {shape} {dtype}, padding {padding}'


def test_masks_and_boxes_move_with_their_pixels():
    image = torch.zeros(1, 3, 32, 32, dtype=torch.uint8)
    image[0, :, 4:10, 20:30] = 255  # one bright box at x 20..30, y 4..10
    batch = {
        'image': image,
        'mask': (image[:, 0] > 0).to(torch.uint8),
        'boxes': torch.tensor([[[20.0, 4.0, 30.0, 10.0], [0.0, 0.0, 0.0, 0.0]]]),
        'box_labels': torch.tensor([[3, -1]]),
    }
    transform = BatchTransform(('crop', 'hflip'), 32)
    params = {(0, 'shift'): torch.tensor([[1, -2]]), (1, 'flip'): torch.tensor([True])}
    out = transform(batch, params)
    bright = out['image'][0, 0] > 0
    rows, columns = bright.nonzero(as_tuple=True)
    x1, y1, x2, y2 = out['boxes'][0, 0].tolist()
    assert (rows.min().item(), rows.max().item() + 1) == (y1, y2) == (3, 9)  # up by 1
    assert (columns.min().item(), columns.max().item() + 1) == (x1, x2) == (32 - 32, 32 - 22)  # right 2, mirrored
    assert torch.equal(out['mask'][0].bool(), bright) and out['box_labels'].tolist() == [[3, -1]]
    assert out['image'].dtype == torch.float32 and out['mask'].dtype == torch.int64


def test_every_target_laid_out_as_the_pixels_moves_with_them_and_keeps_its_values():
    """Only 'image' and 'mask' moved: a new task's depth map (or a mask under another name) stayed where it
    was while its image was flipped and shifted. A float target keeps its values, a bool one stays bool;
    'mask' holds class indices (long)."""
    from data.augment import RandomResizedCrop

    image = torch.zeros(2, 3, 16, 16, dtype=torch.uint8)
    image[:, :, 4:8, 8:12] = 200
    depth = (image[:, 0] > 0).float() * 0.75  # 0.75 where the square is
    for augment, params in (
        (('crop', 'hflip'), {(0, 'shift'): torch.tensor([[1, -2], [0, 1]]), (1, 'flip'): torch.tensor([True, False])}),
        ((), None),
    ):
        batch = {'image': image.clone(), 'depth': depth.clone(), 'seen': depth > 0, 'mask': (depth > 0).byte()}
        batch['label'] = torch.tensor([0, 1])
        out = BatchTransform(augment, 16)(batch, params)
        bright = out['image'][:, 0] > 0
        assert out['depth'].dtype == torch.float32 and torch.equal(out['depth'] == 0.75, bright), augment
        assert out['seen'].dtype == torch.bool and torch.equal(out['seen'], bright), augment
        assert out['mask'].dtype == torch.int64 and torch.equal(out['mask'].bool(), bright), augment
    batch = {'image': image.clone(), 'depth': depth.clone(), 'seen': depth > 0, 'mask': (depth > 0).byte()}
    RandomResizedCrop(16).apply(batch, {'box': torch.tensor([[0.5, 0.0, 1.0, 0.5]] * 2)})
    bright = batch['image'][:, 0] > 100
    assert torch.equal(batch['depth'] == 0.75, bright) and batch['depth'].max() == 0.75
    assert torch.equal(batch['seen'], bright) and batch['seen'].dtype == torch.bool
    assert torch.equal(batch['mask'].bool(), bright) and batch['mask'].dtype == torch.uint8


def test_a_box_pushed_out_of_the_picture_is_dropped():
    batch = {
        'image': torch.zeros(1, 3, 32, 32, dtype=torch.uint8),
        'boxes': torch.tensor([[[0.0, 0.0, 1.5, 1.5]]]),
        'box_labels': torch.tensor([[2]]),
    }
    out = RandomCrop(32).apply(batch, {'shift': torch.tensor([[2, 2]])})
    assert out['box_labels'].tolist() == [[-1]]


def test_a_shift_fills_no_object_outside_its_box():
    """The border was filled by reflection for detection too: an object at the picture's edge got a
    mirrored strip outside its box (a copy with no box of its own); the mirror stays for classification."""
    image = torch.zeros(1, 3, 32, 32, dtype=torch.uint8)
    image[0, :, 10:20, 0:8] = 255  # an object touching the left edge, x 0..8
    shift = {'shift': torch.tensor([[0, -2]])}  # right by 2: the two columns uncovered on the left
    boxes = {'boxes': torch.tensor([[[0.0, 10.0, 8.0, 20.0]]]), 'box_labels': torch.tensor([[1]])}
    out = RandomCrop(32).apply({'image': image.clone(), **boxes}, shift)
    columns = (out['image'][0, 0] > 0).nonzero(as_tuple=True)[1]
    assert (columns.min().item(), columns.max().item() + 1) == tuple(out['boxes'][0, 0, [0, 2]].tolist()) == (2, 10)
    mirrored = RandomCrop(32).apply({'image': image.clone()}, shift)['image'][0, 0]
    assert (mirrored[10:20, :2] > 0).all()  # classification keeps the reflection


def test_a_sample_value_that_cannot_be_batched_is_one_line_naming_its_key():
    """A dataset that added a file name ('name': str) to its samples got torch's bare 'new(): invalid data
    type 'str'' traceback."""
    from utils.errors import KilnError

    with pytest.raises(KilnError, match="a sample's 'name' is a str, which cannot go into a batch"):
        pad_collate([{'image': torch.zeros(3, 2, 2), 'name': 'a.png'}, {'image': torch.zeros(3, 2, 2), 'name': 'b'}])


def test_decoding_in_place_gives_what_pad_collate_gives():
    """In-memory datasets decoded into a list of every sample, then stacked: twice the data in memory.
    Written into whole-dataset tensors as they come, the result is pad_collate's, boxes padded alike."""
    from data.mem_list_dataset import InMemory

    generator = torch.Generator().manual_seed(3)
    samples = [
        {
            'image': torch.randint(0, 256, (3, 4, 4), dtype=torch.uint8, generator=generator),
            'boxes': torch.rand(count, 4, generator=generator),
            'box_labels': torch.arange(count),
            'mask': torch.randint(0, 3, (4, 4), generator=generator),
        }
        for count in (2, 2, 0, 3, 1)  # the same length at first, then not
    ]

    class Five(InMemory):
        def __len__(self):
            return len(samples)

    stacked, expected = Five().stacked(samples.__getitem__), pad_collate(samples)
    assert list(stacked) == list(expected)
    for key in expected:
        assert stacked[key].dtype == expected[key].dtype and torch.equal(stacked[key], expected[key]), key


def test_pad_collate_pads_variable_length_targets():
    samples = [
        {'image': torch.zeros(3, 4, 4, dtype=torch.uint8), 'boxes': torch.ones(n, 4), 'box_labels': torch.arange(n)}
        for n in (2, 0, 3)
    ]
    batch = pad_collate(samples)
    assert batch['image'].shape == (3, 3, 4, 4) and batch['boxes'].shape == (3, 3, 4)
    assert batch['box_labels'].tolist() == [[0, 1, -1], [-1, -1, -1], [0, 1, 2]]
    assert batch['boxes'][1].abs().sum() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_on_a_gpu_in_memory_data_stays_there_and_batches_match_the_cpu(tiny_shapes):
    dataset = MemListDataset(_args(tiny_shapes), 'train')
    common = dict(batch_size=16, shuffle=True, seed=3, augment=('crop', 'hflip'))
    gpu = Batches(dataset, torch.device('cuda'), **common)
    assert gpu.memory['image'].is_cuda
    for a, b in zip(_epoch(gpu, 1), _epoch(Batches(dataset, CPU, **common), 1)):
        assert torch.equal(a['image'].cpu(), b['image'])


# a script whose DataLoader worker (one) hangs in a sample or makes a batch that cannot reach the main process
WORKER_TROUBLE = """
import sys, threading, time
sys.path.insert(0, {repo!r})
from utils.errors import quiet_interrupts, run_to_exit
quiet_interrupts()


def main(argv):
    import torch
    from data.loader import Batches

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            if argv[0] == 'stuck':
                time.sleep(1000)  # a file on a hung network disk, say
            return {{'image': torch.zeros(3, 4, 4, dtype=torch.uint8), 'label': torch.tensor(0)}}

    def unsendable(samples):  # as a batch that shared memory cannot take
        return {{'image': torch.zeros(2, 3, 4, 4, dtype=torch.uint8), 'label': torch.zeros(2), 'x': threading.Lock()}}

    collate = {{'collate': unsendable}} if argv[0] == 'lost' else {{}}
    batches = Batches(Samples(), torch.device('cpu'), batch_size=2, shuffle=False, seed=0, workers=1, **collate)
    print('reading', flush=True)
    for batch in batches.epoch(0):
        pass


run_to_exit(main)
"""


def test_a_batch_a_worker_cannot_hand_over_ends_the_run_in_one_line(tmp_path):
    """A worker whose batch could not be sent (shared memory full, or a file-size limit: its queue's
    thread fails) printed a traceback and went on; the main process waited for the batch forever."""
    script = tmp_path / 'lost.py'
    script.write_text(WORKER_TROUBLE.format(repo=REPO))
    result = run_script(str(script), 'lost', timeout_seconds=120)
    assert result.returncode == 2 and 'Traceback' not in result.stderr, result.stderr
    why, what = result.stderr.strip().splitlines()  # the worker's reason, then the main process's line
    assert why.startswith('error: a DataLoader worker could not hand over its batch: cannot pickle')
    assert what.startswith('error: DataLoader worker (pid(s) ') and '--num_workers 0' in what


def test_sigterm_ends_a_process_whose_worker_is_stuck(tmp_path):
    """Workers ignore stop signals (the main process finishes its step and saves first), so at exit
    multiprocessing's SIGTERM to a worker stuck in a sample did nothing and the process waited for it
    forever: `kill` could not end predict.py."""
    script = tmp_path / 'stuck.py'
    script.write_text(WORKER_TROUBLE.format(repo=REPO))
    process = subprocess.Popen(
        [sys.executable, str(script), 'stuck'], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout.readline() == 'reading\n'
    time.sleep(1)  # the worker is in its sample now (or about to be: either way it must end)
    process.send_signal(signal.SIGTERM)
    try:
        _, stderr = process.communicate(timeout=timeout(60))
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError('the process did not end after SIGTERM') from None
    assert process.returncode == 128 + signal.SIGTERM and stderr.strip() == 'terminated (SIGTERM)', stderr


def test_a_stop_signal_while_training_waits_for_a_stuck_worker_saves_the_last_step_and_ends(tiny_shapes, tmp_path):
    """The first SIGTERM only asks the loop to stop after its step, and the step waited for a batch that a
    worker stuck in a read (a hung network disk: here, a stopped process) never sent: the run never saved
    and never ended, until a SLURM pre-emption killed it outright."""
    with open(os.path.join(tiny_shapes, 'train.txt')) as f:
        lines = [os.path.join(tiny_shapes, line) for line in f.read().splitlines()]
    (tmp_path / 'long.txt').write_text('\n'.join(lines * 40) + '\n')  # an epoch long enough to stop in
    command = [
        sys.executable, 'train.py', '--data_type', 'list', '--train_list', tmp_path / 'long.txt', '--val_list',
        os.path.join(tiny_shapes, 'val.txt'), '--model_type', 'linear', '--batch_size', '4', '--num_workers', '1',
        '--print_freq', '5', '--no-progress_bar', '--cpu', '--checkpoints_dir', tmp_path / 'ck',
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while 'step 5/' not in process.stdout.readline():
            assert process.poll() is None, process.communicate()
        with open(f'/proc/{process.pid}/task/{process.pid}/children') as f:
            workers = [int(pid) for pid in f.read().split()]
        for worker in workers:
            os.kill(worker, signal.SIGSTOP)  # stuck: it hands over nothing more, and never ends by itself
        time.sleep(2)  # the loop has taken the batches already handed over, and waits
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=timeout(60))
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    last = os.path.join(tmp_path, 'ck', 'linear_list_default', 'last.pth')
    step = torch.load(last, weights_only=True, map_location='cpu')['position']['step']
    assert 'stopped by SIGTERM after' in stdout and f'at step {step} ' in stdout and step >= 5, stdout
    assert not any(os.path.exists(f'/proc/{worker}') for worker in workers)


STOP_IN_AN_UPDATE = """
import os, signal, sys, threading, time
sys.argv[0] = 'train.py'
import train
from data.list_dataset import ListDataset
from utils.errors import run_to_exit

released, reads, read = sys.argv.pop(1), {}, ListDataset.read

def held_read(self, *args, **kwargs):  # the worker's 49th read, batch 3's first sample, waits for the file
    reads[os.getpid()] = reads.get(os.getpid(), 0) + 1
    while reads[os.getpid()] == 49 and not os.path.exists(released):
        time.sleep(0.05)
    return read(self, *args, **kwargs)

step = train.Trainer.train_step

def signalled_step(self, *args, **kwargs):  # after batch 2 (an update's first), while batch 3 is held back
    trained = step(self, *args, **kwargs)
    if self.position.batch == 3:
        def signal_then_release():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
            open(released, 'w').close()
        threading.Timer(0.3, signal_then_release).start()
    return trained

ListDataset.read, train.Trainer.train_step = held_read, signalled_step
run_to_exit(train.main)
"""


def test_a_stop_while_waiting_in_the_middle_of_an_accumulated_update_saves_after_it(tiny_shapes, tmp_path):
    """A stop signal that came while the loop waited for the second batch of a --grad_accum_steps update
    saved the run in the middle of it: half its gradient lost (and batch norm statistics moved on), and
    the resumed run ended with other weights than an uninterrupted one. The wait now goes on, and the
    stop comes after the update."""
    from conftest import tiny_run_args

    def args(name):
        return tiny_run_args(tiny_shapes, tmp_path / name) + ['--num_workers', '1', '--grad_accum_steps', '2']

    assert run_script('train.py', *args('whole'), '--epochs', '1').returncode == 0
    released = tmp_path / 'released'
    stopped = subprocess.run(
        [sys.executable, '-c', STOP_IN_AN_UPDATE, str(released), *args('stopped'), '--epochs', '1'],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(120),
    )
    assert stopped.returncode == 128 + signal.SIGTERM and released.exists(), stopped.stderr
    folder = tmp_path / 'stopped' / 'small_cnn_list_default'
    last = torch.load(folder / 'last.pth', weights_only=True, map_location='cpu')
    assert last['position']['batch'] % 2 == 0 and last['position']['step'] == 2, last['position']
    assert run_script('train.py', *args('stopped'), '--epochs', '1', '--resume').returncode == 0
    whole = torch.load(
        tmp_path / 'whole' / 'small_cnn_list_default' / 'last.pth', weights_only=True, map_location='cpu'
    )
    resumed = torch.load(folder / 'last.pth', weights_only=True, map_location='cpu')
    for name, tensor in whole['model'].items():
        assert torch.equal(tensor, resumed['model'][name]), name
