"""MLflow: one run in the experiment 'kiln', kept across resumes (its id is in the checkpoint).

The tracking URI is --mlflow_uri, else MLFLOW_TRACKING_URI, else a local store that needs no
server: `<checkpoints_dir>/mlruns/mlflow.db` (SQLite, MLflow 3's default backend; its file store
is deprecated) with artifacts in `<checkpoints_dir>/mlruns/artifacts`. Browse it with
`mlflow ui --backend-store-uri sqlite:///<checkpoints_dir>/mlruns/mlflow.db` (the full mlflow package).
"""

import os
import pathlib
import time

from utils.errors import KilnError
from utils.trackers import Tracker, require

EXPERIMENT = 'kiln'
MAX_PARAM_LENGTH = 6000  # MLflow rejects longer parameter values


def local_store(checkpoints_dir):
    """(tracking URI, artifact location) of the local store under `checkpoints_dir`."""
    folder = os.path.join(os.path.abspath(checkpoints_dir), 'mlruns')
    os.makedirs(folder, exist_ok=True)
    return 'sqlite:///' + os.path.join(folder, 'mlflow.db'), pathlib.Path(folder, 'artifacts').as_uri()


class MlflowTracker(Tracker):
    """Logs to an MLflow run through MlflowClient with explicit run ids (no global active run).

    MLflow keeps every point it is given, so nothing a resumed run will log again may reach it:
    points wait in memory until `commit(step)` or `finish`. Those waiting when a checkpoint is
    assembled also go into its state, so that a kill between the checkpoint's write and its commit
    loses nothing: the resumed run writes those MLflow does not have yet.
    """

    name = 'mlflow'

    def __init__(self, folder, run_name, resume_step=None, state=None, options=None, metric_names=()):
        require('mlflow', self.name, 'mlflow-skinny')
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric, self.Param = Metric, Param
        uri, artifacts = options.mlflow_uri or os.environ.get('MLFLOW_TRACKING_URI'), None
        if uri and uri.startswith('sqlite:///'):  # a database file: artifacts beside it, not in ./mlruns
            artifacts = pathlib.Path(os.path.dirname(os.path.abspath(uri[len('sqlite:///') :])), 'artifacts').as_uri()
        if not uri:
            for module in ('sqlalchemy', 'alembic'):  # MLflow's SQLite store needs both
                require(module, self.name)
            uri, artifacts = local_store(options.checkpoints_dir)
        self.client = MlflowClient(tracking_uri=uri)
        state = state or {}
        self.run_id = state.get('run_id')
        if self.run_id:
            self._continue_run(uri)
        else:
            self.run_id = self._new_run(run_name, folder, artifacts)
        self.pending = {}  # step -> {metric: value} not yet written
        self.images = {}  # step -> {tag: image} not yet written
        self.last_step = resume_step or 0
        self.finished = False
        self._write_missing(state.get('pending', []))

    def _new_run(self, run_name, folder, artifacts):
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        try:
            experiment_id = (
                experiment.experiment_id
                if experiment
                else self.client.create_experiment(EXPERIMENT, artifact_location=artifacts)
            )
        except MlflowException:  # created meanwhile by another run
            experiment_id = self.client.get_experiment_by_name(EXPERIMENT).experiment_id
        tags = {'kiln.folder': os.path.abspath(folder)}
        return self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id

    def _continue_run(self, uri):
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(self.run_id, status='RUNNING')
        except MlflowException as error:
            if error.error_code != 'RESOURCE_DOES_NOT_EXIST':
                raise
            raise KilnError(
                f'the MLflow run {self.run_id} of this checkpoint is not in {uri}; resume with the '
                f'--mlflow_uri or --checkpoints_dir it started with'
            ) from None

    def _write_missing(self, saved):
        """Write the points of a checkpoint's state that its commit did not get to write."""
        saved = [(step, name, value) for step, metrics in saved for name, value in metrics.items()]
        logged = {
            name: {metric.step for metric in self.client.get_metric_history(self.run_id, name)}
            for name in {name for _, name, _ in saved}
        }
        self._log_batch([(step, name, value) for step, name, value in saved if step not in logged[name]])

    def _log_batch(self, points):
        timestamp = int(time.time() * 1000)
        metrics = [self.Metric(name, value, timestamp, step) for step, name, value in points]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)

    def log_hparams(self, hparams):
        # parameters cannot change in MLflow: a resumed run keeps the values it started with
        logged = self.client.get_run(self.run_id).data.params
        params = [
            self.Param(name, str(value)[:MAX_PARAM_LENGTH]) for name, value in hparams.items() if name not in logged
        ]
        if params:
            self.client.log_batch(self.run_id, params=params, synchronous=True)

    def log_metrics(self, metrics, step, epoch):
        self.pending.setdefault(step, {}).update({name: float(value) for name, value in metrics.items()})

    def log_images(self, images, step):
        self.images.setdefault(step, {}).update(images)

    def log_text(self, tag, text, step):
        self.client.log_text(self.run_id, text, f'{tag}.md')  # one file per tag; the latest start wins

    def _write(self, up_to=None):
        steps = [step for step in sorted(set(self.pending) | set(self.images)) if up_to is None or step <= up_to]
        self._log_batch([(step, name, value) for step in steps for name, value in self.pending.pop(step, {}).items()])
        for step in steps:
            for tag, image in self.images.pop(step, {}).items():
                self.client.log_image(self.run_id, image, key=tag, step=step, synchronous=True)
            self.last_step = max(self.last_step, step)

    def state_dict(self):
        pending = [[step, dict(metrics)] for step, metrics in sorted(self.pending.items())]
        return {'run_id': self.run_id, 'pending': pending}

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
