"""MLflow: one run in the experiment 'kiln', kept across resumes (its id is in the checkpoint).

The tracking URI is --mlflow_uri, else MLFLOW_TRACKING_URI, else a local store that needs no
server: `<checkpoints_dir>/mlruns/mlflow.db` (SQLite, MLflow 3's default backend; its file store
is deprecated) with artifacts in `<checkpoints_dir>/mlruns/artifacts`. Browse it with
`mlflow ui --backend-store-uri sqlite:///<checkpoints_dir>/mlruns/mlflow.db` (the full mlflow package).
"""

import contextlib
import fcntl
import math
import os
import pathlib
import re
import time
from urllib.parse import urlsplit

from utils.errors import KilnError
from utils.trackers import Tracker, copied_from, require, valid_text

EXPERIMENT = 'kiln'
MAX_PARAM_LENGTH = 6000  # MLflow rejects longer parameter values
SQLITE = 'sqlite:///'
# how long a server gets to answer the first request, unless MLFLOW_HTTP_REQUEST_TIMEOUT says
SERVER_CHECK_TIMEOUT_S = 10
# MLflow's name of a picture logged with a key and a step: images/<key>+step+<step>+timestamp+...
IMAGE_FILE = re.compile(r'\+step\+(\d+)\+timestamp\+')


def local_store(checkpoints_dir):
    """(tracking URI, artifact location) of the local store under `checkpoints_dir`."""
    folder = os.path.join(os.path.abspath(checkpoints_dir), 'mlruns')
    os.makedirs(folder, exist_ok=True)
    return SQLITE + os.path.join(folder, 'mlflow.db'), pathlib.Path(folder, 'artifacts').as_uri()


@contextlib.contextmanager
def database_lock(uri):
    """Hold an exclusive lock on `<database>.lock` beside an SQLite store's database file (nothing for
    another URI): MLflow creates a new database's tables when it opens it, and two runs that do so at
    once fail in one of them ("Online migration expected to match one row")."""
    if not uri.startswith(SQLITE):
        yield
        return
    database = os.path.abspath(uri[len(SQLITE) :])
    os.makedirs(os.path.dirname(database), exist_ok=True)
    with open(f'{database}.lock', 'a') as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)  # released when the file is closed
        yield


def check_server(uri, source):
    """Raise a KilnError at once when the MLflow server at the http(s) `uri` does not answer.

    MLflow retries a request 7 times with a growing wait by default: four minutes of silence before
    its traceback. This one request retries only as often and waits only as long as the user's own
    MLFLOW_HTTP_REQUEST_MAX_RETRIES and MLFLOW_HTTP_REQUEST_TIMEOUT say (none, SERVER_CHECK_TIMEOUT_S
    when unset); the run's later requests keep MLflow's settings, to ride out a server's short outages.
    """
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        # any answer, even an error status, is a server that is there
        http_request(
            get_default_host_creds(uri),
            '/health',
            'GET',
            max_retries=None if MLFLOW_HTTP_REQUEST_MAX_RETRIES.defined else 0,
            timeout=None if MLFLOW_HTTP_REQUEST_TIMEOUT.defined else SERVER_CHECK_TIMEOUT_S,
            raise_on_status=False,
        )
    except MlflowException as error:
        # MLflow's message ends with urllib3's nested one; the system's reason ("Connection refused") says it
        found = re.search(r'\[Errno -?\d+\] ([^"\')]+)', str(error))
        reason = found.group(1) if found else str(error).splitlines()[0][:200]
        raise KilnError(
            f'no MLflow server answers at {uri} ({source}): {reason}; start the server, or fix {source}'
        ) from None


def uri_error(uri, source, error):
    """The KilnError of a tracking URI that MLflow refused (`error`, an MlflowException)."""
    from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException

    if urlsplit(uri).scheme in ('', 'file'):
        return KilnError(
            f"{source} {uri} is a folder of MLflow's file store, which MLflow 3 refuses; for a database "
            f'file give {SQLITE}{os.path.abspath(urlsplit(uri).path)}, or give no URI for the local store '
            f'in <checkpoints_dir>/mlruns'
        )
    if isinstance(error, UnsupportedModelRegistryStoreURIException):  # (MLflow checks the registry's first)
        return KilnError(
            f'{source} {uri}: MLflow has no store for {urlsplit(uri).scheme}:// URIs; give sqlite:///<database '
            f'file>, http(s)://<server> or another URI MLflow takes (postgresql://, mysql://, databricks, ...)'
        )
    return KilnError(f'MLflow cannot use {source} {uri}: {str(error).strip().splitlines()[0][:300]}')


class MlflowTracker(Tracker):
    """Logs to an MLflow run through MlflowClient with explicit run ids (no global active run).

    MLflow keeps every point it is given, so nothing a resumed run will log again may reach it:
    points wait in memory until `commit(step)` or `finish`. Those waiting when a checkpoint is
    assembled also go into its state, so that a kill between the checkpoint's write and its commit
    loses nothing: the resumed run writes those MLflow does not have yet. A run resumed from an older
    checkpoint than its last one (or extended past its end) finds points after that checkpoint in
    MLflow already: it writes no point whose (metric, step) holds that value already (Kiln's resume
    is exact, so they are equal unless the resume changed an option such as --epochs, whose new values
    are written beside the old), nor pictures at a step that has some.
    """

    name = 'mlflow'

    def __init__(self, folder, run_name, resume_step=None, state=None, options=None, metric_names=()):
        require('mlflow', self.name, 'mlflow-skinny')
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.Metric, self.Param = Metric, Param
        source = '--mlflow_uri' if options.mlflow_uri else 'MLFLOW_TRACKING_URI'
        uri, artifacts = options.mlflow_uri or os.environ.get('MLFLOW_TRACKING_URI'), None
        if uri and uri.startswith(SQLITE):  # a database file: artifacts beside it, not in ./mlruns
            artifacts = pathlib.Path(os.path.dirname(os.path.abspath(uri[len(SQLITE) :])), 'artifacts').as_uri()
        if not uri:
            for module in ('sqlalchemy', 'alembic'):  # MLflow's SQLite store needs both
                require(module, self.name)
            uri, artifacts = local_store(options.checkpoints_dir)
        if urlsplit(uri).scheme in ('http', 'https'):
            check_server(uri, source)
        try:
            with database_lock(uri):  # the client opens the store, creating a new one
                self.client = MlflowClient(tracking_uri=uri)
        except MlflowException as error:
            raise uri_error(uri, source, error) from None
        state = state or {}
        self.run_id, self.folder, copied = state.get('run_id'), os.path.abspath(folder), copied_from(state, folder)
        if self.run_id and copied:
            print(
                f'note: MLflow run {self.run_id} is the run of {copied}, which this folder is a copy of: this '
                f'resume logs to a new MLflow run, which starts at step {(resume_step or 0) + 1}'
            )
            self.run_id, state = None, {}  # (the points its checkpoint kept are the original's)
        if self.run_id:
            self._continue_run(uri)
        else:
            self.run_id = self._new_run(run_name, folder, artifacts, uri)
        self.pending = {}  # step -> {metric: value} not yet written
        self.images = {}  # step -> {tag: image} not yet written
        self.last_step = resume_step or 0
        self.finished = False
        saved = [(step, name, value) for step, metrics in state.get('pending', []) for name, value in metrics.items()]
        self.held_points, self.held_image_steps = {}, set()  # (step, name) -> the values held
        if resume_step is not None:
            self._read_held(min([resume_step + 1, *(step for step, _, _ in saved)]))
        self._log_batch(saved)  # those its commit did not get to write

    def _new_run(self, run_name, folder, artifacts, uri):
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        if experiment and experiment.lifecycle_stage != 'active':
            raise KilnError(
                f"the MLflow experiment '{EXPERIMENT}' in {uri} is deleted; restore it (mlflow experiments "
                f'restore --experiment-id {experiment.experiment_id}, with that tracking URI) or give another '
                f'--mlflow_uri'
            )
        try:
            experiment_id = (
                experiment.experiment_id
                if experiment
                else self.client.create_experiment(EXPERIMENT, artifact_location=artifacts)
            )
        except MlflowException:  # created meanwhile by another run
            experiment_id = self.client.get_experiment_by_name(EXPERIMENT).experiment_id
        tags = {'kiln.folder': valid_text(os.path.abspath(folder))}  # (a folder name that is no UTF-8: escaped)
        return self.client.create_run(experiment_id, run_name=valid_text(run_name), tags=tags).info.run_id

    def _continue_run(self, uri):
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(self.run_id, status='RUNNING')
        except MlflowException as error:
            if error.error_code != 'RESOURCE_DOES_NOT_EXIST':
                raise
            raise KilnError(
                f'the MLflow run {self.run_id} of this checkpoint is not in {uri} (moved or deleted?); resume '
                f'with the --mlflow_uri or --checkpoints_dir it started with, or leave mlflow out of --loggers '
                f'to go on without it'
            ) from None

    def _read_held(self, since):
        """Note the points and picture steps from `since` on that the run already holds."""
        for name in self.client.get_run(self.run_id).data.metrics:
            for metric in self.client.get_metric_history(self.run_id, name):
                if metric.step >= since:
                    self.held_points.setdefault((metric.step, name), set()).add(metric.value)
        for artifact in self.client.list_artifacts(self.run_id, 'images'):
            match = IMAGE_FILE.search(artifact.path)
            if match and int(match.group(1)) >= since:
                self.held_image_steps.add(int(match.group(1)))

    def _log_batch(self, points):
        """Write (step, name, value) points, leaving out those the run holds with that value already."""
        timestamp = int(time.time() * 1000)
        metrics = [
            self.Metric(name, value, timestamp, step)
            for step, name, value in points
            if not _held(value, self.held_points.get((step, name), ()))
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)

    def log_hparams(self, hparams):
        # parameters cannot change in MLflow: a resumed run keeps the values it started with
        logged = self.client.get_run(self.run_id).data.params
        params = [
            self.Param(name, valid_text(str(value))[:MAX_PARAM_LENGTH])
            for name, value in hparams.items()
            if name not in logged
        ]
        if params:
            self.client.log_batch(self.run_id, params=params, synchronous=True)

    def log_metrics(self, metrics, step, epoch):
        self.pending.setdefault(step, {}).update({name: float(value) for name, value in metrics.items()})

    def log_images(self, images, step):
        self.images.setdefault(step, {}).update(images)

    def log_text(self, tag, text, step):
        self.client.log_text(self.run_id, valid_text(text), f'{tag}.md')  # one file per tag; the latest start wins

    def _write(self, up_to=None):
        steps = [step for step in sorted(set(self.pending) | set(self.images)) if up_to is None or step <= up_to]
        self._log_batch([(step, name, value) for step in steps for name, value in self.pending.pop(step, {}).items()])
        for step in steps:
            images = self.images.pop(step, {})
            if step not in self.held_image_steps:
                for tag, image in images.items():
                    self.client.log_image(self.run_id, image, key=tag, step=step, synchronous=True)
            self.last_step = max(self.last_step, step)

    def state_dict(self):
        pending = [[step, dict(metrics)] for step, metrics in sorted(self.pending.items())]
        return {'run_id': self.run_id, 'pending': pending, 'folder': self.folder}

    def commit(self, step):
        self._write(up_to=step)

    def finish(self, final_metrics):
        self._write()
        self._log_batch(
            [(self.last_step, name, float(value)) for name, value in final_metrics.items() if value is not None]
        )
        self.client.set_terminated(self.run_id, 'FINISHED')
        self.finished = True

    def close(self):
        """Without finish: mark the run KILLED; the points after the last checkpoint are dropped
        (a resume logs them again)."""
        if not self.finished:
            self.client.set_terminated(self.run_id, 'KILLED')
            self.finished = True


def _held(value, held):
    """Whether the point `value` is among the values `held` (NaN too, which equals nothing: a NaN mIoU was
    written again at each resume)."""
    return value in held or (math.isnan(value) and any(map(math.isnan, held)))
