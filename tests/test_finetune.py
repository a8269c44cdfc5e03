"""Fine-tuning: partial loading with a saved report, safe loading (.pth and .safetensors), layer
freezing and gradual unfreezing through resume, discriminative learning rates, pretrained nets."""

import glob
import json
import os
import pickle
from argparse import Namespace

import pytest
import torch
from safetensors.torch import save_file

from conftest import run_script, tiny_run_args, tiny_seg_args
from model.model_entry import select_model
from utils.checkpoint import load_checkpoint, load_match_dict
from utils.errors import KilnError
from utils.finetune import ModelFreezer


def _model(name='small_cnn', classes=6, **extra):
    return select_model(Namespace(model_type=name, num_classes=classes, img_size=32, **extra))


def _three_class_lists(shapes_dir, folder):
    """A 3-class task made of the tiny shapes' first three classes, with its own classes.txt."""
    folder.mkdir()
    for split in ('train', 'val'):
        with open(os.path.join(shapes_dir, f'{split}.txt')) as source:
            lines = [line.split() for line in source if line.strip()]
        (folder / f'{split}.txt').write_text(
            ''.join(f'{os.path.join(shapes_dir, path)} {label}\n' for path, label in lines if int(label) < 3)
        )
    names = open(os.path.join(shapes_dir, 'classes.txt')).read().split()[:3]
    (folder / 'classes.txt').write_text('\n'.join(names) + '\n')
    return folder


def _run(args, *extra):
    result = run_script('train.py', *args, *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _state(folder, name):
    return torch.load(os.path.join(folder, name), weights_only=True, map_location='cpu')


def _checkpoint_after(folder, epoch):
    (name,) = [n for n in os.listdir(folder) if n.startswith(f'epoch{epoch:03d}_')]
    return _state(folder, name)


@pytest.fixture(scope='module')
def finetuned(tiny_shapes, tmp_path_factory):
    """A 6-class run, then a 3-class fine-tune of it: new head, backbone frozen in epoch 1,
    unfrozen from epoch 2 on. Returns (base folder, fine-tune args, fine-tune folder, options)."""
    root = tmp_path_factory.mktemp('finetune')
    base = tiny_run_args(tiny_shapes, root / 'ck')
    _run(base, '--epochs', '1', '--save_prefix', 'base')
    base_folder = str(root / 'ck' / 'small_cnn_list_base')
    three = _three_class_lists(tiny_shapes, root / 'three')
    options = [
        '--train_list',
        str(three / 'train.txt'),
        '--val_list',
        str(three / 'val.txt'),
        '--epochs',
        '3',
        '--load_model_path',
        os.path.join(base_folder, 'last.pth'),
        '--load_not_strict',
        '--freeze_to',
        '-2',
        '--unfreeze_at_epoch',
        '2',
        '--head_lr',
        '1e-2',
        '--backbone_lr',
        '1e-3',
        '--unfrozen_lr_scale',
        '0.5',
        '--keep_last',
        '5',
        '--deterministic',
        '--save_prefix',
        'ft',
    ]
    tune = tiny_run_args(tiny_shapes, root / 'ck')
    _run(tune, *options)
    return base_folder, tune, str(root / 'ck' / 'small_cnn_list_ft'), options


def test_the_report_shows_exactly_the_head_as_skipped(finetuned):
    _, _, folder, _ = finetuned
    with open(os.path.join(folder, 'load_report.json')) as f:
        report = json.load(f)
    assert [item['name'] for item in report['shape_mismatched']] == ['head.weight', 'head.bias']
    assert report['shape_mismatched'][0]['in_file'] == [6, 64] and report['shape_mismatched'][0]['in_model'] == [3, 64]
    assert report['missing'] == [] and report['unexpected'] == [] and len(report['loaded']) > 10


def test_frozen_layers_stay_bit_identical_until_unfrozen(finetuned):
    base_folder, _, folder, _ = finetuned
    base = _state(base_folder, 'last.pth')['model']
    after_1, after_3 = _checkpoint_after(folder, 1)['model'], _checkpoint_after(folder, 3)['model']
    convs = [name for name in base if name.endswith('.0.weight') and base[name].dim() == 4]  # ConvBNReLU's conv
    assert convs and all(torch.equal(after_1[name], base[name]) for name in convs)  # frozen in epoch 1
    assert not torch.equal(after_1['head.bias'], torch.zeros(3))  # the head trained
    assert all(not torch.equal(after_3[name], base[name]) for name in convs)  # unfrozen from epoch 2
    # normalization layers stay trainable unless --freeze_batch_norms
    assert not torch.equal(after_1['features.0.1.weight'], base['features.0.1.weight'])


def test_unfrozen_layers_train_at_their_own_rate_and_resume_exactly(finetuned):
    _, tune, folder, options = finetuned
    after_1, after_3 = _checkpoint_after(folder, 1), _checkpoint_after(folder, 3)
    # trainable backbone layers (BatchNorm) at --backbone_lr, frozen ones at --unfrozen_lr_scale x that,
    # the head at --head_lr: the same groups from the start, so the optimizer and schedule never change shape
    for state in (after_1, after_3):
        assert [g['initial_lr'] for g in state['optimizer']['param_groups']] == pytest.approx([1e-3, 5e-4, 1e-2])
    # the rate the run logs and prints is the head's (it was the first group's: a frozen group's, say)
    with open(os.path.join(folder, 'history.json')) as f:
        logged = json.load(f)['metrics']['train/lr']
    head, first = (after_1['optimizer']['param_groups'][index]['lr'] for index in (-1, 0))  # the next step's rates
    assert logged[0] == after_1['position']['lr'] and abs(logged[0] - head) < abs(logged[0] - first) / 5
    frozen = set(after_1['optimizer']['param_groups'][1]['params'])
    assert frozen and not frozen & set(after_1['optimizer']['state'])  # no updates while frozen
    assert frozen <= set(after_3['optimizer']['state'])  # trained once unfrozen

    # continue a copy of the run from the end of epoch 2 (unfrozen): it must end where the run ended
    at = tune.index('--checkpoints_dir')
    resumed = tune[:at] + tune[at + 2 :]  # the resumed file's folder is the run's
    copy = folder + '_copy'
    os.makedirs(copy)
    os.link(os.path.join(folder, 'args.yaml'), os.path.join(copy, 'args.yaml'))
    epoch_2 = [n for n in os.listdir(folder) if n.startswith('epoch002_')][0]
    os.link(os.path.join(folder, epoch_2), os.path.join(copy, epoch_2))
    result = _run(resumed, *options, '--resume', os.path.join(copy, epoch_2))
    assert 'resuming' in result.stdout
    final = _state(copy, 'last.pth')
    assert final['position'] == after_3['position']
    for name, tensor in after_3['model'].items():
        assert torch.equal(tensor, final['model'][name]), name


def test_freezer_groups_layers_and_indices():
    model = _model()
    freezer = ModelFreezer(model)
    assert [type(g).__name__ for g in freezer.get_layer_groups()] == ['Sequential', 'AdaptiveAvgPool2d', 'Linear']
    freezer.freeze(0, -2)
    trainable = {id(p) for p in freezer.get_trainable_parameters()}
    assert {id(p) for p in model.head.parameters()} <= trainable
    assert id(model.features[0][0].weight) not in trainable
    assert id(model.features[0][1].weight) in trainable  # BatchNorm stays trainable by default
    groups = freezer.unfreeze(-1, 0)
    assert len(groups) == 1 and all(p.requires_grad for p in model.parameters())  # features, the only frozen group
    with pytest.raises(IndexError, match='3 groups'):
        freezer.freeze(0, 5)


@pytest.mark.parametrize('freeze_batch_norms, set_eval', [(True, True), (True, False), (False, True)])
def test_freezer_batch_norm_flags(freeze_batch_norms, set_eval):
    model = _model()
    freezer = ModelFreezer(model, freeze_batch_norms=freeze_batch_norms)
    model.train()
    freezer.freeze(0, 0, set_modules_as_eval=set_eval)
    bn = model.features[0][1]
    stats = bn.running_mean.clone()
    assert bn.weight.requires_grad == (not freeze_batch_norms)
    assert bn.training == (not (freeze_batch_norms and set_eval))  # a trainable BatchNorm is left alone
    model(torch.randn(8, 3, 32, 32))
    assert torch.equal(bn.running_mean, stats) == (freeze_batch_norms and set_eval)
    model.train()  # what the Trainer does every epoch ...
    freezer.keep_eval_modes()  # ... and then this
    assert bn.training == (not (freeze_batch_norms and set_eval))
    freezer.unfreeze(0, 0, set_modules_as_training=False)
    assert bn.weight.requires_grad and bn.training == (not (freeze_batch_norms and set_eval))
    freezer.unfreeze(0, 0, set_modules_as_training=True)
    assert bn.training


def test_frozen_batch_norm_statistics_survive_training(tiny_shapes, tmp_path):
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck')
    _run(args, '--epochs', '1', '--freeze_to', '-2', '--freeze_batch_norms', '--save_prefix', 'bn')
    torch.manual_seed(0)  # --seed 0: the same initial weights as the run's
    start = _model().state_dict()
    trained = _state(str(tmp_path / 'ck' / 'small_cnn_list_bn'), 'last.pth')['model']
    frozen = [n for n in start if n.startswith('features.') and 'num_batches_tracked' not in n]
    assert frozen and all(torch.equal(start[n], trained[n]) for n in frozen)  # weights and running stats
    assert not torch.equal(start['head.weight'], trained['head.weight'])


def test_a_file_that_fits_only_in_a_batchnorm_counter_is_refused():
    """A net of another shape whose first BatchNorm sits where the model's does shared nothing but that
    BatchNorm's num_batches_tracked, a scalar: "loaded 1 tensors", and the run trained from its init."""
    model = _model()
    own = model.state_dict()
    counter = next(name for name in own if name.endswith('num_batches_tracked'))
    other = {counter: torch.tensor(5), 'features.9.weight': torch.ones(3)}
    with pytest.raises(KilnError, match='no tensor of other.pth fits this model'):
        load_match_dict(model, other, source='other.pth')
    assert torch.equal(model.state_dict()[counter], own[counter])


def test_weights_of_the_net_for_another_image_size_are_said_to_be_so():
    """A ViT's own ImageNet weights at another --img_size (only pos_embed differs) were told to be
    another net's, with advice to fetch the very file given."""
    from utils.checkpoint import load_weights

    class Net(torch.nn.Module):
        def __init__(self, positions):
            super().__init__()
            self.pos_embed = torch.nn.Parameter(torch.zeros(1, positions, 4))
            self.head = torch.nn.Linear(4, 2)

    with pytest.raises(KilnError, match=r'pos_embed is \(1, 197, 4\) in the file.*for another image size'):
        load_weights(Net(17), Net(197).state_dict(), source='vit.pth', advice='not its weights')
    other = {**Net(197).state_dict(), 'head.weight': torch.zeros(3, 4)}  # another difference too: another net
    with pytest.raises(KilnError, match='not its weights$'):
        load_weights(Net(17), other, source='vit.pth', advice='not its weights')


def test_prefix_map_and_file_formats(tmp_path):
    source = _model()
    wrapped = {f'net.{name}': tensor for name, tensor in source.state_dict().items()}
    torch.save({'state_dict': wrapped}, tmp_path / 'wrapped.pth')
    save_file({k: v.contiguous() for k, v in wrapped.items()}, str(tmp_path / 'wrapped.safetensors'))
    for file in ('wrapped.pth', 'wrapped.safetensors'):
        target = _model()
        with pytest.raises(KilnError, match=f'no tensor of {tmp_path / file} fits this model'):  # every name differs
            load_match_dict(target, str(tmp_path / file))
        with pytest.raises(KilnError, match="no tensor name in the checkpoint starts with 'nett.'"):  # a typo
            load_match_dict(target, str(tmp_path / file), prefix_map={'nett.': ''})
        report = load_match_dict(target, str(tmp_path / file), prefix_map={'net.': ''})
        assert report.missing == [] and report.unexpected == [] and report.shape_mismatched == []
        # a rule for a wrapper prefix Kiln strips anyway (module. of DDP) renames something: no refusal
        ddp = {f'module.{name}': tensor for name, tensor in source.state_dict().items()}
        assert load_match_dict(_model(), ddp, prefix_map={'module.': ''}).missing == []
        assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_the_longest_prefix_that_starts_a_name_renames_it_whatever_the_order():
    """--load_prefix_map net.= net.fc.=head.: net.fc.weight became fc.weight, the first rule given
    winning over the one that names it more closely."""
    from utils.checkpoint import state_dict_of

    weights = {'net.fc.weight': torch.ones(1), 'net.conv.weight': torch.zeros(1), 'other': torch.ones(2)}
    for rules in ({'net.': '', 'net.fc.': 'head.'}, {'net.fc.': 'head.', 'net.': ''}):
        assert set(state_dict_of(weights, rules)) == {'head.weight', 'conv.weight', 'other'}, rules


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / 'ran'

    class Payload:
        def __reduce__(self):
            return os.system, (f'touch {marker}',)

    path = tmp_path / 'evil.pth'
    path.write_bytes(pickle.dumps({'model': Payload()}))
    with pytest.raises(KilnError, match='safe loading does not allow'):
        load_checkpoint(str(path))
    assert not marker.exists()
    (tmp_path / 'bad.safetensors').write_bytes(b'\x00' * 20)
    with pytest.raises(KilnError, match='not a readable safetensors file'):
        load_checkpoint(str(tmp_path / 'bad.safetensors'))


@pytest.mark.parametrize('name', ['tv_resnet18', 'tv_mobilenet_v3_small', 'tv_efficientnet_b0'])
def test_pretrained_nets_load_local_weights_and_get_a_new_head(tmp_path, name):
    from model.torchvision_nets import TORCHVISION_NETS

    imagenet = TORCHVISION_NETS[name][0](weights=None)  # stands in for a downloaded weights file
    path = tmp_path / f'{name}.safetensors'
    save_file({k: v.contiguous() for k, v in imagenet.state_dict().items()}, str(path))
    model = _model(name, classes=6, pretrained_path=str(path))
    own, reference = model.state_dict(), imagenet.state_dict()
    differing = [n for n in reference if own[n].shape != reference[n].shape or not torch.equal(own[n], reference[n])]
    assert len(differing) == 2 and all(n.endswith(('weight', 'bias')) for n in differing)  # only the head
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 6)


def test_missing_pretrained_weights_say_how_to_get_them(tiny_shapes, tmp_path):
    missing = tmp_path / 'resnet18.pth'
    result = run_script(
        'train.py',
        *tiny_run_args(tiny_shapes, tmp_path / 'ck'),
        '--model_type',
        'tv_resnet18',
        '--pretrained_path',
        str(missing),
    )
    assert result.returncode == 2 and 'Traceback' not in result.stderr
    assert str(missing) in result.stderr and 'never downloads' in result.stderr and "weights='DEFAULT'" in result.stderr


def test_a_resume_needs_no_pretrained_file_and_a_file_of_another_net_says_so(tiny_shapes, tmp_path):
    """--resume rebuilt the model from --pretrained_path before loading the checkpoint over it, so a run
    whose ImageNet file had moved could not go on (and the option may not change on resume); a file of
    another net advised --load_not_strict, which does nothing for --pretrained_path."""
    import torchvision

    weights = tmp_path / 'resnet18.pth'
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), weights)
    args = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--model_type', 'tv_resnet18', '--img_size', '32']
    assert run_script('train.py', *args, '--epochs', '1', '--pretrained_path', weights).returncode == 0
    weights.rename(tmp_path / 'moved.pth')
    folder = tmp_path / 'ck' / 'tv_resnet18_list_default'
    resumed = run_script('train.py', '--resume', folder, '--epochs', '2')
    assert resumed.returncode == 0 and 'step 12' in resumed.stdout, resumed.stdout + resumed.stderr
    assert 'random weights' not in resumed.stdout  # its own

    other = run_script('train.py', *args, '--model_type', 'tv_resnet34', '--pretrained_path', tmp_path / 'moved.pth')
    error = other.stderr.strip()
    assert other.returncode == 2 and error.startswith(f'error: --pretrained_path {tmp_path / "moved.pth"} does not fit')
    assert "not tv_resnet34's weights" in error and '--load_not_strict' not in error, error


def test_fine_tuning_a_checkpoint_of_another_task_says_which_options_to_give(tiny_shapes, tmp_path):
    """A segmentation checkpoint given to a run left at --task classify failed on the segmentation list:
    'expected "image_path label" with a label >= 0, got label masks/...'."""
    segment = [*tiny_seg_args(tiny_shapes, tmp_path / 'ck'), '--task', 'segment', '--epochs', '1']
    assert run_script('train.py', *segment).returncode == 0
    folder = tmp_path / 'ck' / 'seg_net_seg_list_default'
    seg_lists = tiny_seg_args(tiny_shapes, tmp_path / 'ck')
    result = run_script('train.py', *seg_lists, '--load_model_path', folder, '--save_prefix', 'tuned')
    error = result.stderr.strip()
    assert result.returncode == 2 and error.startswith(f'error: {folder / "best.pth"} was trained for --task segment')
    assert 'give --task segment --model_type seg_net' in error and '\n' not in error, error
    tuned = run_script('train.py', *segment, '--load_model_path', folder, '--save_prefix', 'tuned')
    assert tuned.returncode == 0, tuned.stderr


@pytest.mark.parametrize(
    'given', [['--freeze_batch_norms'], ['--unfreeze_at_epoch', '2'], ['--unfrozen_lr_scale', '0.5']]
)
def test_freezing_options_without_freeze_to_change_nothing(given):
    """Nothing is frozen without --freeze_to: every parameter trains, nothing unfreezes later, and train.py
    says that the option is ignored (a note: a config or a sweep may set it for runs it does not act in)."""
    from options import ignored_options, parse_args, parse_train_args
    from utils.finetune import FineTuning

    name = given[0].removeprefix('--')
    options = {name: True if len(given) == 1 else float(given[1]) if '.' in given[1] else int(given[1])}
    model = _model()
    tuning = FineTuning(model, **options)
    assert all(p.requires_grad for p in model.parameters()) and not tuning.frozen
    assert not any(tuning.unfreezes_at(epoch, 0) for epoch in range(5))
    notes = ignored_options(parse_args(parse_train_args, given), given)
    assert notes == [f'{given[0]} acts with --freeze_to only: this run ignores it'], notes


def test_unfreezing_after_the_last_epoch_without_freeze_to_trains_with_a_note(tiny_args):
    """A config or sweep may set --unfreeze_at_epoch for runs without --freeze_to: it was refused as coming
    after the last epoch, blaming layers --freeze_to would have frozen (none are)."""
    result = run_script('train.py', *tiny_args, '--unfreeze_at_epoch', '5', '--save_prefix', 'late')
    assert result.returncode == 0, result.stderr
    assert 'note: --unfreeze_at_epoch acts with --freeze_to only: this run ignores it' in result.stdout


def test_freezing_every_parameter_is_one_line(tiny_shapes, tmp_path):
    """--freeze_to -1 --freeze_batch_norms froze everything: a traceback from the first backward
    ('element 0 of tensors does not require grad'). Without --freeze_batch_norms the norms still train."""
    from utils.finetune import FineTuning

    args = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--freeze_to', '-1', '--freeze_batch_norms']
    result = run_script('train.py', *args)
    error = result.stderr.strip()
    assert result.returncode == 2, error
    assert error.startswith('error: --freeze_to -1 --freeze_batch_norms leaves nothing to train'), error
    assert error.endswith('freeze fewer, e.g. --freeze_to -2 trains the groups after it'), error
    assert not (tmp_path / 'ck').exists() or not os.listdir(tmp_path / 'ck')
    FineTuning(_model(), freeze_to=-1)  # BatchNorm layers left to train: fine


@pytest.mark.parametrize('schedule', [['--epochs', '2'], ['--max_iteration', '7']])  # 6 steps per epoch
def test_unfreezing_after_the_last_epoch_is_one_line(tiny_shapes, tmp_path, schedule):
    """--unfreeze_at_epoch past the run's last epoch was accepted: the frozen layers never trained."""
    args = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), *schedule, '--freeze_to', '-2', '--unfreeze_at_epoch', '3']
    result = run_script('train.py', *args)
    error = result.stderr.strip()
    last = 2  # --max_iteration 7 ends one step into epoch 2
    assert result.returncode == 2, error
    assert error.startswith(f'error: --unfreeze_at_epoch 3 comes after the last epoch of this run ({last})'), error
    assert '\n' not in error and (not (tmp_path / 'ck').exists() or not os.listdir(tmp_path / 'ck'))
    args[args.index('--unfreeze_at_epoch') + 1] = '2'  # the start of the last epoch: fine
    assert run_script('train.py', *args).returncode == 0
    # resumed shorter: refused, with advice a resumed run can take (it keeps --unfreeze_at_epoch), while the
    # unfreezing is ahead; it said "would never train" of layers already trained, asking for an epoch up to 1
    (folder,) = glob.glob(str(tmp_path / 'ck' / '*'))
    first_epoch = sorted(glob.glob(os.path.join(folder, 'epoch001_*.pth')))[0]  # step 6
    shorter = ['--max_iteration', '5'] if '--max_iteration' in schedule else ['--epochs', '1']
    files = sorted(os.listdir(folder))
    refused = run_script('train.py', '--resume', first_epoch, *shorter)
    assert sorted(os.listdir(folder)) == files  # nothing set aside (it was, before the refusal)
    longer = '--max_iteration above 6' if '--max_iteration' in schedule else '--epochs 2 or more'
    assert refused.returncode == 2 and refused.stderr.strip().endswith(f'would never train; give {longer}'), (
        refused.stderr
    )
    assert run_script('train.py', '--resume', folder, *shorter).returncode == 0  # unfrozen when saved


def test_pretrained_path_mistakes_are_one_line_each(tiny_shapes, tmp_path):
    """A model that never reads --pretrained_path trained from scratch without a word (even with a missing
    file); a folder was 'does not exist'; a Kiln checkpoint was 'not tv_resnet18's weights: download ImageNet's'."""
    args = [*tiny_run_args(tiny_shapes, tmp_path / 'ck'), '--epochs', '1', '--img_size', '32']

    def error_of(*extra):
        result = run_script('train.py', *args, *extra)
        assert result.returncode == 2 and result.stderr.count('\n') == 1, result.stderr
        return result.stderr.strip()

    for model in ('small_cnn', 'resnet18'):
        error = error_of('--model_type', model, '--pretrained_path', tmp_path / 'missing.pth')
        assert error.startswith(f'error: --model_type {model} does not read --pretrained_path'), error
    error = error_of('--model_type', 'tv_resnet18', '--pretrained_path', tmp_path)
    assert (
        error == f'error: --pretrained_path {tmp_path} is a folder; give the weights file in it (.pth or .safetensors)'
    )
    scratch = run_script('train.py', *args, '--model_type', 'tv_resnet18', '--save_prefix', 'kiln')
    assert scratch.returncode == 0 and 'note: --model_type tv_resnet18 starts from random weights' in scratch.stdout
    kiln = tmp_path / 'ck' / 'tv_resnet18_list_kiln' / 'last.pth'
    error = error_of('--model_type', 'tv_resnet18', '--pretrained_path', kiln)
    assert error.startswith(f'error: --pretrained_path {kiln} is a Kiln checkpoint, not ImageNet weights'), error
    assert f'--load_model_path {kiln}' in error
    assert sorted(os.listdir(tmp_path / 'ck')) == ['tv_resnet18_list_kiln']  # the refused runs left nothing


def test_fast_dev_run_takes_a_later_unfreezing(tiny_shapes, tmp_path):
    """Its 2 steps are not the run's epochs: --unfreeze_at_epoch 3 of a 5-epoch run was refused. It now
    trains them as the run would start: with the layers before --freeze_to frozen."""
    from utils.finetune import FineTuning

    args = [
        *tiny_run_args(tiny_shapes, tmp_path / 'ck'),
        '--epochs',
        '5',
        '--freeze_to',
        '-2',
        '--unfreeze_at_epoch',
        '3',
    ]
    result = run_script('train.py', *args, '--fast_dev_run')
    assert result.returncode == 0, result.stderr
    assert 'fast_dev_run: trained, saved, evaluated and predicted in' in result.stdout, result.stdout
    (folder,) = (tmp_path / 'ck' / 'fast_dev_run').iterdir()
    saved = _state(str(folder), 'last.pth')
    assert saved['position']['step'] == 2  # its 2 steps, in epoch 1: before the unfreezing, frozen as asked
    assert (saved['args']['epochs'], saved['args']['freeze_to'], saved['args']['unfreeze_at_epoch']) == (5, -2, 3)
    torch.manual_seed(0)  # --seed 0: the same initial weights as the run's
    model = _model()
    start = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    frozen = FineTuning(model, freeze_to=-2).frozen  # the ids of the parameters --freeze_to -2 freezes
    frozen = [name for name, p in model.named_parameters() if id(p) in frozen]
    assert frozen and all(torch.equal(start[name], saved['model'][name]) for name in frozen)
    assert not torch.equal(start['head.weight'], saved['model']['head.weight'])  # the head trained


class TokenNet(torch.nn.Module):
    """A ViT's layout in small: parameters of the model itself (a class token, position embeddings), and
    two heads that timm's get_classifier() names (a distilled ViT's head and head_dist, the latter last)."""

    def __init__(self):
        super().__init__()
        self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, 4))
        self.embed = torch.nn.Linear(3, 4)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.head = torch.nn.Linear(4, 2)
        self.head_dist = torch.nn.Linear(4, 2)

    def get_classifier(self):
        return self.head, self.head_dist


def test_the_models_own_parameters_freeze_with_group_0_and_every_named_head_is_the_last_group():
    """--freeze_to -2 left a ViT's cls_token and pos_embed training, and on a distilled ViT froze its new
    class head (`head`), training only `head_dist` (its last child), which alone got --head_lr."""
    from utils.finetune import FineTuning

    model = TokenNet()
    tuning = FineTuning(model, freeze_to=-2, freeze_batch_norms=True)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {'head.weight', 'head.bias', 'head_dist.weight', 'head_dist.bias'}
    groups = tuning.param_groups(1e-3, head_lr=1e-2)
    assert [group['lr'] for group in groups] == [1e-3, 1e-2]
    assert {id(p) for p in groups[-1]['params']} == {
        id(p) for p in [*model.head.parameters(), *model.head_dist.parameters()]
    }
    tuning.unfreeze()
    assert all(p.requires_grad for p in model.parameters())
    assert model.blocks[1].training  # frozen in eval mode, trained again


def test_a_distilled_timm_vit_trains_its_class_heads_and_freezes_its_tokens():
    timm = pytest.importorskip('timm', reason='the timm extra is not installed')
    from utils.finetune import FineTuning

    model = timm.create_model('deit_tiny_distilled_patch16_224', pretrained=False, img_size=32, num_classes=3)
    FineTuning(model, freeze_to=-2, freeze_batch_norms=True)
    trainable = {name.split('.')[0] for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {'head', 'head_dist'}


def test_freezing_a_model_of_one_group_says_to_leave_freeze_to_out():
    """The advice was '--freeze_to -2 trains the head', which the one-group model refuses in turn."""
    from utils.finetune import FineTuning

    with pytest.raises(KilnError, match=r'all 1 layer groups frozen\); leave --freeze_to out'):
        FineTuning(_model('linear'), freeze_to=0)


@pytest.mark.parametrize('strict', [True, False])
def test_weights_of_another_model_type_name_it(strict):
    """A small_cnn checkpoint loaded into resnet18 advised --load_not_strict, which then failed too;
    neither message named the checkpoint's model."""
    from utils.checkpoint import load_weights

    checkpoint = {'model': _model('small_cnn').state_dict(), 'args': {'model_type': 'small_cnn'}}
    expected = 'it is a --model_type small_cnn checkpoint and this run builds linear: give --model_type small_cnn'
    expected += ', or pass --load_not_strict to load only the tensors that match$' if strict else '$'
    with pytest.raises(KilnError, match=expected):
        load_weights(_model('linear', classes=5), checkpoint, strict=strict, model_type='linear')
