"""Start a new project from this template: `python scripts/new_task.py DEST [--name NAME]
[--task NAME] [--dataset NAME] [--model NAME]`.

Copies the template as committed (`git archive HEAD`: your uncommitted or untracked files are not
copied; outside a git checkout, every file but those its .gitignore names: outputs, caches) into
the new, empty folder DEST, puts the project name where "Kiln" stood, and with --task / --dataset /
--model writes a commented stub task, dataset file or model package and registers each with one
line. The new project runs and passes its tests as it is.
"""

import ast
import fnmatch
import io
import keyword
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import tokenize

TEMPLATE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a copy outside git leaves out, besides what the template's .gitignore names (patterns as there: one
# with a / inside is a path from the top, one without a name anywhere)
LEFT_OUT = ('/.git', '/checkpoints', '/data/generated', '__pycache__', '*.pyc', '.*_cache', '.idea', '.venv')
TEXT_FILES = ('.py', '.md', '.sh', '.xml', '.txt', '.yaml', '.yml', '.cfg', '.toml', '.json', '.gitignore', 'run')
# where each stub is registered (file, dict) and goes: a name taken by either would overwrite a part of Kiln
# (a module file and a package folder of one name shadow each other)
TAKEN = {
    'task': ('tasks/task_entry.py', 'TASKS', ('tasks/{}.py', 'tasks/{}')),
    'dataset': ('data/data_entry.py', 'DATASETS', ('data/{}.py', 'data/{}')),
    'model': ('model/model_entry.py', 'MODELS', ('model/{}', 'model/{}.py')),
}
INTRO = re.compile(r'<!-- intro -->.*?<!-- /intro -->', re.S)  # the README's template pitch, replaced in a project
MEASURED = re.compile(r'<!-- measured -->.*?<!-- /measured -->', re.S)  # the template's figures: not the project's
# a project name is written as it is into Python strings (f-strings, .format templates too) and shell text, and
# makes the distribution's name: characters that none of them escapes, a letter or digit first
PROJECT_NAME = re.compile(r'[A-Za-z0-9]([A-Za-z0-9 ._-]*[A-Za-z0-9._-])?')

TASK_STUB = '''"""The {name} task. Everything this kind of problem needs beyond the loop is here (see tasks/task.py).

As written it classifies images, so it trains, evaluates and predicts at once on the generated shapes;
replace the parts marked TODO with your own problem's.
"""
from metrics import ClassificationMetrics
from tasks.task import Task
from utils.viz import labeled_grid


class {cls}(Task):
    """{name}: TODO say what the model predicts from an image."""

    default_model = 'small_cnn'  # TODO: --model_type when none is given (model/model_entry.py)
    default_data = ('shapes', 'list')  # TODO: --data_type without / with list files (data/data_entry.py)
    default_loss = 'cross_entropy'  # TODO: a LOSSES name (loss.py), or None and override loss() below
    monitor = 'val/acc'  # TODO: the metric that picks best.pth ('val/' + a name metric_names returns)
    monitor_mode = 'max'
    targets = ('label',)  # TODO: the batch keys your datasets give besides 'image'

    @classmethod
    def metric_names(cls, options):
        # TODO: what metrics().compute() returns, and 'loss'
        monitor = getattr(options, 'monitor', None)  # a top-k that holds every class: kept where monitored
        return ['loss', *ClassificationMetrics.names(options.num_classes, options.topk, monitor)]

    def loss(self, outputs, batch):
        # TODO: the loss of one batch from the model's outputs and the batch's targets
        return self.criterion(outputs, batch['label'])

    def metrics(self, per_class=True):
        # TODO: an object with update(outputs, batch), compute(class_names=None), reset(), state_dict() and
        # load_state_dict(state) (see tasks/task.py's metrics and metrics.py)
        monitor = getattr(self.options, 'monitor', None)
        return ClassificationMetrics(self.num_classes, self.options.topk, monitor=monitor, per_class=per_class)

    def train_metrics(self):
        # TODO: the metrics of the training curves (None for none): here without the per-class counts
        return self.metrics(per_class=False)

    def pictures(self, batch, outputs):
        # TODO: what to look at in TensorBoard and eval's pictures
        count = min(16, self.count(batch))
        predicted, true = self.to_host(outputs[:count].argmax(1), batch['label'][:count])
        return {{'predictions': labeled_grid(self.display_images(batch, count), predicted.tolist(), true.tolist(),
                                            self.class_names)}}

    eval_header = ('image', 'label', 'prediction')

    def eval_rows(self, batch, outputs):
        # TODO: eval.py's predictions.csv: per sample, a list of rows (after the image path)
        labels, predicted = self.to_host(batch['label'], outputs.argmax(1))
        return [[[label, p]] for label, p in zip(labels.tolist(), predicted.tolist())]

    predict_header = ('image', 'prediction', 'prediction_name')

    def predict_rows(self, batch, outputs, paths, folder):
        # TODO: predict.py's predictions.csv for unlabelled images (may also write files into folder)
        predicted, = self.to_host(outputs.argmax(1))
        return [[[p, self.class_names[p]]] for p in predicted.tolist()]
'''

DATASET_STUB = '''"""The {name} dataset. Replace the parts marked TODO with your data's own reading."""
import os

from data.list_dataset import ListDataset


class {cls}(ListDataset):
    """{name}: images and labels from list files of `image_path label` lines.

    Built as {cls}(args, split) with split 'train' or 'val'. ListDataset already reads the list, the
    class names (classes.txt beside the list) and decodes images to uint8; the training augmentation
    runs per batch on the device. Override what differs for your data:
    - `augment`: the augmentation that keeps a label true (add 'hflip' only if mirrored images keep it);
    - `default_list(args, split)`: where the lists are when --train_list/--val_list are not given;
    - `read(index)`: how one image is decoded (return a uint8 tensor 3 x H x W);
    - `__getitem__(index)`: what one sample is (a dict: 'image' plus the task's targets, e.g. 'label').
    """

    augment = ('crop',)  # TODO: the augmentations that fit your data (crop, hflip, vflip)

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

PROJECT_MEASURED = """<!-- measured -->
Not measured yet: the template's figures are in its own README. Measure this project with the
commands above, and put its figures here.
<!-- /measured -->"""
PROJECT_INTRO = """<!-- intro -->
{name} trains, evaluates and serves its models with PyTorch: `bash scripts/train.sh` trains,
`bash scripts/eval.sh` evaluates, `python predict.py` predicts, TensorBoard shows the curves.
<!-- /intro -->"""


class TemplateError(Exception):
    """A template file the generator cannot read as it expects (its README's title, a registry)."""


def fail(message):
    """Print one error line and exit with status 2."""
    print(f'error: {message}', file=sys.stderr)
    sys.exit(2)


def copy_template(dest):
    """Copy the template's committed files into `dest` (see the module docstring); return how."""
    try:  # (safe.directory: a shared install of another user's is read all the same)
        archive = subprocess.run(
            ['git', '-c', f'safe.directory={os.path.realpath(TEMPLATE)}', 'archive', '--format=tar', 'HEAD'],
            cwd=TEMPLATE,
            capture_output=True,
        )
    except FileNotFoundError:  # no git here: the files are copied as they are
        archive = None
    if archive is not None and archive.returncode == 0:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            try:
                tar.extractall(dest, filter='data')
            except tarfile.FilterError as error:  # a link out of the project, say
                raise TemplateError(f'the template commits {error}, which a copy does not take: remove it') from None
        return 'the committed files (git archive HEAD)'
    patterns = ignored_patterns()
    for folder, names, files in os.walk(TEMPLATE):
        relative = os.path.relpath(folder, TEMPLATE)
        names[:] = [n for n in names if not left_out(os.path.join(relative, n), patterns)]
        files += [n for n in names if os.path.islink(os.path.join(folder, n))]  # a link to a folder: as a link
        names[:] = [n for n in names if n not in files]
        for name in files:
            if left_out(os.path.join(relative, name), patterns):
                continue
            target = os.path.join(dest, relative, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(os.path.join(folder, name), target, follow_symlinks=False)  # a link as a link, as git's
            if not os.path.islink(target):  # the new project's own, from a read-only install
                os.chmod(target, os.stat(target).st_mode | stat.S_IWUSR)
    return 'every file but outputs and caches (not a git checkout)'


def ignored_patterns():
    """LEFT_OUT and the patterns of the template's .gitignore (its ! exceptions aside: what they keep in
    the template's output folders is not the new project's)."""
    try:
        with open(os.path.join(TEMPLATE, '.gitignore'), encoding='utf-8') as f:
            lines = [line.strip() for line in f]
    except FileNotFoundError:
        lines = []
    return [*LEFT_OUT, *(line for line in lines if line and not line.startswith(('#', '!')))]


def left_out(relative, patterns):
    """Whether the template's file or folder `relative` (a path from its top) is left out of a copy."""
    relative = os.path.normpath(relative).replace(os.sep, '/')
    for pattern in patterns:
        from_top = '/' in pattern.rstrip('/')
        if fnmatch.fnmatchcase(relative if from_top else relative.rpartition('/')[2], pattern.strip('/')):
            return True
    return False


def template_names(dest):
    """The template's own name (the title of the copied README: Kiln, or the name of a project made from
    Kiln) and its distribution's name in pyproject.toml."""
    with open(os.path.join(dest, 'README.md'), encoding='utf-8') as f:
        title = next((line[2:].strip() for line in f if line.startswith('# ')), '')
    if not title:
        raise TemplateError("the template's README.md has no title line ('# Name'), which names it: add one")
    with open(os.path.join(dest, 'pyproject.toml'), encoding='utf-8') as f:
        package = re.search(r"""^name\s*=\s*(['"])([^'"]+)\1""", f.read(), re.M)
    if package is None:
        raise TemplateError("the template's pyproject.toml has no name = '...' line: add its [project] name")
    return title, package.group(2)


def package_name(name):
    """The distribution's name of the project `name`: lower case, its spaces (and the like) as -."""
    return re.sub(r'[^a-z0-9._-]+', '-', name.lower()).strip('._-')


def rename(dest, name):
    """Put `name` (a PROJECT_NAME) where the template's name stood in the text files, and replace the
    README's template pitch and figures and the distribution's name in pyproject.toml. A project made
    from a project renames its README's title alone: its name may be a word its code and text use ('model')."""
    intro, package = PROJECT_INTRO.format(name=name), package_name(name)
    old_name, old_package = template_names(dest)
    made_from_kiln = old_package == 'kiln'  # (lower case: the renaming leaves it as it is; no project is named so)
    for folder, _, files in os.walk(dest):
        for file in files:
            path = os.path.join(folder, file)
            readme = file == 'README.md' and folder == dest
            if not file.endswith(TEXT_FILES) or (not made_from_kiln and not readme and file != 'pyproject.toml'):
                continue
            if os.path.islink(path):  # a link, kept as one: what it points to is no file of the project
                continue
            with open(path, encoding='utf-8') as f:
                text = f.read()
            if file == 'pyproject.toml' and folder == dest:
                text = text.replace(f"name = '{old_package}'", f"name = '{package}'", 1)
                text = text.replace(f"'{old_package}[", f"'{package}[")  # its extras naming its own
            if readme:
                text = MEASURED.sub(PROJECT_MEASURED, INTRO.sub(lambda match: intro, text))
                if not made_from_kiln:
                    text = re.sub(r'^# .*$', lambda match: f'# {name}', text, count=1, flags=re.M)
            if made_from_kiln:
                text = re.sub(rf'(?<!\w){re.escape(old_name)}(?!\w)', lambda match: name, text)
            with open(path, 'w', encoding='utf-8') as f:
                f.write(text)


def camel(name):
    """snake_case -> CamelCase."""
    return ''.join(part.capitalize() for part in name.split('_'))


def registry(dest, option):
    """(the dict display of the registry of `option` (a TAKEN key) in the project `dest`, an ast.Dict; its
    file's text; its file's path)."""
    entry, dict_name, _ = TAKEN[option]
    path = os.path.join(dest, entry)
    with open(path, encoding='utf-8') as f:
        text = f.read()
    try:
        nodes = ast.parse(text, entry).body
    except SyntaxError as error:
        raise TemplateError(
            f"the template's {entry} does not parse ({error.msg}, line {error.lineno}): mend it"
        ) from None
    for node in nodes:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, 'target', None)]
        if any(isinstance(t, ast.Name) and t.id == dict_name for t in targets) and isinstance(node.value, ast.Dict):
            return node.value, text, path
    raise TemplateError(f"the template's {entry} has no {dict_name} = {{...}} to register the stub in: put it back")


def text_index(text, line, column, in_bytes=True):
    """The index in `text` of a position (line from 1; column in UTF-8 bytes, as ast gives it, or characters)."""
    lines = text.split('\n')
    within = len(lines[line - 1].encode()[:column].decode()) if in_bytes else column
    return sum(len(lines[i]) + 1 for i in range(line - 1)) + within


def register(dest, option, name, target):
    """Add `'name': 'target',` as the last entry of the registry of `option` (a TAKEN key) in the project `dest`."""
    table, text, path = registry(dest, option)
    start = text_index(text, table.lineno, table.col_offset)  # its {
    close = text_index(text, table.end_lineno, table.end_col_offset) - 1  # its }
    piece = text[start : close + 1]
    tokens = [  # what the dict is written with, comments and line breaks aside
        token
        for token in tokenize.generate_tokens(io.StringIO(piece).readline)
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER)
    ]
    last = tokens[-2]  # before the }: the { of an empty dict, a comma, or the end of the last entry (a bracket too)
    after = start + text_index(piece, *last.end, in_bytes=False)
    comma = '' if last.string in ('{', ',') else ','
    line_start = text.rfind('\n', 0, close) + 1
    if text[line_start:close].strip():  # the } closes a line of entries (`{'a': 'b'}`): one more on it
        at, added = close, f"{'' if last.string == '{' else ' '}'{name}': '{target}'"
    else:
        at, added = line_start, f"    '{name}': '{target}',\n"
    with open(path, 'w', encoding='utf-8') as f:
        f.write(text[:after] + comma + text[after:at] + added + text[at:])
    table, _, _ = registry(dest, option)
    if name not in [key.value for key in table.keys if isinstance(key, ast.Constant)]:  # (not expected)
        raise TemplateError(f"could not register {name} in the template's {TAKEN[option][0]}: add it by hand")


def edit(dest, file, old, new):
    """Replace `old` (a text, or a compiled regular expression) by the text `new` in the project's `file`."""
    path = os.path.join(dest, file)
    with open(path, encoding='utf-8') as f:
        text = f.read()
    with open(path, 'w', encoding='utf-8') as f:
        f.write(old.sub(lambda match: new, text) if isinstance(old, re.Pattern) else text.replace(old, new))


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        f.write(text)


def make_project(args, dest, name):
    """Copy the template into `dest` as project `name`, with the stubs `args` asks for; return how it was copied."""
    how = copy_template(dest)
    for option, (entry, _, places) in TAKEN.items():  # (in the copy: what the new project would hold)
        value = getattr(args, option)
        if value is None:
            continue
        table, _, _ = registry(dest, option)
        registered = any(isinstance(key, ast.Constant) and key.value == value for key in table.keys)
        places = [place.format(value) for place in places]
        taken = [entry] if registered else [place for place in places if os.path.lexists(os.path.join(dest, place))]
        if taken:
            raise TemplateError(
                f'--{option} {value}: the template has a {option} or file of that name already ({taken[0]}); '
                f'choose another name'
            )
    rename(dest, name)
    os.makedirs(os.path.join(dest, 'checkpoints'), exist_ok=True)
    open(os.path.join(dest, 'checkpoints', '.gitkeep'), 'a').close()
    if args.task:
        cls = camel(args.task) + 'Task'
        write(os.path.join(dest, 'tasks', f'{args.task}.py'), TASK_STUB.format(name=args.task, cls=cls))
        register(dest, 'task', args.task, f'tasks.{args.task}:{cls}')
        own = f"TASK=${{TASK:-{args.task}}}  # this project's task (tasks/task_entry.py)"
        # the project's own task is what its scripts and its IDEs' training configurations train
        edit(dest, 'scripts/train.sh', re.compile(r'TASK=\$\{TASK:-\w*\}.*'), own)
        edit(dest, 'scripts/train_ddp.sh', re.compile(r'TASK=\$\{TASK:-\w*\}.*'), own)
        task = args.task
        edit(
            dest, '.run/train.run.xml', 'value="--save_prefix pycharm"', f'value="--task {task} --save_prefix pycharm"'
        )
        edit(dest, '.run/train_ddp.run.xml', 'train.py --save_prefix', f'train.py --task {task} --save_prefix')
        edit(dest, '.vscode/launch.json', '"args": ["--save_prefix"', f'"args": ["--task", "{task}", "--save_prefix"')
        edit(
            dest,
            '.vscode/launch.json',
            '"train.py", "--save_prefix"',
            f'"train.py", "--task", "{task}", "--save_prefix"',
        )
    if args.dataset:
        cls = camel(args.dataset) + 'Dataset'
        write(os.path.join(dest, 'data', f'{args.dataset}.py'), DATASET_STUB.format(name=args.dataset, cls=cls))
        register(dest, 'dataset', args.dataset, f'data.{args.dataset}:{cls}')
    if args.model:
        cls = camel(args.model)
        write(os.path.join(dest, 'model', args.model, f'{args.model}.py'), MODEL_STUB.format(name=args.model, cls=cls))
        write(
            os.path.join(dest, 'model', args.model, '__init__.py'),
            f"from model.{args.model}.{args.model} import {cls}\n\n__all__ = ['{cls}']\n",
        )
        register(dest, 'model', args.model, f'model.{args.model}:{cls}')
    return how


def main(argv=None):
    """Create the new project."""
    sys.path.insert(0, TEMPLATE)
    from options import KilnArgumentParser  # (torch-free) a mistake is one line

    parser = KilnArgumentParser(description=__doc__.split('\n\n')[1])
    parser.add_argument('dest', help='folder for the new project (must not exist or be empty)')
    parser.add_argument('--name', help='project name (default: the folder name)')
    for stub in ('task', 'dataset', 'model'):
        parser.add_argument(f'--{stub}', help=f'name of a {stub} stub to add (a lower-case Python name)')
    args = parser.parse_args(argv)
    for option in ('task', 'dataset', 'model'):
        value = getattr(args, option)
        if value is not None and not re.fullmatch(r'[a-z][a-z0-9_]*', value):
            fail(f'--{option} {value!r}: use a lower-case Python name such as my_{option}')
        if value is not None and keyword.iskeyword(value):  # `import model.class` is a SyntaxError
            fail(f'--{option} {value}: a Python keyword cannot name a module; choose another name such as my_{value}')
    if not args.dest:
        fail('DEST is empty; give the folder for the new project, e.g. ../my_project')
    if os.path.exists(args.dest) and (not os.path.isdir(args.dest) or os.listdir(args.dest)):
        fail(f'{args.dest} exists and is not an empty folder; choose a new DEST (nothing was written)')
    dest, template, real = os.path.abspath(args.dest), os.path.realpath(TEMPLATE), os.path.realpath(args.dest)
    if real == template or real.startswith(template + os.sep):  # by the real path: a link into it counts
        fail(f'{args.dest} is inside the template; choose a folder outside it')
    name = os.path.basename(dest) if args.name is None else args.name
    if not PROJECT_NAME.fullmatch(name):
        given = f'--name {name!r}' if args.name is not None else f'the folder name {name!r} (the default --name)'
        fail(
            f'{given}: a project name holds only ASCII letters, digits, spaces and . _ - (a letter or digit '
            f'first, no space last), as it is written into code and is the package name; give --name with those'
        )
    if package_name(name) == 'kiln':  # the mark of the template itself (see rename)
        given = f'--name {name}' if args.name is not None else f'the folder name {name} (the default --name)'
        fail(f"{given}: that is the template's own name; give another --name")

    existed = os.path.isdir(dest)
    try:
        how = make_project(args, dest, name)
    except BaseException as error:  # what it made goes (an empty folder given: empty again)
        for entry in os.listdir(dest) if existed else ():
            path = os.path.join(dest, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
        if not existed:
            shutil.rmtree(dest, ignore_errors=True)
        if isinstance(error, TemplateError):
            fail(f'{error} (nothing was written)')
        if not isinstance(error, OSError):
            raise
        where = f' ({error.filename})' if error.filename else ''
        if error.filename and os.path.realpath(error.filename).startswith(template + os.sep):
            fail(
                f"cannot read the template's {error.filename}: {error.strerror or error}; mend it (nothing was written)"
            )
        fail(
            f'cannot write the new project into {args.dest}: {error.strerror or error}{where}; choose a folder '
            f'you can write to'
        )
    print(f'new project {name} in {dest}, from {how}')
    flags = ''.join(
        f' --{option} {getattr(args, value)}'
        for option, value in (('task', 'task'), ('data_type', 'dataset'), ('model_type', 'model'))
        if getattr(args, value)
    )
    lists = ' --train_list TRAIN_LIST --val_list VAL_LIST' if args.dataset else ''
    install = 'python3 -m pip install -r requirements.txt'
    print(f'  cd {shlex.quote(args.dest)} && {install} && bash scripts/train.sh{flags}{lists}')
    if args.dataset:
        print(f'  (TRAIN_LIST, VAL_LIST: your list files or folders of class folders; see data/{args.dataset}.py)')


if __name__ == '__main__':
    main()
