"""Name registries (--task, --model_type, --data_type): dicts of name -> 'module.path:Attribute'.

Registry files hold strings, not imported classes, so adding an entry is one line, and `--help`
and name checks answer before torch loads; the module of an entry is imported only when it is used.
"""

import importlib

from utils.errors import KilnError


def load_entry(registry, name, option, registry_file):
    """The class or function that `registry[name]` points to; problems become one-line KilnErrors
    naming `option` (e.g. '--model_type') and `registry_file` (e.g. 'model/model_entry.py')."""
    if name not in registry:
        raise KilnError(
            f'unknown {option} {name!r}; choose one of: {", ".join(sorted(registry))} '
            f'(or register it in {registry_file})'
        )
    module_name, _, attribute = str(registry[name]).partition(':')
    if not module_name or not attribute:
        raise KilnError(
            f"{registry_file}: the entry {name!r}: {registry[name]!r} must look like 'package.module:ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except KilnError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of the user's module is reported as one line
        raise KilnError(
            f'{registry_file}: the entry {name!r} cannot import {module_name} ({type(error).__name__}: {error})'
        ) from None
    if not hasattr(module, attribute):
        raise KilnError(f'{registry_file}: the entry {name!r}: {module_name} has no {attribute}')
    return getattr(module, attribute)
