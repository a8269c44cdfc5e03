"""User-facing errors: one clear line and a non-zero exit instead of a traceback (imports no torch)."""

import atexit
import codecs
import contextlib
import errno
import os
import re
import select
import shlex
import signal
import sys
import threading
import time


class KilnError(Exception):
    """A mistake the user can fix (bad option, missing file, incompatible checkpoint, ...).

    The message says what is wrong and how to fix it; entry scripts print it as one line.
    """


def listed(names, shown=10):
    """`names` for a one-line message: the first `shown`, then how many more (a thousand classes are no line)."""
    more = len(names) - shown
    return ', '.join(names[:shown]) + (f', ... and {more} more' if more > 0 else '')


def shell_word(path):
    """`path` as one word of a command to paste into a shell: quoted, and taken for no option (a relative
    path that starts with '-' as ./-path)."""
    return shlex.quote(os.path.join('.', path) if path.startswith('-') else path)


def file_in_the_way(path):
    """The first path from the top down to `path` (itself included) that exists but is not a folder, or
    None: why making the folder `path` fails with "File exists" or "Not a directory"."""
    on_the_way, path = [], os.path.normpath(path)  # named as given (relative stays relative)
    while path and path not in on_the_way:
        on_the_way.append(path)
        path = os.path.dirname(path)
    return next((p for p in reversed(on_the_way) if os.path.lexists(p) and not os.path.isdir(p)), None)


def not_a_folder(path, blocker):
    """The start of a message saying that the folder `path` cannot be made because of the file `blocker`."""
    if os.path.normpath(path) == blocker:
        return f'{path} {is_a_file(blocker)}'
    return f'cannot make the folder {path}: {blocker} {is_a_file(blocker)}'


def is_a_file(path):
    """What `path`, in the way of a folder, is: 'is a file, not a folder', or a link that leads nowhere."""
    if os.path.islink(path) and not os.path.exists(path):
        return f'is a link to {os.readlink(path)}, which does not exist'
    return 'is a file, not a folder'


# the exit code of a mistake said in one line (an option, a missing file, a full disk), as argparse's
MISTAKE_EXIT_CODE = 2
# utils/torchrun.py's file that a worker makes when it exits with a mistake before its first training step
# (an option, a missing file): starting it again (--max-restarts) would only meet it again; one met later
# may pass (a network disk's hiccup), and a restart resumes from the last checkpoint
NO_RESTART_FILE = 'KILN_NO_RESTART_FILE'
TRAINING_STEPS = []  # a training run of this process made its first step (train.py appends)
# the exit code of a torchrun worker that went down because another process is gone: not 1 (an unexpected
# traceback) nor 2 (an error of its own), so that utils/torchrun.py blames the process that failed first
PEER_LOST_EXIT_CODE = 3

SHARED_ERROR_WAIT = 30.0  # seconds a rank other than 0 gives rank 0 to say the same error first


def write_to_stderr_now(text):
    """Write `text` to stderr in one call on its file descriptor, past the buffered stream: from a signal
    handler, which may have interrupted a write to that stream (Python then refuses a second one,
    'reentrant call'), and from processes whose lines must not interleave. A stream without a descriptor
    (captured output) is written as it is."""
    try:
        descriptor = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is both)
        if sys.stderr is not None:
            sys.stderr.write(text)
        return
    data = text.encode(getattr(sys.stderr, 'encoding', None) or 'utf-8', 'backslashreplace')
    with contextlib.suppress(OSError):  # a closed or full pipe: nothing more to say there
        while data:
            data = data[os.write(descriptor, data) :]


def exit_with_error(line, code=MISTAKE_EXIT_CODE):
    """Print `line` (`error: ...`) to stderr and exit with `code`, once per torchrun job.

    Under torchrun every rank usually meets a mistake alike (an option, a missing file or checkpoint):
    rank 0 says it and the others wait, silent: torchrun stops every worker as soon as one exits, so a
    rank that exited at once could stop rank 0 before its line is out, leaving no error at all. torchrun
    stops them when rank 0 exits; one still running after SHARED_ERROR_WAIT seconds (rank 0 did not
    fail alike: the error is this rank's own) prints the line itself, naming its rank."""
    marker = os.environ.get(NO_RESTART_FILE)
    if marker and code == MISTAKE_EXIT_CODE and not TRAINING_STEPS:
        with contextlib.suppress(OSError), open(marker, 'a'):
            pass
    rank = os.environ.get('RANK', '0')
    if rank != '0':
        time.sleep(SHARED_ERROR_WAIT)
        line = f'rank {rank}: {line}'
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)


def _one_line(error):
    # A KilnError raised in a DataLoader worker comes back wrapped with the worker's traceback
    # text; the user's message is the last line, after the exception's qualified name.
    text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    return text.split('KilnError: ', 1)[-1]


def is_out_of_memory(error):
    """Whether `error` says that memory ran out (the host's or a GPU's)."""
    return (
        isinstance(error, MemoryError)
        or type(error).__name__ == 'OutOfMemoryError'
        or (
            isinstance(error, RuntimeError) and ("can't allocate memory" in str(error) or 'out of memory' in str(error))
        )
    )


# what gloo and NCCL say when another process of a torchrun job is gone (killed, crashed, its machine lost)
PEER_LOST = ('Connection closed by peer', 'Connection reset by peer', 'NCCL communicator was aborted')


# what torch's DataLoader says when a worker process ended without an error of its own (killed: by the
# kernel for memory, by a bus error on full shared memory; or ended by data/loader.py after a lost batch)
WORKER_LOST = ('exited unexpectedly', 'is killed by signal')


def is_peer_lost(error):
    """Whether `error` is a collective's failure because another process of the torchrun job is gone."""
    return isinstance(error, RuntimeError) and any(text in str(error) for text in PEER_LOST)


def _interrupted():
    if os.environ.get('RANK', '0') == '0':  # under torchrun, Ctrl-C reaches every rank: one says so
        print('interrupted', file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


class StoppedBySignal(SystemExit):
    """A signal that ends the process with exit code 128 + `signum` through every `finally` (a result
    folder just made is removed again); `run_cli` then prints `line` once (under torchrun, for a first
    SIGTERM, only the launcher says why its workers stopped) and exits. `second`: a second
    stop signal while a training run stops on the first, which stops at once (no interpreter teardown
    to wait for, as after a second Ctrl-C).

    A SystemExit, so that code that does not know it still exits with the signal's code."""

    def __init__(self, signum, line, second=False):
        super().__init__(128 + signum)
        self.signum, self.line, self.second = signum, line, second

    def nothing_saved(self):
        """Say so, for the run folder with no checkpoint that a second signal left, and that was removed."""
        if self.second:
            name = signal.Signals(self.signum).name
            self.line = f'stopped at once on a second {name}, before the first checkpoint: nothing was saved'


def terminated(signum):
    """What a stop signal (SIGTERM, SIGUSR1) raises in eval.py, predict.py, or train.py before its loop takes it."""
    return StoppedBySignal(signum, f'terminated ({signal.Signals(signum).name})')


def second_stop_signal(signum):
    """What a second SIGTERM (or SIGUSR1) raises while a training run stops on the first. Checkpoints are
    written to a temporary file and renamed: the one being written is left out, the newest on disk is
    whole (and with none, --resume starts the run)."""
    name = signal.Signals(signum).name
    return StoppedBySignal(
        signum, f'stopped at once on a second {name}; the newest checkpoint is whole: continue with --resume', True
    )


def _stopped(stop, at_once=False):
    # Every process of a torchrun job hears a signal: one says so. For a first SIGTERM none does: the
    # launcher itself says why its workers stopped (utils/torchrun.py), or is what stopped them.
    first_under_torchrun = 'TORCHELASTIC_RUN_ID' in os.environ and not stop.second
    if os.environ.get('RANK', '0') == '0' and not first_under_torchrun:
        print(stop.line, file=sys.stderr, flush=True)
    if sys.stdout is not None:
        sys.stdout.flush()
    if at_once or stop.second:
        os._exit(stop.code)
    raise SystemExit(stop.code) from None


INTERRUPTED = []  # the Ctrl-Cs quiet_interrupts saw
RUNNING = []  # the entry points run_cli is running now (none while modules load)
PROCESS_LIMIT = (
    'error: cannot start another process or thread: the limit on processes of this user is reached (ulimit -u, '
    "or a container's pids limit); raise it, or lower --num_workers (0 reads the data in this process)"
)
STOPPING = []  # the stop signal a training run took up (utils/stopping.py): another one stops it at once
# the stop signals other than Ctrl-C: `kill`, a cluster's pre-emption, SLURM's warning before a time limit
TERMINATING_SIGNALS = tuple(getattr(signal, name) for name in ('SIGTERM', 'SIGUSR1') if hasattr(signal, name))


def quiet_interrupts():
    """Make a Ctrl-C before `run_cli` takes over (while torch loads, say) print one line and exit 130, and
    a SIGTERM or SIGUSR1 before training takes it over (utils/stopping.py), or in eval.py and predict.py,
    print one line (`terminated (SIGTERM)`) and end the process with 128 + its number as its default
    does, but through the `finally` blocks (a run folder just made is removed again). One after a
    training run took up a stop signal (while it writes its last files) is a second one: it stops at once.

    By the time the hook runs the stack has unwound, so every `finally` (e.g. removing a half-generated
    dataset) has already run. A Ctrl-C can also surface as another error: one that lands while a C
    extension initializes (numpy's) leaves it half-loaded, and the next import of it fails with an
    ImportError, or vanish; so any error after a Ctrl-C counts as the interruption, and `run_cli` stops
    before it starts the work.
    """
    default = sys.excepthook
    INTERRUPTED.clear()  # a new start (tests run the entry scripts in one process)
    STOPPING.clear()

    def on_interrupt(signum, frame):
        INTERRUPTED.append(signum)
        if not RUNNING:  # modules are loading: nothing to undo, and an exception raised in Python code
            _interrupted()  # that a C++ extension called (torch's start-up) can abort the process instead
        raise KeyboardInterrupt

    def on_terminate(signum, frame):
        stop = second_stop_signal(signum) if STOPPING else terminated(signum)
        if not RUNNING:  # as above
            _stopped(stop, at_once=True)
        raise stop

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where Ctrl-C is ignored
        signal.signal(signal.SIGINT, on_interrupt)
    for signum in TERMINATING_SIGNALS:  # SLURM's USR1 before a time limit too: by default it ends a process silently
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, on_terminate)

    def hook(kind, value, traceback):
        if issubclass(kind, KeyboardInterrupt) or INTERRUPTED:
            _interrupted()
        default(kind, value, traceback)

    hook.quiets_interrupts = True
    sys.excepthook = hook


def run_cli(main, argv=None):
    """Run an entry point's `main(argv)`, turning mistakes into one `error: ...` line and exit code 2:
    KilnError, an OSError from the file system (disk full, read-only, no permission) and running out
    of memory. With `--debug` on the command line the full traceback is shown instead."""
    argv = sys.argv[1:] if argv is None else argv
    print_names_as_their_bytes()
    if not getattr(sys.excepthook, 'quiets_interrupts', False):  # a script of yours that imported train.py
        quiet_interrupts()
    if INTERRUPTED:  # a Ctrl-C while modules loaded, swallowed on its way
        _interrupted()
    RUNNING.append(main)
    try:
        return _run_reporting_errors(main, argv)
    except StoppedBySignal as stop:  # (with --debug too) every `finally` has run
        _stopped(stop)
    finally:
        RUNNING.pop()


def print_names_as_their_bytes():
    """Printed file names that are no UTF-8 (kept as surrogates by os.listdir, list files, the command
    line) come out as the bytes they were, as `ls` prints them, where the output is UTF-8: Python's
    standard output refused them (UnicodeEncodeError) and the run stopped. In another locale (LC_ALL=C
    without Python's UTF-8 mode) every name not in it is such a name: stderr, which wrote them as
    `\\udcc3\\udca9`, now writes their bytes too, as the standard output does there."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, 'encoding', None) or '').lower().replace('-', '').replace('_', '')
        if hasattr(stream, 'reconfigure') and (
            encoding == 'utf8' or getattr(stream, 'errors', '') == 'backslashreplace'
        ):
            stream.reconfigure(errors='surrogateescape' if encoding == 'utf8' else 'kiln_names_as_bytes')


def _names_as_bytes(error):
    """A codec error handler: surrogates of undecodable bytes written as those bytes, other characters
    the encoding lacks as backslash escapes (what stderr writes them as)."""
    if isinstance(error, UnicodeEncodeError):
        written = (
            bytes([ord(character) - 0xDC00])
            if 0xDC80 <= ord(character) <= 0xDCFF
            else character.encode('ascii', 'backslashreplace')
            for character in error.object[error.start : error.end]
        )
        return b''.join(written), error.end
    return codecs.backslashreplace_errors(error)


codecs.register_error('kiln_names_as_bytes', _names_as_bytes)


def _run_reporting_errors(main, argv):
    if '--debug' in argv:
        return main(argv)
    try:
        result = main(argv)
        if sys.stdout is not None:  # (None: started with its output closed)
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush (exit code 120)
        return result
    except KeyboardInterrupt:
        _interrupted()
    except KilnError as error:
        exit_with_error(f'error: {_one_line(error)}')
    except UnicodeEncodeError as error:  # a name the locale cannot write (LC_ALL=C without Python's UTF-8 mode)
        text, start, end = error.object, error.start, error.end  # the word it is in, as it was given
        word = re.search(r'\S*$', text[:start]).group() + text[start:end] + re.match(r'\S*', text[end:]).group()
        with contextlib.suppress(UnicodeEncodeError):  # the bytes of a command line's word, as they were
            word = word.encode('utf-8', 'surrogateescape').decode('utf-8', 'replace')
        if 'surrogates' in error.reason:  # bytes that are no UTF-8, where only UTF-8 can be written
            exit_with_error(
                f'error: cannot write {word!r}: a name in it has bytes that are no UTF-8; rename it in UTF-8 '
                f'(--debug shows where)'
            )
        utf8 = (  # PYTHONIOENCODING overrides the locale and UTF-8 mode
            'unset PYTHONIOENCODING'
            if os.environ.get('PYTHONIOENCODING')
            else 'run in a UTF-8 locale (export PYTHONUTF8=1, or LC_ALL=C.UTF-8)'
        )
        exit_with_error(
            f'error: cannot write {word.rstrip(":;,.")!r} in the {error.encoding} encoding ({error.reason}); '
            f'{utf8} with names in UTF-8 (--debug shows where)'
        )
    except OSError as error:
        gone = _outputs_gone() if isinstance(error, BrokenPipeError) else []
        if gone:  # the reader of the output left (`| head -1`): stop quietly with SIGPIPE's status, as tools do
            for descriptor in gone:
                os.dup2(os.open(os.devnull, os.O_WRONLY), descriptor)  # Python's last flush must not fail
            raise SystemExit(128 + signal.SIGPIPE) from None
        # a folder to be made where a file is (a path option naming a file): the disk and permissions are fine
        made = error.errno in (errno.EEXIST, errno.ENOTDIR) and isinstance(error.filename, str)
        blocker = file_in_the_way(error.filename) if made else None
        if blocker is not None:
            exit_with_error(
                f'error: {not_a_folder(error.filename, blocker)}; name a folder there instead, or move the file '
                f'away (--debug shows where)'
            )
        if error.errno in (errno.EMFILE, errno.ENFILE):
            exit_with_error(too_many_open_files(system_wide=error.errno == errno.ENFILE))
        if error.errno == errno.EAGAIN:  # fork() at the limit on processes
            exit_with_error(PROCESS_LIMIT)
        if 'No usable temporary directory' in str(error):  # tempfile's words; torch asks it for a cache folder
            exit_with_error(
                f'error: {error.strerror or error}; set TMPDIR to a folder you can write to (--debug shows where)'
            )
        where = f'cannot use {error.filename}: ' if error.filename else ''  # (writes to an open file name none)
        yours = f'fix {"its" if error.filename else "the"} permissions, or give a path of your own'  # (not disk space)
        fix = {
            errno.ENOSPC: 'free disk space',
            errno.EDQUOT: 'free disk space (you are over your quota)',
            errno.EACCES: yours,
            errno.EPERM: yours,
            errno.EROFS: 'give a path on a file system that can be written',
            errno.EPIPE: 'the program reading from it has ended',
            errno.ENOENT: 'check the path (a folder above it is missing, or cannot be made there)',
        }.get(error.errno, 'free disk space or fix the permissions')
        exit_with_error(f'error: {where}{error.strerror or error}; {fix} (--debug shows where)')
    except (MemoryError, RuntimeError) as error:
        if is_peer_lost(error):  # the process that failed says why; this one only went down with it
            # what to do next, where the code that met the error knows (a training run's: resume)
            advice = '; '.join(getattr(error, '__notes__', ())) or 'its own error says why'
            exit_with_error(
                f'error: another process of this torchrun job is gone ({_one_line(error)[:160]}); {advice} '
                f'(--debug shows where)',
                code=PEER_LOST_EXIT_CODE,
            )
        if 'Too many open files' in str(error):  # DataLoader workers hand batches over in file descriptors
            exit_with_error(too_many_open_files())
        if "can't start new thread" in str(error):  # threads count against the limit on processes
            exit_with_error(PROCESS_LIMIT)
        if 'DataLoader worker' in str(error) and any(text in str(error) for text in WORKER_LOST):
            advice = (  # (a worker that could not hand over its batch said why in a line above)
                'often the out-of-memory killer (see `dmesg`): lower --num_workers or --batch_size'
                if 'signal: Killed' in str(error)
                else 'if no line above says why, shared memory may be too small (/dev/shm: free it, or docker run '
                '--shm-size 2g); --num_workers 0 reads the data in this process'
            )
            exit_with_error(f'error: {_one_line(error).split(". ")[0].rstrip(".")}; {advice} (--debug shows where)')
        if 'does not have a deterministic implementation' in str(error):  # torch's refusal under --deterministic
            exit_with_error(
                f'error: --deterministic: {str(error).split(",")[0]}; run without --deterministic, or replace '
                f'that operation in your model (--debug shows where)'
            )
        if not is_out_of_memory(error):
            raise
        exit_with_error('error: out of memory; lower --batch_size or --img_size (--debug shows where)')
    except ValueError as error:
        if 'Expected more than 1 value per channel when training' not in str(error):
            raise
        exit_with_error(  # torch's BatchNorm, on a batch of one image whose feature map has shrunk to 1x1
            "error: BatchNorm cannot train on one value per channel (a batch, or a process's share of one, of 1 "
            'image whose feature map is 1x1); give --batch_size 2 or more (and data of 2 images a process or more), '
            'or a larger --img_size (--debug shows where)'
        )


def too_many_open_files(system_wide=False):
    """The error line for a process out of file descriptors (`system_wide`: the system's table is full):
    the limit, and how to raise it where it can be raised."""
    import resource  # (here: not every platform has it)

    if system_wide:
        return (
            'error: the system has too many open files (all processes together); close other programs or lower '
            '--num_workers (--debug shows where)'
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(max(4096, soft * 4), hard)
    fix = (  # the hard limit is the most a process may ask for (set by the system, a container, `ulimit -n`)
        f'raise the limit (ulimit -n {wanted}) or lower --num_workers'
        if wanted > soft
        else f'{soft} is the most this system allows a process here: lower --num_workers'
    )
    return f'error: too many open files (this process may open {soft}); {fix} (--debug shows where)'


def _outputs_gone():
    """The file descriptors of standard output and error that are pipes whose reader has closed them."""
    gone = []
    for stream in (sys.stdout, sys.stderr):
        try:
            poller = select.poll()
            poller.register(stream.fileno(), select.POLLOUT)
            gone += [descriptor for descriptor, events in poller.poll(0) if events & select.POLLERR]
        except (OSError, ValueError, AttributeError):  # no file descriptor (captured output), no poll
            pass
    return gone


def run_to_exit(main, argv=None):
    """An entry script's last line: `run_cli(main, argv)`, then the end of the process.

    A torchrun worker (WORLD_SIZE > 1) ends with `os._exit` once the other threads it started, the
    atexit handlers and its output are done, skipping the interpreter's teardown: DistributedDataParallel
    keeps the gloo process group and its threads alive after destroy_process_group, and a gloo thread that
    lets go of a collective's tensor during the teardown aborts the process ("terminate called without
    an active exception", SIGABRT) after a run that succeeded. Elsewhere Python exits as usual."""
    if int(os.environ.get('WORLD_SIZE', '1')) <= 1:
        run_cli(main, argv)
        return
    try:
        run_cli(main, argv)
        status = 0
    except SystemExit as exit:
        status = exit.code
    except BaseException:  # noqa: BLE001 - shown as Python would (--debug, or an unexpected error)
        sys.excepthook(*sys.exc_info())
        status = 1
    if not isinstance(status, int):  # sys.exit(None) is success, sys.exit('text') prints it and fails
        if status is not None:
            print(status, file=sys.stderr)
        status = 0 if status is None else 1
    # what Python's exit does, in its order: threading's exit hooks (they stop idle thread pools, such as
    # torch.compile's, whose threads a plain join waits for forever), the join of every non-daemon thread,
    # then the atexit handlers
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
