"""Run folders: experiment folders (made, locked, reopened by --resume) and the result folders of
eval.py and predict.py (what a run writes about itself is utils/run_records.py).

Nothing a user has is overwritten: a new run never reuses a folder, a resumed run refuses options
that would change what it computes before it touches any file, and a folder is locked while a run
uses it.
"""

import contextlib
import errno
import fcntl
import filecmp
import glob
import hashlib
import itertools
import os
import re
import shutil
import socket
import time

import yaml

from options import (
    DERIVED,
    NONE,
    NOT_SAVED,
    RESUME_CHANGEABLE,
    Options,
    as_trained,
    experiment_folder,
    given_options,
    parse_args,
    parse_train_args,
    resolve,
    with_absolute_paths,
)
from utils.checkpoint import TEMPORARY, load_checkpoint, process_running, sync_directory
from utils.checkpoint_keeper import BEST, LAST, CheckpointKeeper, remove_stale_temporaries, step_of, verify
from utils.distributed import is_main_process, world_size
from utils.errors import KilnError, StoppedBySignal, file_in_the_way, is_a_file, listed
from utils.fault_points import fault_point
from utils.run_records import ARGS_TXT, ARGS_YAML, save_args

LOCK = '.lock'
RESULT_FILES = ('result.json', 'predictions.csv')  # what eval.py and predict.py write (beside their args files)
# what a run writes into its folder by itself: removed again when a new run fails before its first checkpoint
RUN_FILES = (
    ARGS_TXT,
    ARGS_YAML,
    LOCK,
    'run_config.json',
    'reproduce.json',
    'history.json',
    'checkpoints.json',
    'load_report.json',
    'metrics.csv',
)
RUN_FOLDERS = ('wandb',)  # the same, folders: W&B's run files (offline, or its local copy)


def make_parents(path):
    """Create the missing folders above `path`; return those it made, deepest first."""
    made, parent = [], os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(parent) and parent != os.path.dirname(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return made


def create_run_folder(folder, args, what_to_change, where_option='--checkpoints_dir', exists_ok=False):
    """Create a new run folder, lock it (before anything is written in it: a --resume started at the same
    moment finds it in use) and save the options in it; returns the FolderLock. An existing one is a
    KilnError saying `what_to_change` (None with `exists_ok`), one that cannot be made names `where_option`.
    A folder whose options could not be written (a full disk) is removed again."""
    made = []
    try:
        made = make_parents(folder)
        os.mkdir(folder)  # fails if it exists: two runs never share a folder
    except OSError as error:
        if exists_ok and isinstance(error, FileExistsError) and os.path.isdir(folder):
            return None
        raise cannot_create(folder, error, what_to_change, where_option) from None
    try:
        lock = FolderLock(folder)  # refused: a --resume took the folder in the moment since mkdir; it is theirs
    except OSError:
        with discard_folder_if_setup_fails(folder, made):  # a full disk: the new folder goes again
            raise
    lock.made_parents = made  # a run that fails to start removes them too, while empty
    with discard_folder_if_setup_fails(folder, made):
        save_args(args, folder)
    return lock


NAME_MAX = 255  # bytes in a file or folder name, on every common file system


def cannot_create(folder, error, what_to_change, where_option):
    """The KilnError for an OSError making the folder `folder` or its parents: one that exists is
    `what_to_change`, a file on the way (a parent, or `folder` itself) names `where_option`."""
    blocker = file_in_the_way(folder) if error.errno in (errno.EEXIST, errno.ENOTDIR) else None
    if blocker is not None and blocker != os.path.normpath(folder):  # a parent is a file: not "already exists"
        return KilnError(f'{blocker} {is_a_file(blocker)}; give a folder you can write to as {where_option}')
    if isinstance(error, FileExistsError) and os.path.lexists(folder):
        return KilnError(f'{folder} already exists; {what_to_change}')
    name = os.fsencode(os.path.basename(os.path.normpath(folder)))
    if error.errno == errno.ENAMETOOLONG and len(name) > NAME_MAX:
        return KilnError(
            f'cannot create {folder}: its name is {len(name)} bytes, above the {NAME_MAX} a file system takes; '
            f'give a shorter --save_prefix (or folder name)'
        )
    return KilnError(f'cannot create {folder} ({error.strerror}); give a folder you can write to as {where_option}')


def shown_value(value):
    """An option's value as the command line writes it: `none` for unset, lists as their words."""
    if value is None:
        return NONE
    return ' '.join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


@contextlib.contextmanager
def discard_folder_if_setup_fails(folder, made_parents=()):
    """Remove a just-created run folder again if what follows fails, so the same command can be re-run,
    and the folders made above it for it (`made_parents`, deepest first) while they are empty.

    Only what runs write by themselves (RUN_FILES, RUN_FOLDERS, TensorBoard event files) is removed, and
    only while the folder holds no checkpoint; a folder holding anything else is left alone.
    """
    try:
        yield
    except BaseException as error:
        names = os.listdir(folder) if os.path.isdir(folder) else []
        if not any(step_of(name) is not None for name in names):
            if isinstance(error, StoppedBySignal):  # not 'continue with --resume'
                error.nothing_saved()
            for name in names:
                path = os.path.join(folder, name)
                if name in RUN_FOLDERS and os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif name in RUN_FILES or name.startswith(('events.out.tfevents.', '.')):
                    with contextlib.suppress(OSError):
                        os.remove(path)
        with contextlib.suppress(OSError):
            for empty in (folder, *made_parents):
                os.rmdir(empty)  # only succeeds when nothing else is in it
        raise


BEING_STAGED = set()  # this process's: a folder of its pid is another's (a container reuses pids) unless here


class PublishedTogether:
    """StagedResults that appear all or none (eval.py's comparison of several checkpoints): `enter_context`
    adds one. When the block ends well, each is made durable and its name checked free before the first is
    renamed into place (the last added first), and those renamed are taken back when a later one fails;
    when the block fails, all are discarded."""

    def __init__(self):
        self.staged = []

    def __enter__(self):
        return self

    def enter_context(self, staged):
        self.staged.append(staged)
        return staged

    def __exit__(self, kind, error, trace):
        staged, published = self.staged[::-1], []
        try:
            if kind is None:
                for one in staged:
                    one.make_durable()
                for one in staged:
                    one.rename_into_place()
                    published.append(one)
                return
        except BaseException:
            for one in published:
                with contextlib.suppress(OSError):
                    one.take_back()
            raise
        finally:
            if len(published) < len(staged):
                for one in staged:
                    one.discard()


class StagedResults:
    """A new result folder (eval.py's, predict.py's, a comparison's) that appears whole or not at all.

    It is written under a hidden name beside its own, `path` (`.<name>.tmp<pid>@<host>`), with the
    options saved first, and renamed to `folder` once every file in it is written (wait for the writer
    thread first) and fsynced: `publish`, when a `with` block on it ends well. When the block fails or
    is stopped (Ctrl-C, SIGTERM), it is removed with the folders made for it (`discard`); one left by
    a SIGKILL is removed by the next StagedResults beside it once its process is gone. An existing
    `folder` is a KilnError saying `what_to_change`, up front and again at the rename (which never
    replaces a folder); one that cannot be made names `where_option`. Whatever names the folder in the
    results (args.txt's result_dir, printed paths) names `folder`, never `path`.
    """

    def __init__(self, folder, args, what_to_change, where_option='--output_dir'):
        self.folder, self.what_to_change, self.made = folder, what_to_change, []
        parent, name = os.path.split(folder)
        if len(os.fsencode(name)) > NAME_MAX:  # said now, not when the finished results are renamed to it
            raise cannot_create(folder, OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG)), '', '')
        staged = f'.{name}.tmp{os.getpid()}@{socket.gethostname()}'
        if len(os.fsencode(staged)) > NAME_MAX:  # a name near the file system's limit: its digest stands for it
            staged = f'.{hashlib.sha256(os.fsencode(name)).hexdigest()[:16]}.tmp{os.getpid()}@{socket.gethostname()}'
        self.path = os.path.join(parent, staged)
        if os.path.lexists(folder):
            raise KilnError(f'{folder} already exists; {what_to_change}')
        try:
            self.made = make_parents(folder)
            remove_stale_results(os.path.dirname(os.path.abspath(folder)))
            os.mkdir(self.path)
            BEING_STAGED.add(os.path.abspath(self.path))
        except OSError as error:
            self.discard()
            raise cannot_create(folder, error, what_to_change, where_option) from None
        with self.discarded_if_failing():
            save_args(args, self.path)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if kind is not None:
            self.discard()
            return
        with self.discarded_if_failing():
            self.publish()

    @contextlib.contextmanager
    def discarded_if_failing(self):
        """Discard the folder when the block fails (then the error goes on)."""
        try:
            yield
        except BaseException:
            self.discard()
            raise

    def publish(self):
        """fsync every file and folder written, then rename the folder to its name."""
        self.make_durable()
        self.rename_into_place()

    def make_durable(self):
        """fsync every file and folder written; a KilnError when its name was taken meanwhile."""
        for root, _, names in os.walk(self.path):
            for name in [*names, '']:  # its files, then the folder itself
                sync_directory(os.path.join(root, name))
        fault_point('results_staged')
        self.refuse_if_taken()

    def refuse_if_taken(self):
        # os.rename replaces an empty folder: one that appeared since the start is refused, not replaced
        if os.path.lexists(self.folder):
            raise KilnError(f'{self.folder} appeared while this ran; {self.what_to_change}')

    def rename_into_place(self):
        """Rename the (durable) folder to its name, which must still be free."""
        self.refuse_if_taken()
        try:
            os.rename(self.path, self.folder)
        except OSError as error:  # a folder that appeared and was filled in the instant between
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise KilnError(f'{self.folder} appeared while this ran; {self.what_to_change}') from None
        BEING_STAGED.discard(os.path.abspath(self.path))
        sync_directory(os.path.dirname(os.path.abspath(self.folder)))

    def take_back(self):
        """Undo `rename_into_place` (of results published with others, one of which failed), and discard."""
        os.rename(self.folder, self.path)
        self.discard()

    def discard(self):
        """Remove the unfinished folder and the folders made for it (eval/, --output_dir's) while empty."""
        shutil.rmtree(self.path, ignore_errors=True)
        BEING_STAGED.discard(os.path.abspath(self.path))
        with contextlib.suppress(OSError):
            for parent in self.made:
                os.rmdir(parent)


def remove_stale_results(parent):
    """Remove the staged result folders in `parent` that a SIGKILL left: this host's whose process is
    gone (a running one's are left alone, as are other hosts': their processes cannot be seen)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        match, path = TEMPORARY.fullmatch(name), os.path.join(parent, name)
        if not match or match.group(3) != socket.gethostname():
            continue
        pid = int(match.group(2))
        if os.path.abspath(path) in BEING_STAGED or (pid != os.getpid() and process_running(pid)):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


def remove_unused_runs(parent, keep):
    """Remove the run folders in `parent` but `keep` that no process uses (--fast_dev_run's throwaway
    folders: the newest stays, to look at). A folder whose args.yaml says no fast_dev_run (a run of yours
    given this --checkpoints_dir) is left alone."""
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        try:  # (a link, or one another run removes at the same moment: left alone)
            if os.path.islink(path) or os.path.samefile(path, keep) or not made_by_fast_dev_run(path):
                continue
            FolderLock.refuse_if_held(path)
        except (OSError, KilnError):  # KilnError: in use, by its training or its eval.py and predict.py
            continue
        shutil.rmtree(path, ignore_errors=True)


def made_by_fast_dev_run(folder):
    """Whether the run folder `folder` is a --fast_dev_run's: its args.yaml says so (one without it, killed
    before writing it, is a run's that holds nothing yet)."""
    if not os.path.exists(os.path.join(folder, ARGS_YAML)):
        return os.path.isfile(os.path.join(folder, LOCK))
    try:
        with open(os.path.join(folder, ARGS_YAML)) as f:
            return (yaml.safe_load(f) or {}).get('fast_dev_run') is True
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        return False


class FolderLock:
    """An advisory lock on a run folder, held while a run uses it and released when its process ends
    (however it ends): a second run of the same folder is refused with the PID holding it. A POSIX
    record lock (lockf), not flock: forked DataLoader workers do not inherit it, so a resume is not
    refused in the moment they take to notice that a killed run is gone."""

    def __init__(self, folder):
        self.made_parents = ()  # the folders made above a new run's folder (create_run_folder)
        self.path = os.path.join(folder, LOCK)
        self.file = open(self.path, 'a+')
        _lock_or_refuse(self.file, fcntl.LOCK_EX, folder)
        try:
            self.file.seek(0)
            self.file.truncate()
            self.file.write(f'process {os.getpid()} on {socket.gethostname()}')
            self.file.flush()
        except OSError as error:  # a full disk: said with the file's name (a write to an open file names none)
            with contextlib.suppress(OSError):  # (closing flushes again, and fails again, but closes)
                self.file.close()
            raise OSError(error.errno, error.strerror, self.path) from None

    def release(self):
        """Give the folder back (also happens when the process ends)."""
        self.file.close()

    @staticmethod
    def refuse_if_held(folder):
        """The KilnError of a folder in use, found without writing anything (a shared lock tried on its
        lock file, opened to read): before a resume reads checkpoints that the running process may prune."""
        with contextlib.suppress(FileNotFoundError), open(os.path.join(folder, LOCK)) as file:
            _lock_or_refuse(file, fcntl.LOCK_SH, folder)


NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # a file system without POSIX locks (NFS with nolock)


def _lock_or_refuse(file, kind, folder):
    """Take a POSIX record lock of `kind` on `file` at once, or raise the KilnError naming its holder. On a
    file system without locks the run goes on unlocked, and an exclusive lock says so."""
    try:
        fcntl.lockf(file, kind | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in NO_LOCKS:
            if kind == fcntl.LOCK_EX:
                print(
                    f'note: {folder} cannot be locked ({error.strerror}: its file system has no POSIX locks), so '
                    f'a second run started in it meanwhile would not be refused'
                )
            return
        if error.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        file.seek(0)
        holder = file.read().strip() or 'another process'
        file.close()
        raise KilnError(f'{folder} is in use by {holder}; wait for that run to end or stop it') from None


def open_experiment(argv, args):
    """Make the experiment folder of a new run, or reopen it with --resume; lock it. `args` are the
    options of `argv`, resolved (options.resolve). Returns (the run's options, with model_dir and
    resume_from, the FolderLock).

    With --resume the run continues from its newest trustworthy checkpoint (or the file named, or the
    newest of the experiment folder named): the options that checkpoint was trained with apply first
    (the folder's args.yaml before its first checkpoint), then the flags given now, and a flag that would
    change what the run computes (anything but RESUME_CHANGEABLE), another --checkpoints_dir than the
    folder's or another number of processes is refused before any file is touched; newer checkpoints
    than the one resumed are set aside. With nothing to continue yet, --resume starts the run there.
    """
    folder = experiment_folder(args)
    named = args.resume if args.resume and args.resume != 'last' else None  # a checkpoint file, or a folder
    named_folder = named and os.path.isdir(named)
    if named_folder:  # an experiment folder: its options and newest trustworthy checkpoint
        results = [name for name in RESULT_FILES if os.path.isfile(os.path.join(named, name))]
        missing = [name for name in (ARGS_YAML, ARGS_TXT) if not os.path.isfile(os.path.join(named, name))]
        checkpoints = not results and any(step_of(name) is not None for name in os.listdir(named))
        if missing and checkpoints:  # a run copied without its records (scp run/*.pth)
            raise KilnError(
                f"--resume {named}: its checkpoints have no {missing[0]} beside them; copy the run's "
                f'{ARGS_YAML} and {ARGS_TXT} into it (or start a new run from its weights with --load_model_path)'
            )
        if results or missing:  # (a folder of yours with an args.yaml, an eval.py result folder: not trained in)
            why = f'it holds {results[0]}: results of eval.py or predict.py' if results else f'it has no {missing[0]}'
            raise KilnError(
                f'--resume {named}: not an experiment folder ({why}); give the folder a training run made, or '
                f'one of its .pth files'
            )
        folder, named = os.path.abspath(named), None
    elif named:
        if not os.path.isfile(named):
            raise KilnError(
                f'--resume {named}: no such checkpoint file or experiment folder; give an existing .pth file '
                f"or experiment folder, or --resume alone for the experiment's newest checkpoint"
            )
        folder = os.path.dirname(os.path.abspath(named))
    # (as a flag: a --config's is the run's record, e.g. its own args.yaml from before it was moved)
    if (named or named_folder) and 'checkpoints_dir' in given_options(parse_train_args, argv, config=False):
        if os.path.abspath(args.checkpoints_dir) != os.path.dirname(folder):  # it was ignored, and recorded
            raise KilnError(
                f'--checkpoints_dir {args.checkpoints_dir}: --resume {args.resume} continues the run in its own '
                f'folder {folder}; drop --checkpoints_dir (to move a run, move its folder and resume it there)'
            )
    if args.resume == 'last':  # --resume alone: the folder its options name
        _refuse_another_run_than_the_configs(argv, args, folder)
    if args.resume and not named and not os.path.isdir(folder):
        _refuse_a_run_left_in_the_working_folder(argv, folder)
    if not args.resume or not os.path.isdir(folder):
        lock = create_run_folder(
            folder,
            args,
            'choose a new --save_prefix, add --resume to continue that run, or move that folder away',
            exists_ok=bool(args.resume),  # made by another --resume just now: reopened as any existing one, below
        )
        if lock is not None:  # a new run, with --resume or not: a failed start removes its folder (train_in_group)
            return args.replace(model_dir=folder, resume_from=None, resume=None), lock
    # read-only checks first: a refused resume touches no file (not even the lock's)
    FolderLock.refuse_if_held(folder)  # a running process may prune the checkpoint about to be read
    if named:
        verify(named)  # (the newest is found by its checksum)
    resume_from = named or _newest_checkpoint(folder)
    saved = os.path.join(folder, ARGS_YAML)
    if resume_from and not os.path.isfile(saved):
        raise KilnError(
            f'{resume_from} has no {ARGS_YAML} beside it; --resume needs the checkpoint inside its experiment '
            f"folder: copy the run's {ARGS_YAML} and {ARGS_TXT} into {folder} (or start a new run from its "
            f'weights with --load_model_path)'
        )
    checkpoint = load_checkpoint(resume_from, mmap=True) if resume_from else {}  # tensors left in the file
    if resume_from or named_folder:  # a folder named alone has its options, even before its first checkpoint
        # the checkpoint's own options, not args.yaml's: a file anyone can edit, or empty after a power cut
        trained = checkpoint.get('args')
        base = saved  # args.yaml, before the first checkpoint
        if isinstance(trained, dict):
            base = as_trained({k: v for k, v in trained.items() if k not in DERIVED})
        merged = parse_args(parse_train_args, argv, base_config=base)
        if merged.fast_dev_run:  # trained on in its folder, it would go with the next --fast_dev_run's clean-up
            raise KilnError(
                f'--resume {resume_from or folder}: a --fast_dev_run check, in a throwaway folder; start a real '
                f'run (from its weights: --load_model_path {resume_from or folder})'
            )
        _refuse_changes(parse_args(parse_train_args, [], base_config=base), merged, folder)
        args = resolve(merged)
        _refuse_other_world_size(checkpoint, resume_from)
    if not os.access(folder, os.W_OK | os.X_OK):  # said now, not at the first write after training up to it
        why = 'Read-only file system' if os.statvfs(folder).f_flag & os.ST_RDONLY else 'Permission denied'
        raise KilnError(
            f"cannot write in {folder} ({why}): --resume goes on in the run's own folder; make it writable, or "
            f'copy the folder to a place of yours and resume the copy'
        )
    lock = FolderLock(folder)
    try:
        if not resume_from:
            print(f'{folder} holds no checkpoint yet; starting the run in it')
        remove_stale_temporaries(folder)  # (its args.txt and args.yaml are written once the Trainer is built)
    except BaseException:
        lock.release()
        raise
    return args.replace(model_dir=folder, resume_from=resume_from), lock


def _refuse_another_run_than_the_configs(argv, args, folder):
    """A KilnError when --resume alone, with a run's own args.yaml as --config (and no flag that names the
    folder), would continue `folder`, another run than that record's: the run was moved, copied or renamed
    since it was saved, and its options still name the place it was trained in (where the original, or
    nothing, is)."""
    config = getattr(args, 'config', None)
    if not config or os.path.basename(config) != ARGS_YAML:
        return
    home = os.path.dirname(os.path.abspath(config))
    naming = {'checkpoints_dir', 'save_prefix', 'model_type', 'data_type', 'task'}
    if naming & given_options(parse_train_args, argv, config=False) or not os.path.isfile(os.path.join(home, ARGS_TXT)):
        return
    if os.path.realpath(folder) != os.path.realpath(home):
        raise KilnError(
            f'--config {config} is the record of the run in {home}, but --resume alone continues {folder}, '
            f'where its options say the run was (moved or copied since?); give --resume {home}'
        )


def resumed_on_cpu(args, argv):
    """Whether a torchrun process should join a CPU group: --cpu given (or not: --no-cpu) in `argv`, else
    as the run that --resume continues was trained, its args.yaml says. Processes join their group before
    the options are merged with the run's: on a GPU machine they joined one of GPUs for a CPU run (or were
    refused, with fewer GPUs than processes), though the line the run printed to continue it was given."""
    if not args.resume or 'cpu' in given_options(parse_train_args, argv):
        return bool(args.cpu)
    named = os.path.abspath(args.resume) if args.resume != 'last' else None
    try:
        folder = named if named and os.path.isdir(named) else os.path.dirname(named) if named else None
        with open(os.path.join(folder or experiment_folder(resolve(args)), ARGS_YAML)) as f:
            return (yaml.safe_load(f) or {}).get('cpu') is True
    except (OSError, ValueError, KilnError, yaml.YAMLError, AttributeError):  # open_experiment says what is wrong
        return False


def _refuse_a_run_left_in_the_working_folder(argv, folder):
    """A KilnError when `--resume` alone would start `folder` anew while the working folder's checkpoints/
    holds a run of that name: the default --checkpoints_dir was the working folder's before it became the
    project's, and a run started then is meant."""
    if 'checkpoints_dir' in given_options(parse_train_args, argv):
        return
    left = os.path.abspath(os.path.join('checkpoints', os.path.basename(folder)))
    if left != os.path.abspath(folder) and os.path.isdir(left):
        raise KilnError(
            f"--resume: {left} holds this run, not {folder} (the default --checkpoints_dir is the project's "
            f'checkpoints/ now); add --checkpoints_dir checkpoints to continue it, or move it there'
        )


def set_aside_newer(folder, step):
    """Move the checkpoints of steps after `step` (a resume from an older checkpoint, or past corrupt newer
    ones, abandons them) into `<folder>/superseded/step<step>_<time>/`: kept, but never taken for the
    resumed run's own (its saves would be pruned as older than them, and a later resume would take them).
    last.pth and best.pth go with them when they are theirs."""
    newer = sorted(name for name in os.listdir(folder) if (step_of(name) or 0) > step)
    if not newer:
        return
    aside = base = os.path.join(folder, 'superseded', f'step{step}_{time.strftime("%Y%m%d_%H%M%S")}')
    for number in itertools.count(1):  # a folder of its own: an earlier resume's of that second stays whole
        try:
            os.makedirs(aside)
            break
        except FileExistsError:
            aside = f'{base}_{number}'
    theirs = [os.path.join(folder, name) for name in newer]
    for link in (LAST, BEST):
        path = os.path.join(folder, link)
        # a hard link to one of them, or a copy (a file system without links, a folder copied without them)
        if os.path.isfile(path) and any(
            os.path.samefile(path, other) or filecmp.cmp(path, other, False) for other in theirs
        ):
            os.replace(path, os.path.join(aside, link))
    for name in newer:
        os.replace(os.path.join(folder, name), os.path.join(aside, name))
    print(f'resuming from step {step}: the newer checkpoints {", ".join(newer)} are moved to {aside}')


def _newest_checkpoint(folder):
    """The checkpoint a --resume without a file continues from: the folder's newest whose bytes check out
    (None when it has none yet; a KilnError when it has some and none checks out: starting over in the
    folder would bury them under a new run)."""
    path, skipped = CheckpointKeeper(folder, restore=False).newest_trusted()  # before the lock: reads only
    if path is None and skipped:
        raise KilnError(
            f'{folder}: none of its {len(skipped)} checkpoints can be trusted ({"; ".join(skipped)}); move '
            f'them out of the folder to start the run again there, or resume from a copy of the run'
        )
    for reason in skipped:
        print(f'skipping {os.path.join(folder, reason)}')
    return path


def _refuse_other_world_size(checkpoint, source):
    """A KilnError when `checkpoint` was trained by another number of processes than run now: its place in
    the data counts global batches of that many processes' samples, so a resume would train some twice."""
    trained_by = len(checkpoint.get('rng', {}).get('per_rank', ())) or world_size()
    if trained_by != world_size():
        raise KilnError(
            f'{source} was trained by {trained_by} process{"es" if trained_by > 1 else ""}, this run has '
            f'{world_size()}; resume it with {trained_by} (python -m utils.torchrun --standalone '
            f'--nproc-per-node={trained_by} train.py --resume ...), so that no sample is trained twice or skipped'
        )


def _refuse_changes(saved, merged, folder):
    """A KilnError naming the options whose new values differ from the resumed run's (list files compared
    as absolute paths: the run saved them so)."""
    saved, merged = with_absolute_paths(Options.of(saved)), with_absolute_paths(Options.of(merged))
    changed = [
        name
        for name, value in vars(merged).items()
        if name not in RESUME_CHANGEABLE + NOT_SAVED + DERIVED and getattr(saved, name, value) != value
    ]
    if changed:
        had = {name: 'none' if getattr(saved, name) is None else getattr(saved, name) for name in changed}
        shown = ', '.join(
            f'--{name} {shown_value(getattr(merged, name))} (the run has {shown_value(had[name])})' for name in changed
        )
        raise KilnError(
            f'{shown}: a resumed run keeps the options that decide what it computes; drop '
            f'{"it" if len(changed) == 1 else "them"}, or start a new run with --save_prefix. A resume may '
            f'change only: {", ".join("--" + name for name in RESUME_CHANGEABLE)} (folder {folder})'
        )


def checkpoint_path(path, several=False):
    """A checkpoint given on the command line: a file as it is, an experiment folder as its best.pth (a
    folder of experiments is refused, naming them; with `several`, eval.py's, saying how to give them all)."""
    resolved = os.path.join(path, BEST) if os.path.isdir(path) else path
    if not os.path.isfile(resolved):
        last = os.path.join(path, LAST)
        if os.path.isdir(path) and os.path.isfile(last):  # stopped before its first validation, say
            raise KilnError(f'{path} has no {BEST} yet; give its {LAST} instead: --load_model_path {last}')
        holds = os.listdir(path) if os.path.isdir(path) else []
        runs = sorted(name for name in holds if os.path.isfile(os.path.join(path, name, BEST)))
        if runs:  # the checkpoints folder itself
            glob_of_them = f", or a quoted glob such as '{os.path.join(path, '*')}' to compare them" if several else ''
            raise KilnError(
                f'{path} is no experiment folder but holds {len(runs)} ({listed(runs, 3)}): give one of them'
                f'{glob_of_them}'
            )
        raise KilnError(f'checkpoint {resolved} does not exist; check --load_model_path')
    return resolved


CHECKPOINT_SUFFIXES = ('.pth', '.pt', '.ckpt', '.bin', '.safetensors', '.tar')  # files a glob may name


def checkpoints_to_evaluate(paths, config=None):
    """The checkpoint files named by eval.py's --load_model_path, in order, each once: files as they are,
    experiment folders as their best.pth, globs (e.g. 'checkpoints/*') expanded, what a glob matches that
    is no checkpoint left out (folders without args.yaml, such as Kiln's comparisons/, and files without a
    checkpoint's suffix, such as notes.txt; runs with no best.pth yet, with a note). A path that exists
    is taken as it is, wildcards or not (--save_prefix 'exp[1]' makes a folder whose name is one).
    Without paths, the experiment whose args.yaml is the --config file `config`."""
    run = os.path.dirname(os.path.abspath(config)) if config and os.path.basename(config) == ARGS_YAML else None
    if not paths and run and any(os.path.isfile(os.path.join(run, link)) for link in (BEST, LAST)):
        paths = [run]
    if not paths:
        raise KilnError(
            'no checkpoint to evaluate; give --load_model_path PATH (e.g. checkpoints/<experiment>/best.pth)'
        )
    found = []
    for item in paths:
        pattern = glob.has_magic(item) and not os.path.exists(item)
        matches = sorted(glob.glob(item, recursive=True)) if pattern else [item]  # (** for any depth)
        if pattern:
            matches = [
                m
                for m in matches
                if os.path.isfile(os.path.join(m, ARGS_YAML))
                and not any(os.path.isfile(os.path.join(m, name)) for name in RESULT_FILES)  # (** reaches eval/)
                or os.path.isfile(m)
                and m.lower().endswith(CHECKPOINT_SUFFIXES)
            ]
            unready = [m for m in matches if os.path.isdir(m) and not os.path.isfile(os.path.join(m, BEST))]
            for folder in unready if is_main_process() else ():  # a run not validated yet: the others compared
                print(f'note: {folder} has no {BEST} yet: left out (give its {LAST} to compare it)', flush=True)
            matches = [m for m in matches if m not in unready]
        if not matches:
            raise KilnError(
                f'--load_model_path {item} matches no checkpoint (an experiment folder with a {BEST}, or a '
                f'{", ".join(CHECKPOINT_SUFFIXES)} file)'
            )
        found += [checkpoint_path(match, several=True) for match in matches]
    unique, seen = [], set()
    for path in found:  # a file named twice (a folder and its best.pth, say) is evaluated once
        if os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            unique.append(path)
    return unique


def evaluated_list_name(val_list):
    """What result folders call the evaluated list: the --val_list file name (plain_name), or `val` for the
    default split."""
    return plain_name(val_list) if val_list else 'val'


def plain_name(path):
    """The file or folder name of `path` without extension, in letters, digits, '.', '_' and '-' only (a
    folder named after it pastes into a shell without quotes)."""
    name = os.path.splitext(os.path.basename(os.path.normpath(os.path.abspath(path))))[0]
    return re.sub(r'[^\w.-]+', '_', name).strip('_') or 'input'


def result_folder(checkpoint, kind, source_name, save_prefix, output_dir=None):
    """Where evaluating (kind 'eval') or predicting with (kind 'predict') `checkpoint` writes:
    `<its folder>/<kind>/<checkpoint>_<source_name>_<save_prefix>`, or with `output_dir` (--output_dir)
    `<output_dir>/<its folder's name>/<kind>/...` (so checkpoints of several experiments keep apart)."""
    checkpoint_name = os.path.splitext(os.path.basename(checkpoint))[0]
    folder = os.path.dirname(os.path.abspath(checkpoint)) if output_dir else os.path.dirname(checkpoint)
    base = os.path.join(output_dir, os.path.basename(folder)) if output_dir else folder
    return os.path.join(base, kind, f'{checkpoint_name}_{source_name}_{save_prefix}')
