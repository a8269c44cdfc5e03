"""The README tells the truth: its first screen gives exactly the two commands, its "Start a new task"
steps work word for word on a fresh copy of Kiln, and every train/eval/predict command it shows is
accepted by that script's options."""

import os
import re
import shlex
import subprocess

import pytest

from conftest import REPO, copy_of_the_project, timeout

README = open(os.path.join(REPO, 'README.md'), encoding='utf-8').read()
FENCED = re.compile(r'^```(\w+)\n(.*?)^```', re.M | re.S)


def _section(title):
    start = README.index(f'\n## {title}\n')
    end = README.find('\n## ', start + 1)
    return README[start : end if end > 0 else None]


def test_the_first_screen_says_what_kiln_is_and_gives_two_commands():
    first_screen = README[: README.index('\n---\n')]
    commands = [line.strip() for line in first_screen.splitlines() if line.startswith('    ')]
    assert commands == [
        'python3 -m pip install -r requirements.txt && bash scripts/quickstart.sh',
        'python3 -m pip install -r requirements-dev.txt && python3 -m pytest tests',
    ]
    name = README.splitlines()[0].removeprefix('# ')  # Kiln, or a project made from it (scripts/new_task.py)
    intro = re.search(r'<!-- intro -->(.*?)<!-- /intro -->', first_screen, re.S).group(1)
    assert intro.strip().startswith(f'{name} ') and 'PyTorch' in intro, intro  # what it is, first
    with open(os.path.join(REPO, '.ci', 'run')) as f:
        assert commands[1] in f.read()  # CI runs the README's test command


def _apply(block, copy):
    """Carry out one python block of the README's steps in `copy`: a new file, or lines for a registry."""
    first, _, body = block.partition('\n')
    created = re.fullmatch(r'# file: (\S+)', first)
    if created:
        path = copy / created.group(1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
        return
    registry = re.fullmatch(r'# add to (\w+) in (\S+)', first)
    assert registry, f'a README python block says neither "# file:" nor "# add to": {first!r}'
    name, path = registry.groups()
    text = (copy / path).read_text()
    end = text.index('\n}', text.index(f'{name} = {{'))
    (copy / path).write_text(text[:end] + '\n' + body.rstrip('\n') + text[end:])


@pytest.mark.slow
def test_the_start_a_new_task_steps_work_word_for_word(tmp_path):
    copy_of_the_project(tmp_path)
    blocks = FENCED.findall(_section('Start a new task'))
    assert [kind for kind, _ in blocks].count('bash') >= 2 and [kind for kind, _ in blocks].count('python') >= 4
    for kind, block in blocks:
        if kind == 'python':
            _apply(block, tmp_path)
            continue
        for command in filter(None, block.splitlines()):
            result = subprocess.run(
                ['bash', '-c', command], cwd=tmp_path, capture_output=True, text=True, timeout=timeout()
            )
            assert result.returncode == 0, f'{command}\n{result.stdout}\n{result.stderr}'
    result_txt = tmp_path / 'checkpoints' / 'my_net_my_dataset_first' / 'eval' / 'best_val_default' / 'result.txt'
    assert 'acc: ' in result_txt.read_text()
    typo = subprocess.run(
        ['python3', 'train.py', '--data_type', 'my_dataset', '--model_type', 'my_nett'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout(),
    )
    assert typo.returncode == 2 and 'my_net' in typo.stderr and len(typo.stderr.strip().splitlines()) == 1


def _readme_commands():
    """Every `python[3] train.py|eval.py|predict.py ...` command in the README (continuation lines joined),
    but those of "Start a new task", which name the user's own files (the test above runs them)."""
    text = README.replace(_section('Start a new task'), '').replace('\\\n', ' ')
    for line in text.splitlines():
        match = re.search(r'python3? (?:-m utils\.torchrun .*?)?(train|eval|predict)\.py( .*)?$', line)
        if match:
            yield match.group(1), shlex.split((match.group(2) or '').split('`')[0].split('  #')[0])


def test_every_readme_command_is_accepted_by_its_script():
    from options import parse_args, parse_predict_args, parse_test_args, parse_train_args

    parsers = {'train': parse_train_args, 'eval': parse_test_args, 'predict': parse_predict_args}
    commands = list(_readme_commands())
    assert len(commands) > 10
    for script, argv in commands:
        if '--config' not in argv and '--help' not in argv:  # a config file names a folder made by a run
            parse_args(parsers[script], argv)


def test_the_options_a_resume_may_change_are_the_ones_the_readme_lists():
    """The list in "Long runs" had fallen behind options.RESUME_CHANGEABLE (--mlflow_uri, --wandb_project)."""
    from options import RESUME_CHANGEABLE

    start = README.index('- A resume may change only')
    listed = README[start : README.index('Anything else', start)]
    named = set(re.findall(r'`--(\w+?)(?:_\*)?`', listed))
    missing = [name for name in RESUME_CHANGEABLE if name not in named and not any(name.startswith(n) for n in named)]
    assert not missing, f'README "Long runs" does not name {missing}'
