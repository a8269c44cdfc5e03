"""CSV: `metrics.csv` in the experiment folder, one row per step (pandas.read_csv reads it as is)."""

import csv
import io
import os
import time

from utils.checkpoint import atomic_write_bytes
from utils.trackers import Tracker

WRITE_EVERY_S = 30  # between checkpoints too, so that the file can be watched during long epochs


class CsvTracker(Tracker):
    """Columns `step,epoch,<metric>...`; metrics logged at one step share its row.

    The rows are kept in memory and the whole file is replaced atomically when written (at each
    checkpoint, every WRITE_EVERY_S seconds and at the end), so a kill never leaves a half row and
    a new metric simply adds a column. A resumed run first drops the rows after its checkpoint.
    Texts and images are not written.
    """

    name = 'csv'

    def __init__(self, folder, run_name, resume_step=None, state=None, options=None, metric_names=()):
        self.path = os.path.join(folder, 'metrics.csv')
        self.rows = {}  # step -> {'epoch': .., metric: value}
        self.columns = ['step', 'epoch']
        self.dirty = False
        self.written_at = time.monotonic()
        if resume_step is not None and os.path.isfile(self.path):
            self._read(resume_step)

    def _read(self, resume_step):
        """Keep the rows up to `resume_step` of the file a killed run left."""
        with open(self.path, newline='') as f:
            reader = csv.DictReader(f)
            for row in reader:
                step = row.pop('step', '')
                if step.isdigit() and int(step) <= resume_step:
                    self.rows[int(step)] = {name: value for name, value in row.items() if value}
            self.columns += [name for name in reader.fieldnames or () if name not in self.columns]
        self.dirty = True  # the dropped rows must go from the file too

    def log_metrics(self, metrics, step, epoch):
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
        text = io.StringIO()
        writer = csv.writer(text, lineterminator='\n')
        writer.writerow(self.columns)
        for step in sorted(self.rows):
            row = {**self.rows[step], 'step': step}
            writer.writerow([row.get(column, '') for column in self.columns])
        atomic_write_bytes(text.getvalue().encode(), self.path)
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
