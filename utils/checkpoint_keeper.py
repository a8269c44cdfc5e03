"""Which checkpoint files an experiment folder keeps, and which of them can be trusted.

Each save writes `epoch<E>_step<S>.pth` whole (atomic, fsynced), then points `last.pth` (and
`best.pth` when the monitored metric improved) at it as hard links, records the file with its
SHA-256 in `checkpoints.json`, and only then deletes files that fell out of the newest `keep_last`
and best `keep_best`. The record is a convenience: a missing or corrupt one is rebuilt from the
files, and a resume takes the newest checkpoint whose bytes check out, whatever `last.pth` says.
"""

import contextlib
import json
import math
import os
import re
import time

from utils.checkpoint import SameFolder, atomic_write_json, checksum, load_checkpoint, save_checkpoint
from utils.errors import KilnError
from utils.fault_points import fault_point

RECORD = 'checkpoints.json'
LAST, BEST = 'last.pth', 'best.pth'
NAME = re.compile(r'^epoch(\d+)_step(\d+)\.pth$')


def checkpoint_name(epoch, step):
    """The file name of the checkpoint after `epoch` epochs and `step` optimizer steps."""
    return f'epoch{epoch:03d}_step{step:07d}.pth'


def step_of(name):
    """The optimizer step in a checkpoint file name, or None for other names."""
    match = NAME.match(name)
    return int(match.group(2)) if match else None


def _link_or_copy(source, target):
    """Make `target` a hard link to `source` (a copy where links are not supported), atomically."""
    temporary = os.path.join(os.path.dirname(target), f'.{os.path.basename(target)}.tmp{os.getpid()}')
    try:
        try:
            os.link(source, temporary)
        except OSError:  # e.g. a file system without hard links
            with open(source, 'rb') as f:
                data = f.read()
            with open(temporary, 'wb') as f:
                f.write(data)
        os.replace(temporary, target)
    except BaseException:
        if os.path.lexists(temporary):
            os.remove(temporary)
        raise


STALE_TEMPORARY = re.compile(r'\..+\.tmp\d+(@.+)?')  # `.<name>.tmp<pid>[@<host>]`: a save's or a link's


def remove_stale_temporaries(folder):
    """Delete the temporary files of saves that a kill interrupted (call it while holding the folder's lock):
    Kiln's own names alone (a `.notes.tmp` of yours stays)."""
    for name in os.listdir(folder):
        if STALE_TEMPORARY.fullmatch(name):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))


def set_aside(folder, name):
    """Move the file `name` of `folder` into `<folder>/superseded/unrecorded/` (a name there already: numbered)."""
    aside = os.path.join(folder, 'superseded', 'unrecorded')
    os.makedirs(aside, exist_ok=True)
    target, number = os.path.join(aside, name), 1
    while os.path.lexists(target):
        target, number = os.path.join(aside, f'{name}.{number}'), number + 1
    os.rename(os.path.join(folder, name), target)


def read_record(folder):
    """checkpoints.json of `folder` as {'files': {name: {...}}, 'last': name, 'best': name}, or None if
    it is missing, unreadable or not such a record (an entry without its step or checksum, say)."""
    try:
        with open(os.path.join(folder, RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if _is_record(record) else None


def end_written(folder, step):
    """Whether a run resumed at `step`, where it ends, wrote its end records (history.json, final metrics):
    False only when `step` is the folder's newest checkpoint and its record says the end was not written
    there (killed between the last checkpoint and its end, a disk full then). An earlier Kiln's record,
    which does not say, tells it only when that checkpoint is not in it."""
    record = read_record(folder)
    if record is None:
        return True
    if any(step_of(name) is not None and step_of(name) > step for name in os.listdir(folder)):
        return True  # an older checkpoint resumed: its end is no longer the folder's
    if 'ended_at' not in record:  # an earlier Kiln's: a checkpoint it recorded came before the run's end
        return any(entry['step'] == step for entry in record['files'].values())
    return record['ended_at'] == step


def _is_record(record):
    """Whether `record` has the shape write_record gives it."""
    if not isinstance(record, dict) or not isinstance(record.get('files'), dict):
        return False
    entries = record['files'].values()
    return all(
        isinstance(entry, dict)
        and type(entry.get('step')) is int
        and isinstance(entry.get('sha256'), str)
        and (entry.get('metric') is None or type(entry['metric']) in (int, float))
        for entry in entries
    ) and all(record.get(link) is None or isinstance(record[link], str) for link in ('last', 'best'))


def _monitor_value(path):
    """The monitored value a checkpoint file was saved with (None between validations); a KilnError
    when it does not load."""
    return load_checkpoint(path, mmap=True).get('monitor_value')  # (mapped: tensors not read)


def _linked_name(folder, link, files):
    """The checkpoint file that `link` (last.pth / best.pth) is a hard link to, or None."""
    path = os.path.join(folder, link)
    for name in files:
        with contextlib.suppress(OSError):
            if os.path.samefile(path, os.path.join(folder, name)):
                return name
    return None


def verify(path, attempts=3):
    """Raise a KilnError when `path`'s bytes differ from the checksum its folder's record holds for it
    (a checkpoint not in a record cannot be checked and passes). last.pth and best.pth that are copies,
    not links (a folder copied without its hard links, a file system without them), must hold the bytes
    of one of the folder's checkpoints. A run saving in the folder meanwhile replaces last.pth and the
    record, and prunes files, between the reads: a mismatch is looked at again before it is said."""
    for attempt in range(attempts):
        try:
            problem = _mismatch(path)
        except FileNotFoundError:  # a checkpoint pruned while it was read
            problem = f'{path} changed while it was checked'
            if not os.path.isfile(path):
                return  # loading it says that it does not exist
        if problem is None:
            return
        if attempt + 1 < attempts:
            time.sleep(0.05 * (attempt + 1))
    raise KilnError(problem)


def _mismatch(path):
    """What `verify` finds wrong with `path`'s bytes at one look (None: nothing)."""
    folder, name = os.path.split(os.path.abspath(path))
    record = read_record(folder)
    if not record:
        return None
    files, link = record['files'], name
    name = name if name in files else _linked_name(folder, name, files)
    expected = files.get(name, {}).get('sha256') if name else None
    if expected and checksum(path) != expected:
        return f'{path} is corrupt: its bytes do not match the checksum in {os.path.join(folder, RECORD)}'
    if name is None and link in (LAST, BEST):
        digest = checksum(path)
        known = {entry.get('sha256') for entry in files.values()}
        unrecorded = [other for other in os.listdir(folder) if step_of(other) is not None and other not in files]
        if digest not in known and all(checksum(os.path.join(folder, other)) != digest for other in unrecorded):
            return (
                f'{path} is none of the checkpoints in {folder} (its bytes match none of the checksums in '
                f'{RECORD}): damaged, or left over from an earlier run; load one of the epoch*_step*.pth files'
            )
    return None


class CheckpointKeeper:
    """Writes the checkpoints of one experiment folder and decides which ones to keep (see the module)."""

    def __init__(self, folder, keep_last=1, keep_best=1, mode='max', restore=True):
        self.folder, self.keep_last, self.keep_best, self.mode = folder, keep_last, keep_best, mode
        self.same_folder = SameFolder(folder)  # each save checks that the path still names it
        record = read_record(folder) or self.rebuild_record()
        # a recorded checkpoint whose file is gone (deleted by hand, say) while last.pth or best.pth still
        # holds its bytes (they were links to it): put back (`restore`; the run's own keeper, which holds
        # the folder's lock), or read through that link (a read-only look, before a resume is accepted)
        link_sums = {}  # each link read once, and only where a recorded file is gone
        self.held = {
            name: link for name, entry in record['files'].items() if (link := self._held_by(name, entry, link_sums))
        }
        for name, link in self.held.items() if restore else ():
            _link_or_copy(os.path.join(folder, link), os.path.join(folder, name))
            print(f'restored {name} from {link} (its bytes match the checksum in {RECORD})', flush=True)
        self.held = {} if restore else self.held
        # files this keeper's record had dropped when a kill came before their removal: removed now (the
        # bytes it dropped: not a file of that name put there since), not taken for unrecorded ones; not
        # where the record's newest is gone (a resume from such a file set the newer ones aside)
        pending = record.get('pruning') if isinstance(record.get('pruning'), dict) else {}
        newest_there = os.path.isfile(os.path.join(folder, str(record.get('last'))))
        pruned = {
            name
            for name, digest in pending.items()
            if newest_there
            and name not in record['files']
            and os.path.isfile(os.path.join(folder, name))
            and checksum(os.path.join(folder, name)) == digest
        }
        for name in pruned if restore else ():
            os.remove(os.path.join(folder, name))
        self.pruning = {}  # the files a save's record drops, until they are removed
        self.files = {
            name: entry
            for name, entry in record['files'].items()
            if os.path.isfile(os.path.join(folder, name)) or name in self.held
        }
        self.best = record.get('best') if record.get('best') in self.files else None  # not one set aside
        self.ended_at = record.get('ended_at')  # the step at which the run's end records were written
        # files a kill left unrecorded (saved, then killed before the record): kept and pruned like the others;
        # one no newer than the record's newest is no kill's (each save is recorded before the next): set aside
        self.unrecorded = {name for name in os.listdir(folder) if step_of(name) is not None} - set(self.files) - pruned
        self.recorded_step = max([entry['step'] for entry in self.files.values()], default=-1)
        for name in self.unrecorded:
            path = os.path.join(folder, name)
            self.files[name] = {'step': step_of(name), 'sha256': checksum(path), 'metric': None}
            with contextlib.suppress(KilnError):  # (one that does not load is not trusted: newest_trusted)
                self.files[name]['metric'] = _monitor_value(path)
        self.best = _linked_name(folder, BEST, self.unrecorded) or self.best  # made best, then killed

    def settle_best(self, best):
        """Point best.pth at the kept checkpoint that first reached `best`, the best monitored value of the
        run being resumed, when it points elsewhere or nowhere: a kill between a checkpoint and its links
        left it at the previous best, and a resume from an older checkpoint sets a newer best aside."""
        if not _finite(best) or (self.best and self.files[self.best]['metric'] == best):
            return
        holders = [name for name in self.files if self.files[name]['metric'] == best and name not in self.held]
        if holders:
            self.best = min(holders, key=lambda name: self.files[name]['step'])  # reached first: made best then
            _link_or_copy(os.path.join(self.folder, self.best), os.path.join(self.folder, BEST))
            self.write_record()

    def rebuild_record(self):
        """A record made from the checkpoint files themselves (when checkpoints.json is missing or corrupt):
        those that load, with the checksum of the bytes that loaded. One that does not is left out: found
        unrecorded, it is not trusted (newest_trusted skips it) and is pruned like any other."""
        files = {}
        for name in os.listdir(self.folder):
            if step_of(name) is not None:
                path = os.path.join(self.folder, name)
                try:
                    files[name] = {'step': step_of(name), 'sha256': checksum(path), 'metric': _monitor_value(path)}
                except KilnError:
                    continue
        return {'files': files, 'best': _linked_name(self.folder, BEST, files)}

    def _held_by(self, name, entry, link_sums):
        """last.pth or best.pth when the recorded checkpoint `name` (its record `entry`) is gone and that
        link holds its bytes, else None (`link_sums`: the links' checksums found so far)."""
        if os.path.exists(os.path.join(self.folder, name)):
            return None
        for link in (LAST, BEST):
            path = os.path.join(self.folder, link)
            if link not in link_sums:
                link_sums[link] = checksum(path) if os.path.isfile(path) else None
            if link_sums[link] == entry['sha256']:
                return link
        return None

    def save(self, state, epoch, step, metric=None, is_best=False):
        """Write `state` as the checkpoint of (`epoch`, `step`), update last/best and prune; return its path.

        `metric` is the monitored value of this state (None between validations); `is_best` says it
        improved on every earlier one (the run's Monitor decides that).
        """
        self.same_folder.check()
        name = checkpoint_name(epoch, step)
        path = os.path.join(self.folder, name)
        writing, whole = f'checkpoint {path}', False  # what a failure failed to write; whether the file is whole
        try:
            digest = save_checkpoint(state, path, sync_folder=False)  # the record's write syncs the folder once
            fault_point('checkpoint_written')
            writing, whole = f'{LAST} or {BEST} after checkpoint {path}', True
            _link_or_copy(path, os.path.join(self.folder, LAST))
            if is_best:
                _link_or_copy(path, os.path.join(self.folder, BEST))
                self.best = name
            fault_point('links_made')
            self.files[name] = {'step': step, 'sha256': digest, 'metric': metric}
            self.ended_at = None  # a new checkpoint: the run's end is still to come
            entries = dict(self.files)
            dropped = self._forget_extra()
            by_hand = {old for old in dropped if old in self.unrecorded and step_of(old) <= self.recorded_step}
            self.pruning = {old: entries[old]['sha256'] for old in dropped if old not in by_hand}
            writing = f'{RECORD} after checkpoint {path}'
            self.write_record()
            fault_point('record_written')
        except OSError as error:
            fix = 'free space or fix permissions, then'
            if whole:  # a resume finds it, loads it and goes on
                advice = f'that checkpoint is whole: {fix} continue with --resume'
            elif self.files:
                advice = f'the previous checkpoints are intact: {fix} continue with --resume'
            else:  # the run's folder goes with the error: there is nothing to resume
                advice = f'nothing was saved: {fix} run the command again'
            raise KilnError(f'could not write {writing} ({error.strerror or error}); {advice}') from None
        for old in dropped:  # only now that the record no longer lists them (and lists them as pruning)
            with contextlib.suppress(FileNotFoundError):
                if old in by_hand:  # put there by hand
                    set_aside(self.folder, old)
                    print(f'{old} is in no record of this run: moved to superseded/unrecorded/', flush=True)
                else:
                    os.remove(os.path.join(self.folder, old))
        self.pruning = {}
        return path

    def _forget_extra(self):
        """Drop files beyond the newest keep_last and best keep_best (and the current best) from the record."""
        newest = sorted(self.files, key=lambda n: self.files[n]['step'])[-self.keep_last :]
        scored = [n for n in self.files if _finite(self.files[n]['metric'])]
        scored.sort(key=lambda n: self.files[n]['metric'], reverse=self.mode == 'max')
        kept = set(newest) | set(scored[: self.keep_best]) | ({self.best} if self.best else set())
        dropped = [n for n in self.files if n not in kept]
        for name in dropped:
            del self.files[name]
        return dropped

    def write_record(self):
        """Write checkpoints.json: every kept file with its step, checksum and monitored value, and
        which files last.pth and best.pth are."""
        last = max(self.files, key=lambda n: self.files[n]['step']) if self.files else None
        record = {'last': last, 'best': self.best, 'ended_at': self.ended_at, 'files': self.files}
        if self.pruning:
            record['pruning'] = self.pruning
        atomic_write_json(record, os.path.join(self.folder, RECORD))

    def record_end(self, step):
        """Note in the record that the run's end (history.json, final metrics) was written at `step`."""
        self.same_folder.check()  # (never into a folder made at its path since)
        self.ended_at = step
        self.write_record()

    def newest_trusted(self):
        """(path of the newest checkpoint whose bytes match its checksum and that loads, or None;
        the names skipped on the way, with the reason)."""
        skipped = []
        for name in sorted(self.files, key=lambda n: self.files[n]['step'], reverse=True):
            path = os.path.join(self.folder, self.held.get(name, name))
            if name not in self.unrecorded and checksum(path) != self.files[name]['sha256']:
                skipped.append(f'{name} (its bytes do not match its checksum)')
                continue
            if name in self.unrecorded:  # no checksum to compare with: it must at least load
                try:
                    load_checkpoint(path)
                except KilnError:
                    skipped.append(f'{name} (unreadable)')
                    continue
            return path, skipped
        return None, skipped


def _finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)
