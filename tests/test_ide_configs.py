"""The IDE run configurations, PyCharm's (.run/*.run.xml) and VS Code's (.vscode/launch.json), start what
they say: an existing script or module, in the project root, with options its own parser accepts; the
eval and predict ones use the checkpoint the train one makes; and both IDEs offer the same set."""

import glob
import importlib.util
import json
import os
import shlex
import xml.etree.ElementTree as ElementTree

import pytest

from conftest import REPO

SCRIPT_PARSERS = {'train.py': 'parse_train_args', 'eval.py': 'parse_test_args', 'predict.py': 'parse_predict_args'}
TORCHRUN = 'utils.torchrun'  # Kiln's torchrun (torch.distributed.run with clean endings), run as a module
CONFIGURATIONS = {'train', 'eval (after train)', 'predict (after train)', 'train_seg', 'train_ddp'}


def _pycharm():
    """{name: configuration} from .run/*.run.xml; a configuration is a dict with 'file' (the .run file),
    'script' or 'module', 'args' (a list), 'cwd' and 'env', in the project's terms."""
    configurations = {}
    for path in sorted(glob.glob(os.path.join(REPO, '.run', '*.run.xml'))):
        root = ElementTree.parse(path).getroot()
        assert root.tag == 'component' and root.get('name') == 'ProjectRunConfigurationManager', path
        [config] = root.findall('configuration')
        assert config.get('type') == 'PythonConfigurationType' and config.get('factoryName') == 'Python', path
        options = {o.get('name'): o.get('value') for o in config.findall('option')}
        target = options['SCRIPT_NAME']
        module_mode = options.get('MODULE_MODE') == 'true'
        name = config.get('name')
        assert name not in configurations, f'two PyCharm configurations named {name!r}'
        configurations[name] = {
            'file': os.path.basename(path),
            'module' if module_mode else 'script': target if module_mode else target.replace('$PROJECT_DIR$', REPO),
            'args': shlex.split(options.get('PARAMETERS', '')),
            'cwd': options['WORKING_DIRECTORY'].replace('$PROJECT_DIR$', REPO),
            'env': {e.get('name'): e.get('value') for e in config.iter('env')},
        }
    return configurations


def _vscode():
    """{name: configuration} from .vscode/launch.json, as _pycharm gives them (the launch configuration of
    the test explorer's "Debug Test", purpose debug-test, is no run configuration and is left out)."""
    with open(os.path.join(REPO, '.vscode', 'launch.json'), encoding='utf-8') as f:
        launch = json.load(f)

    def expand(text):
        return text.replace('${workspaceFolder}', REPO)

    configurations = {}
    for config in launch['configurations']:
        if 'debug-test' in config.get('purpose', []):
            continue
        assert config['type'] == 'debugpy' and config['request'] == 'launch', config['name']
        assert ('program' in config) != ('module' in config), f'{config["name"]}: a program or a module'
        assert config['name'] not in configurations, f'two VS Code configurations named {config["name"]!r}'
        configurations[config['name']] = {
            'module' if 'module' in config else 'script': config.get('module') or expand(config['program']),
            'args': list(config.get('args', [])),
            'cwd': expand(config.get('cwd', '')),
            'env': config.get('env', {}),
            'justMyCode': config.get('justMyCode', True),
        }
    return configurations


def _script_args(config):
    """(the script's path relative to the project root, its arguments) that a configuration runs; for a
    torchrun module, the launcher's own options must be accepted by torchrun's parser, which splits them
    from the training script and its options."""
    if 'script' in config:
        return os.path.relpath(config['script'], REPO), config['args']
    assert config['module'] == TORCHRUN, f'unexpected module {config["module"]}'
    from torch.distributed.run import get_args_parser

    launcher = get_args_parser().parse_args(config['args'])
    assert not launcher.module and not launcher.no_python, 'torchrun must run the training script with python'
    return launcher.training_script, launcher.training_script_args


def _parse(script, argv):
    import options

    return options.parse_args(getattr(options, SCRIPT_PARSERS[script]), argv)


@pytest.fixture(scope='module', params=['pycharm', 'vscode'])
def configurations(request):
    return {'pycharm': _pycharm, 'vscode': _vscode}[request.param]()


def test_both_ides_offer_the_same_configurations():
    pycharm, vscode = _pycharm(), _vscode()
    assert set(pycharm) == set(vscode) == CONFIGURATIONS
    for name in CONFIGURATIONS:
        same = ('script', 'module', 'args', 'cwd', 'env')
        assert {k: pycharm[name].get(k) for k in same} == {k: vscode[name].get(k) for k in same}, name


def test_pycharm_keeps_one_file_per_configuration_named_after_it():
    for name, config in _pycharm().items():
        assert config['file'] == f'{name.split(" ")[0]}.run.xml'


def test_every_configuration_runs_an_existing_script_or_module_in_the_project_root(configurations):
    for name, config in configurations.items():
        assert config['cwd'] == REPO, name
        assert config['env'].get('PYTHONUNBUFFERED') == '1', name
        if 'module' in config:
            spec = importlib.util.find_spec(config['module'])
            assert spec and os.path.dirname(os.path.dirname(spec.origin)) == REPO, f'{name}: {config["module"]}'
        script, _ = _script_args(config)
        assert script in SCRIPT_PARSERS and os.path.isfile(os.path.join(REPO, script)), f'{name}: {script}'
        assert config.get('justMyCode', False) is False, f'{name}: justMyCode hides Kiln and torch from the debugger'


def test_every_configuration_s_options_are_accepted_by_its_script_s_parser(configurations):
    for config in configurations.values():
        _parse(*_script_args(config))  # exits (SystemExit 2) on an unknown option or a bad value


def test_the_ddp_configuration_runs_kiln_s_torchrun_with_two_processes(configurations):
    config = configurations['train_ddp']
    assert config.get('module') == TORCHRUN
    from torch.distributed.run import get_args_parser

    launcher = get_args_parser().parse_args(config['args'])
    assert launcher.standalone and launcher.nproc_per_node == '2'


def test_eval_and_predict_use_the_checkpoint_that_the_train_configuration_makes(configurations):
    from options import experiment_folder, resolve

    train = resolve(_parse(*_script_args(configurations['train'])))
    best = os.path.join(experiment_folder(train), 'best.pth')
    for name in ('eval (after train)', 'predict (after train)'):
        args = _parse(*_script_args(configurations[name]))
        checkpoints = args.load_model_path if isinstance(args.load_model_path, list) else [args.load_model_path]
        # the configurations run in the project folder ($PROJECT_DIR$, ${workspaceFolder})
        assert [os.path.normpath(os.path.join(REPO, path)) for path in checkpoints] == [os.path.normpath(best)], name
