"""TensorBoard: event files in the experiment folder (`tensorboard --logdir <checkpoints_dir>`)."""

import contextlib
import os
import re
import socket
import struct
import time

from utils.trackers import Tracker, require, valid_text
from utils.viz import png_bytes

EVENT_FILE = re.compile(r'^events\.out\.tfevents\.(\d+)\.')


class EventFile:
    """One event file, written in place (each point flushed at once) and named to sort after every
    event file already in the folder.

    TensorBoard reads a folder's event files in name order, and the name starts with a time in
    seconds: a resumed run that starts in the same second as the run it continues (or on a machine
    whose clock is behind) would otherwise be read first, and the old run's points would land after
    its own. Each file starts with a SessionLog START at `purge_step` (0 in a new run's), which makes
    TensorBoard drop whatever earlier files hold from that step on. TensorBoard's Python loader
    (`--load_fast=false`) takes the first START of a folder for the run's beginning and purges only
    at later ones: a new run's file needs one too, else the first resume purges nothing there.
    """

    def __init__(self, folder, purge_step=0):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self.Event = Event
        stamps = [int(match.group(1)) for match in map(EVENT_FILE.match, os.listdir(folder)) if match]
        stamp = max([int(time.time()), *(newest + 1 for newest in stamps)])
        name = f'events.out.tfevents.{stamp:010d}.{socket.gethostname()}.{os.getpid()}.kiln'
        self.records = open(os.path.join(folder, name), 'ab')
        self._write(Event(wall_time=time.time(), file_version='brain.Event:2'))
        self._write(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _write(self, event):
        data = event.SerializeToString()
        header = struct.pack('<Q', len(data))
        self.records.write(header + masked_crc32c(header) + data + masked_crc32c(data))
        self.records.flush()

    def add_summary(self, summary, step):
        """Write a Summary proto at `step`."""
        self._write(self.Event(wall_time=time.time(), step=step, summary=summary))

    def sync(self):
        """fsync the points written so far."""
        os.fsync(self.records.fileno())

    def close(self):
        self.records.close()


HPARAMS_TAG = b'_hparams_/'  # the start of the tags of the HParams summaries (hparams_summaries)


def drop_hparams(path):
    """Rewrite the event file `path` without its HParams summaries, if it holds any. TensorBoard keeps the
    first description it reads of a tag, and a resume's purge drops points, not descriptions: the HParams
    row of a run extended past its end would keep the options of its first end. Every other record, and
    a last one cut short by a kill, stays as it was; read and written a record at a time, to a temporary
    file renamed over it once whole (a crash while rewriting leaves the file as it was)."""
    from tensorboard.compat.proto.event_pb2 import Event

    from utils.checkpoint import atomic_write_bytes

    def write_kept(f):
        for record, raw in _records(path):
            if not _is_hparams(record, Event):
                f.write(raw)

    if any(_is_hparams(record, Event) for record, _ in _records(path)):
        atomic_write_bytes(write_kept, path)


def _records(path):
    """(record, its bytes as stored) for each record of the TFRecord file `path`; a last one cut short comes
    as (b'', its bytes)."""
    with open(path, 'rb') as f:
        size = os.fstat(f.fileno()).st_size
        while header := f.read(12):
            (length,) = struct.unpack('<Q', header[:8]) if len(header) == 12 else (None,)
            fits = length is not None and f.tell() + length + 4 <= size  # (a damaged length may be any number)
            rest = f.read(length + 4) if fits else b''
            if not fits:
                yield b'', header + rest + f.read()
                return
            yield rest[:length], header + rest


def _is_hparams(record, event_type):
    """Whether the event file record `record` holds an HParams summary (a damaged one is kept: not)."""
    if HPARAMS_TAG not in record:
        return False
    from google.protobuf.message import DecodeError

    try:
        values = event_type.FromString(record).summary.value
    except DecodeError:
        return False
    return any(value.tag.startswith(HPARAMS_TAG.decode()) for value in values)


def masked_crc32c(data):
    """The checksum a TFRecord stores after its length and after its data, as 4 bytes: CRC-32C,
    rotated and offset as TFRecord masks it. Computed by google-crc32c in C: TensorBoard's own, used
    when that package is missing, is pure Python and takes 25 ms for a 300 kB picture."""
    try:
        from google_crc32c import value as crc32c
    except ImportError:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as masked

        return struct.pack('<I', masked(data))
    crc = crc32c(data)
    return struct.pack('<I', (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


# TensorBoard's summaries built from its protocol buffers: torch.utils.tensorboard builds the same, but
# importing it imports torch.export, a tenth of a second holding the interpreter lock mid-training


def _plugin_metadata(plugin, content):
    from tensorboard.compat.proto.summary_pb2 import SummaryMetadata

    return SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=plugin, content=content))


def text_summary(tag, text):
    """A Summary that TensorBoard's Text tab shows as `<tag>/text_summary` (Markdown)."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

    shape = TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)])
    tensor = TensorProto(dtype='DT_STRING', string_val=[valid_text(text).encode()], tensor_shape=shape)
    metadata = _plugin_metadata('text', TextPluginData(version=0).SerializeToString())
    return Summary(value=[Summary.Value(tag=f'{tag}/text_summary', metadata=metadata, tensor=tensor)])


def hparams_summaries(values, metric_names):
    """The three Summaries of TensorBoard's HParams tab: the experiment (which options and metrics it
    shows), this run's option `values` (numbers, bools, anything else as text; None left out) and its end."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams.api_pb2 import DataType, Experiment, HParamInfo, MetricInfo, MetricName, Status
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo, SessionStartInfo

    start, infos = SessionStartInfo(), []
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):  # before numbers: a bool is an int in Python
            field, kind = 'bool_value', 'DATA_TYPE_BOOL'
        elif isinstance(value, (int, float)):
            field, kind = 'number_value', 'DATA_TYPE_FLOAT64'
        else:
            field, kind, value = 'string_value', 'DATA_TYPE_STRING', valid_text(str(value))
        setattr(start.hparams[name], field, value)
        infos.append(HParamInfo(name=name, type=DataType.Value(kind)))
    experiment = Experiment(hparam_infos=infos, metric_infos=[MetricInfo(name=MetricName(tag=n)) for n in metric_names])
    # the tags, data version and plugin name of tensorboard.plugins.hparams.metadata, whose import takes 0.1 s
    end = SessionEndInfo(status=Status.STATUS_SUCCESS)
    parts = {
        '_hparams_/experiment': HParamsPluginData(version=0, experiment=experiment),
        '_hparams_/session_start_info': HParamsPluginData(version=0, session_start_info=start),
        '_hparams_/session_end_info': HParamsPluginData(version=0, session_end_info=end),
    }
    summaries = []
    for tag, content in parts.items():
        plugin = _plugin_metadata('hparams', content.SerializeToString())
        summaries.append(Summary(value=[Summary.Value(tag=tag, metadata=plugin)]))
    return summaries


class TensorBoardTracker(Tracker):
    """Writes scalars, images, texts and the HParams row into one event file per start of the run.

    A resumed run's file purges from resume_step + 1 on (see EventFile), which makes TensorBoard
    drop whatever the killed run wrote after its last checkpoint.
    """

    name = 'tensorboard'

    def __init__(self, folder, run_name, resume_step=None, state=None, options=None, metric_names=()):
        self.folder = folder
        self.purge_step = 0 if resume_step is None else resume_step + 1
        self.last_step = resume_step or 0
        self.metric_names = metric_names
        self.hparams = {}
        self.file = None

    def _file(self):
        # importing TensorBoard's protocol buffers takes a while: only a run that writes something pays
        if self.file is None:
            require(
                'tensorboard.compat.proto.summary_pb2', self.name, 'tensorboard', 'python3 -m pip install tensorboard'
            )
            self.file = EventFile(self.folder, self.purge_step)
        return self.file

    def log_hparams(self, hparams):
        self.hparams = dict(hparams)  # written by finish, with the results

    def log_metrics(self, metrics, step, epoch):
        self.last_step = max(self.last_step, step)
        file = self._file()
        from tensorboard.compat.proto.summary_pb2 import Summary

        file.add_summary(
            Summary(value=[Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]), step
        )

    def log_images(self, images, step):
        self.last_step = max(self.last_step, step)
        file = self._file()
        from tensorboard.compat.proto.summary_pb2 import Summary

        for tag, image in images.items():
            height, width, channels = image.shape
            picture = Summary.Image(
                height=height, width=width, colorspace=channels, encoded_image_string=png_bytes(image)
            )
            file.add_summary(Summary(value=[Summary.Value(tag=tag, image=picture)]), step)

    def log_text(self, tag, text, step):
        self._file().add_summary(text_summary(tag, text), step)

    def commit(self, step):
        self.last_step = max(self.last_step, step)

    def state_dict(self):
        """Nothing to keep (a resume purges by step). Asked right before a checkpoint is written, it makes the
        points so far durable first, as the CSV file's are: after a power cut, no checkpoint stands for points
        its event file lost (the file's name is made durable by the fsync of the folder the checkpoint makes)."""
        if self.file is not None:
            self.file.sync()
        return {}

    def finish(self, final_metrics):
        """Write the HParams row: this run's options and results, in the experiment folder itself."""
        file = self._file()
        # every task's metric names are declared, so that runs of different tasks in one logdir
        # each show theirs; only this run's metrics get values
        declared = dict.fromkeys([*self.metric_names, *final_metrics])
        values = {
            name: value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
            for name, value in self.hparams.items()
        }
        # written after the last step, where a resume purges them: one from the run's last checkpoint
        # too (a run extended with a larger --max_iteration) purges from the step after it
        end_step = self.last_step + 1
        for summary in hparams_summaries(values, declared):
            file.add_summary(summary, end_step)
        self.log_metrics({name: value for name, value in final_metrics.items() if value is not None}, end_step, None)
        for name in os.listdir(self.folder):  # an end of an earlier start (a run extended): this row replaces it
            if EVENT_FILE.match(name) and os.path.join(self.folder, name) != file.records.name:
                with contextlib.suppress(Exception):  # (a file it cannot rewrite keeps its old row: the run is done)
                    drop_hparams(os.path.join(self.folder, name))

    def close(self):
        if self.file:
            self.file.close()
