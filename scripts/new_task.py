"""Start a new project from this template: `python scripts/new_task.py DEST [--name NAME]
[--dataset NAME] [--model NAME]`.

Copies the template's own files (what git tracks, or without git everything but experiment
outputs, generated data and caches) into the new, empty folder DEST, puts the project name where
"Kiln" stood, and with --dataset / --model writes a commented stub dataset file and model
package and registers them in data/data_entry.py and model/model_entry.py. The new project runs
and passes its tests as it is.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

TEMPLATE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEFT_OUT = ('.git', 'checkpoints', 'data/generated', '__pycache__', '.pytest_cache', '.idea', '.venv')
TEXT_FILES = ('.py', '.md', '.sh', '.xml', '.txt', '.yaml', '.cfg', '.toml', '.gitignore', 'run')

DATASET_STUB = '''"""The {name} dataset. Replace the parts marked TODO with your data's own reading."""
import os

from data.list_dataset import ListDataset


class {cls}(ListDataset):
    """{name}: images and labels from list files of `image_path label` lines.

    Built as {cls}(args, split) with split 'train' or 'val'. ListDataset already reads the list,
    the class names (classes.txt beside the list), decodes images and applies data/augment.py's
    transforms; override what differs for your data:
    - `default_list(args, split)`: where the lists are when --train_list/--val_list are not given;
    - `read(index)`: how one image is decoded (return a uint8 tensor 3 x H x W);
    - `__getitem__(index)`: what one sample is (the Trainer's `step` unpacks it as inputs, targets).
    """

    def default_list(self, args, split):
        # TODO: point at your data, or always pass --train_list / --val_list
        return os.path.join(args.data_root, '{name}', f'{{split}}.txt')
'''

MODEL_STUB = '''"""The {name} model. Replace the layers with your own; keep the (args) constructor."""
from torch import nn

from model.submodules import ConvBNReLU


class {cls}(nn.Module):
    """{name}: a small CNN to start from. It reads what it needs from args (num_classes, img_size, ...).

    Its direct children are the layer groups that ModelFreezer and --freeze_to see: keep the
    head last.
    """

    def __init__(self, args):
        super().__init__()
        # TODO: your layers
        self.features = nn.Sequential(ConvBNReLU(3, 32), nn.MaxPool2d(2), ConvBNReLU(32, 64), nn.MaxPool2d(2),
                                      ConvBNReLU(64, 64))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(64, args.num_classes)

    def forward(self, x):
        return self.head(self.pool(self.features(x)).flatten(1))
'''


def fail(message):
    """Print one error line and exit with status 2."""
    print(f'error: {message}', file=sys.stderr)
    sys.exit(2)


def template_files():
    """Paths (relative to the template) of the files a new project starts with."""
    try:
        listed = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'], cwd=TEMPLATE,
                                capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the folder
        listed = [os.path.relpath(os.path.join(folder, name), TEMPLATE)
                  for folder, _, names in os.walk(TEMPLATE) for name in names]
    return sorted(path for path in listed if os.path.isfile(os.path.join(TEMPLATE, path))
                  and not any(path == part or path.startswith(part + '/') or f'/{part}/' in f'/{path}'
                              for part in LEFT_OUT))


def camel(name):
    """snake_case -> CamelCase."""
    return ''.join(part.capitalize() for part in name.split('_'))


def register(path, dict_name, line, import_line):
    """Add `line` as the last entry of the dict `dict_name` in `path`, and `import_line` after its imports."""
    with open(path) as f:
        text = f.read()
    start = text.index(f'{dict_name} = {{')
    end = text.index('\n}', start)
    text = text[:end] + f'\n    {line}' + text[end:]
    imports = list(re.finditer(r'^from (data|model)\.\S+ import .+$', text, flags=re.M))
    text = text[:imports[-1].end()] + f'\n{import_line}' + text[imports[-1].end():]
    with open(path, 'w') as f:
        f.write(text)


def main(argv=None):
    """Create the new project."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[1])
    parser.add_argument('dest', help='folder for the new project (must not exist or be empty)')
    parser.add_argument('--name', help='project name (default: the folder name)')
    parser.add_argument('--dataset', help='name of a dataset stub to add (a Python identifier)')
    parser.add_argument('--model', help='name of a model stub to add (a Python identifier)')
    args = parser.parse_args(argv)
    for option in ('dataset', 'model'):
        value = getattr(args, option)
        if value is not None and not re.fullmatch(r'[a-z][a-z0-9_]*', value):
            fail(f'--{option} {value!r}: use a lower-case Python name such as my_{option}')
    if os.path.exists(args.dest) and (not os.path.isdir(args.dest) or os.listdir(args.dest)):
        fail(f'{args.dest} exists and is not an empty folder; choose a new DEST (nothing was written)')
    dest = os.path.abspath(args.dest)
    if dest == TEMPLATE or dest.startswith(TEMPLATE + os.sep):
        fail(f'{args.dest} is inside the template; choose a folder outside it')
    name = args.name or os.path.basename(dest)

    for path in template_files():
        target = os.path.join(dest, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(TEMPLATE, path), target)
        if path.endswith(TEXT_FILES):
            with open(target) as f:
                text = f.read()
            with open(target, 'w') as f:
                f.write(re.sub(r'\bKiln\b', name, text))
    os.makedirs(os.path.join(dest, 'checkpoints'), exist_ok=True)
    open(os.path.join(dest, 'checkpoints', '.gitkeep'), 'a').close()

    if args.dataset:
        cls = camel(args.dataset) + 'Dataset'
        with open(os.path.join(dest, 'data', f'{args.dataset}.py'), 'w') as f:
            f.write(DATASET_STUB.format(name=args.dataset, cls=cls))
        register(os.path.join(dest, 'data', 'data_entry.py'), 'DATASETS', f"'{args.dataset}': {cls},",
                 f'from data.{args.dataset} import {cls}')
    if args.model:
        cls = camel(args.model)
        os.makedirs(os.path.join(dest, 'model', args.model))
        with open(os.path.join(dest, 'model', args.model, f'{args.model}.py'), 'w') as f:
            f.write(MODEL_STUB.format(name=args.model, cls=cls))
        with open(os.path.join(dest, 'model', args.model, '__init__.py'), 'w') as f:
            f.write(f"from model.{args.model}.{args.model} import {cls}\n\n__all__ = ['{cls}']\n")
        register(os.path.join(dest, 'model', 'model_entry.py'), 'MODELS', f"'{args.model}': {cls},",
                 f'from model.{args.model} import {cls}')
    print(f'new project {name} in {dest}')
    print(f'  cd {args.dest} && python3 -m pip install -r requirements.txt && bash scripts/train.sh'
          + (f' --data_type {args.dataset} --train_list LIST --val_list LIST' if args.dataset else '')
          + (f' --model_type {args.model}' if args.model else ''))


if __name__ == '__main__':
    main()
