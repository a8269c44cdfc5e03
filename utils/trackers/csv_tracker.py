"""CSV: `metrics.csv` in the experiment folder, one row per step (pandas.read_csv reads it as is)."""

import csv
import errno
import io
import os
import time

from utils.checkpoint import SameFolder, atomic_write_bytes
from utils.trackers import Tracker

WRITE_EVERY_S = 30  # between checkpoints too, so that the file can be watched during long epochs


def append_bytes(data, path):
    """Add `data` at the end of `path` in one write, then fsync."""
    file = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        written = os.write(file, data)
        if written < len(data):  # a regular file takes it in one go but for a full disk: say so
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        os.fsync(file)
    finally:
        os.close(file)


class CsvTracker(Tracker):
    """Columns `step,epoch,<metric>...`; metrics logged at one step share its row.

    The file is written at each checkpoint, every WRITE_EVERY_S seconds and at the end: new rows of the
    same columns are appended (one write, then fsync; a row cut short, by a power cut or a kill in a
    write of several pages, is dropped when a resumed run reads the file, and a failed write is followed
    by a whole rewrite); anything else (a new metric's column, a row that changed, the rows a resumed
    run drops after its checkpoint) replaces the whole file atomically.
    Texts and images are not written.
    """

    name = 'csv'

    def __init__(self, folder, run_name, resume_step=None, state=None, options=None, metric_names=()):
        self.path = os.path.join(folder, 'metrics.csv')
        self.same_folder = SameFolder(folder)  # each write checks that the path still names it
        self.rows = {}  # step -> {'epoch': .., metric: value}
        self.columns = ['step', 'epoch']
        self.dirty = False
        self.in_file = None  # (the columns, the last step) the file holds when rows may be appended to it
        self.written_at = time.monotonic()
        if resume_step is not None and os.path.isfile(self.path):
            self._read(resume_step)

    def _read(self, resume_step):
        """Keep the rows up to `resume_step` of the file a killed run left."""
        with open(self.path, newline='') as f:
            text = f.read()
        if not text.endswith('\n'):  # a row cut short by a power cut while it was appended
            text = text[: text.rfind('\n') + 1]
        with io.StringIO(text, newline='') as f:
            reader = csv.DictReader(f)
            for row in reader:
                step = row.pop('step', '')
                if step.isdigit() and int(step) <= resume_step:
                    self.rows[int(step)] = {name: value for name, value in row.items() if value}
            self.columns += [name for name in reader.fieldnames or () if name not in self.columns]
        self.dirty = True  # the dropped rows must go from the file too

    def log_metrics(self, metrics, step, epoch):
        if self.in_file is not None and step <= self.in_file[1]:  # a row the file has: rewritten whole
            self.in_file = None
        row = self.rows.setdefault(step, {})
        row['epoch'] = epoch
        for name, value in metrics.items():
            if name not in self.columns:
                self.columns.append(name)
            row[name] = float(value)
        self.dirty = True
        if time.monotonic() - self.written_at > WRITE_EVERY_S:
            self._write()

    def _write(self):
        if not self.dirty:
            return
        self.same_folder.check()
        steps = sorted(self.rows)
        append = self.in_file is not None and self.in_file[0] == self.columns and os.path.isfile(self.path)
        last_in_file = self.in_file[1] if append else None
        self.in_file = None  # until written: a failed append (a full disk) is followed by a whole rewrite
        text = io.StringIO()
        writer = csv.writer(text, lineterminator='\n')
        if append:
            steps = [step for step in steps if step > last_in_file]
        else:
            writer.writerow(self.columns)
        for step in steps:
            row = {**self.rows[step], 'step': step}
            writer.writerow([row.get(column, '') for column in self.columns])
        if append:
            append_bytes(text.getvalue().encode(), self.path)
        else:
            atomic_write_bytes(text.getvalue().encode(), self.path)
        self.in_file = list(self.columns), max(self.rows, default=-1)
        self.dirty, self.written_at = False, time.monotonic()

    def state_dict(self):
        # written before the checkpoint exists; a resume from an older one drops the later rows
        self._write()
        return {}

    def commit(self, step):
        self._write()

    def finish(self, final_metrics):
        self._write()

    def close(self):
        self._write()
