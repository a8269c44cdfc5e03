"""User-facing errors: one clear line and a non-zero exit instead of a traceback."""
import os
import sys


class KilnError(Exception):
    """A mistake the user can fix (bad option, missing file, incompatible checkpoint, ...).

    The message says what is wrong and how to fix it; entry scripts print it as one line.
    """


def _one_line(error):
    # A KilnError raised in a DataLoader worker comes back wrapped with the worker's traceback
    # text; the user's message is the last line, after the exception's qualified name.
    text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    return text.split('KilnError: ', 1)[-1]


def run_cli(main, argv=None):
    """Run an entry point's `main(argv)`, turning KilnError into one line and exit code 2.

    With `--debug` on the command line the full traceback is shown instead.
    """
    argv = sys.argv[1:] if argv is None else argv
    if '--debug' in argv:
        return main(argv)
    try:
        return main(argv)
    except KilnError as error:
        # under torchrun every rank fails alike on a shared error; one copy of the line is enough
        if os.environ.get('RANK', '0') == '0' or type(error).__name__ != 'SharedKilnError':
            print(f'error: {_one_line(error)}', file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print('interrupted', file=sys.stderr)
        sys.exit(130)
