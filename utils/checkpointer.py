"""The checkpointer: a training run's full state, collected from its stateful parts.

Each part (model, optimizer, scheduler, gradient scaler, position in the data, random states,
history, monitor, running sums) has `state_dict()` and `load_state_dict()`, and none of them talks
to other processes: the checkpointer gathers what has to be gathered itself, in one collective, so
asking a part for its state can never hang a torchrun job. A checkpoint is {part name: its state}
plus a few plain values (the options, class names, tracker run ids). The state is copied to host
memory at once (the next steps change the live tensors) and written on the writer thread
(utils/background.py); which files are kept is the CheckpointKeeper's job (utils/checkpoint_keeper.py).
"""

import dataclasses
import hashlib
import os

import numpy as np
import torch

from utils.distributed import all_gather_objects, is_main_process, rank, world_size
from utils.errors import KilnError
from utils.seeding import rng_states, set_rng_states


@dataclasses.dataclass
class Position:
    """Where the loop is: epochs completed, batches of the current epoch done, optimizer steps made,
    whether the validation due at this step is still to run (a stop signal came first), and the learning
    rate the last step applied (what train/lr shows: the scheduler has moved on to the next step's)."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    validation_due: bool = False
    lr: float | None = None

    def state_dict(self):
        return dataclasses.asdict(self)

    def load_state_dict(self, state):
        self.epoch, self.batch, self.step = state['epoch'], state['batch'], state['step']
        self.validation_due = state.get('validation_due', False)  # absent from checkpoints of earlier Kilns
        self.lr = state.get('lr')


class TrainingData:
    """What a resumed run checks of its training data: the number of samples and, for a dataset that lists
    them (`samples` of (path, target, ...), as data/list_dataset.py), a digest of their file names and
    targets in order (not their folders: the data may have moved). Loading refuses a checkpoint made on
    other data. (The sample order is no part of it: it follows from --seed and the epoch.)"""

    def __init__(self, batches):
        self.batches, self._digest = batches, ()  # (): not made yet

    def digest(self):
        """The digest of the dataset's samples (None for a dataset without `samples` of (path, target, ...)
        each, as ListDataset's), made once (under a second for a million samples)."""
        if self._digest == ():
            samples = getattr(self.batches.dataset, 'samples', None)
            listed = isinstance(samples, list) and all(
                isinstance(sample, tuple) and len(sample) >= 2 and isinstance(sample[0], str) for sample in samples
            )
            self._digest = None
            if listed:
                names = '\n'.join([path.rpartition(os.sep)[2] for path, *_ in samples])
                digest = hashlib.sha256(os.fsencode(names))
                digest.update(os.fsencode(repr([_named_target(target) for _, target, *_ in samples])))
                self._digest = digest.hexdigest()
        return self._digest

    def state_dict(self):
        return {'samples': len(self.batches.dataset), 'digest': self.digest()}

    def load_state_dict(self, state):
        # (an earlier Kiln kept its epoch's sample order, as long as the data)
        saved, count = state['samples'] if 'order' not in state else len(state['order']), len(self.batches.dataset)
        if saved != count:  # a list or class folders that changed since
            raise KilnError(
                f'the training data have {count} samples now, the checkpoint was trained on {saved}: '
                f'resume on the data it started with, or train on these in a new run from its weights '
                f'(--load_model_path)'
            )
        if state.get('digest') is not None and self.digest() is not None and state['digest'] != self.digest():
            raise KilnError(
                'the training data differ from those the checkpoint was trained on (file names or targets, '
                'in order); resume with the same --train_list, or train on these in a new run from its '
                'weights (--load_model_path)'
            )


def _named_target(target):
    """A sample's target as its digest reads it: a file by its name, boxes and labels (arrays) by their
    bytes, a number as it is."""
    if isinstance(target, str):
        return target.rpartition(os.sep)[2]
    if isinstance(target, tuple):
        return ' '.join(np.asarray(part).tobytes().hex() for part in target)
    return target


class RandomStates:
    """This process's random generators (python, numpy, torch, CUDA)."""

    def state_dict(self):
        return rng_states()

    def load_state_dict(self, state):
        set_rng_states(state)


def add_up(states):
    """The element-wise sum of several processes' states of one part (dicts by key, lists and tuples by
    position, tensors and numbers added)."""
    first = states[0]
    if isinstance(first, dict):
        keys = dict.fromkeys(key for state in states for key in state)
        return {key: add_up([state[key] for state in states if key in state]) for key in keys}
    if isinstance(first, (list, tuple)):
        return type(first)(add_up(list(values)) for values in zip(*states))
    return sum(states[1:], first)


def zeroed(state):
    """`state` with every count and sum at zero (tensors, ints and floats; the keys, shapes and other
    values kept): what a process other than rank 0 loads of the summed parts, so that its names and
    shapes are the ones rank 0 adds up with in the next collective."""
    if isinstance(state, dict):
        return {key: zeroed(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(zeroed(value) for value in state)
    if torch.is_tensor(state):
        return torch.zeros_like(state)
    return type(state)(0) if type(state) in (int, float) else state


PLAIN = {int, float, str, bool, type(None)}  # values host_copy hands over as they are


def host_copy(state):
    """A copy of `state` with every tensor copied to host memory, so the run can go on changing its own
    tensors while this copy is written. GPU tensors are copied without waiting (call `.wait()` on the
    result's `ready` before reading them)."""
    if torch.is_tensor(state):
        return state.detach().to('cpu', non_blocking=True, copy=True)
    if isinstance(state, dict):
        copy = type(state)((key, host_copy(value)) for key, value in state.items())
        if hasattr(state, '_metadata'):  # a module's state_dict: versions its load_state_dict reads
            copy._metadata = state._metadata
        return copy
    if isinstance(state, (list, tuple)) and not hasattr(state, '_fields'):
        if all(type(value) in PLAIN for value in state):  # a history's numbers: nothing to copy one by one
            return type(state)(state)
        return type(state)(host_copy(value) for value in state)
    return state


class Snapshot:
    """A run's state copied to host memory (`host_copy`); `get()` returns it once the copies are done."""

    def __init__(self, state):
        self.state = host_copy(state)
        self.copied = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.copied = torch.cuda.Event()
            self.copied.record()

    def get(self):
        if self.copied is not None:
            self.copied.synchronize()
        return self.state


class Checkpointer:
    """Saves and restores the state of `parts` ({name: stateful object}).

    Names in `per_process` are parts each process has its own of (random generators: all are saved,
    each process gets its own back); names in `summed` hold counts that the checkpoint keeps added up
    over every process (restored on rank 0 alone). `late_parts` (the trackers) give their state on the
    writer thread, right before the file is written, after every point they were sent. `keeper`
    (rank 0's CheckpointKeeper, None elsewhere; train.py sets it once a resumed checkpoint is accepted)
    writes the files through `writer`.
    """

    def __init__(self, parts, *, per_process=(), summed=(), late_parts=None, writer=None):
        self.parts, self.per_process, self.summed = parts, tuple(per_process), tuple(summed)
        self.late_parts, self.writer = late_parts or {}, writer
        self.keeper = None  # set by train.py on rank 0 (see the class)
        self.previous_write = None

    def state_dict(self):
        """The state of every part, less `late_parts` (every process must call it: one collective gathers
        the per-process states and the sums)."""
        state = {name: part.state_dict() for name, part in self.parts.items()}
        shared = {name: state.pop(name) for name in self.per_process + self.summed}
        gathered = all_gather_objects(shared)
        for name in self.per_process:
            state[name] = {'per_rank': [process[name] for process in gathered]}
        for name in self.summed:
            state[name] = add_up([process[name] for process in gathered])
        return state

    def save(self, epoch, step, metric=None, is_best=False, extra=None):
        """Take the state of (epoch, step) now and have rank 0's writer thread write it; `metric` is its
        --monitor value; `extra` holds plain values the file also keeps (the options, ...), given fresh
        (they are not copied). At most one checkpoint waits to be written: a second waits for the first."""
        state = self.state_dict()
        if self.keeper is None:
            return
        if self.previous_write is not None:  # one copy of the state in memory, not one per pending save
            self.previous_write.wait()  # over, even when a failed job before it cancelled it: submit raises
        snapshot = Snapshot(state)
        self.previous_write = self.writer.submit(self._write, snapshot, extra or {}, epoch, step, metric, is_best)

    def _write(self, snapshot, extra, epoch, step, metric, is_best):
        state = {**snapshot.get(), **extra}
        state.update({name: part.state_dict() for name, part in self.late_parts.items()})
        self.keeper.save(state, epoch, step, metric, is_best)

    @staticmethod
    def step_of(checkpoint, source):
        """The optimizer step of a full training checkpoint (from the file `source`); a KilnError for another file."""
        if not isinstance(checkpoint.get('position'), dict):
            raise not_a_training_checkpoint(source, 'position')
        return checkpoint['position']['step']

    def load(self, checkpoint, source):
        """Continue from `checkpoint` (a state_dict loaded from the file `source`)."""
        try:
            for name, part in self.parts.items():
                state = checkpoint[name]
                if name in self.per_process:
                    states = state['per_rank']
                    state = states[rank()] if len(states) == world_size() else states[0]
                elif name in self.summed and not is_main_process():
                    # rank 0 holds everyone's sums; the others count from zero, under the same names (a
                    # validation before any step, left due by a stop signal, adds up recorder names at once)
                    state = zeroed(state)
                part.load_state_dict(state)
        except KeyError as error:
            raise not_a_training_checkpoint(source, error) from None
        except (ValueError, RuntimeError) as error:
            advice = 'resume with the options it was trained with'
            if 'parameter group' in str(error):  # the optimizer's groups are utils/finetune.py's layer groups,
                # which an earlier Kiln drew otherwise for some timm models (their own parameters, a second head)
                advice += (
                    ', or, where those are the same, it was saved by an earlier Kiln that grouped the layers '
                    'otherwise: start a new run from its weights (--load_model_path)'
                )
            raise KilnError(
                f'{source} does not fit the current options ({str(error).splitlines()[0]}); {advice}'
            ) from None


def not_a_training_checkpoint(source, missing):
    """The error for a --resume file that lacks the part `missing`."""
    return KilnError(
        f'{source} is not a full training checkpoint of this Kiln (it has no {missing}); to start '
        f'a new run from its weights use --load_model_path instead of --resume'
    )
