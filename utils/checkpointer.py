"""The checkpointer: a training run's full state, collected from its stateful parts.

Each part (model, optimizer, scheduler, gradient scaler, position in the data, random states,
history, monitor, running sums) has `state_dict()` and `load_state_dict()`; a checkpoint is
{part name: its state} plus a few plain values (the options, class names, tracker run ids). Which
files are kept is the CheckpointKeeper's job (utils/checkpoint_keeper.py).
"""

import dataclasses

import torch

from utils.distributed import all_gather_objects, barrier, is_main_process, rank, world_size
from utils.errors import KilnError
from utils.seeding import rng_states, set_rng_states


@dataclasses.dataclass
class Position:
    """Where the loop is: epochs completed, batches of the current epoch done, optimizer steps made."""

    epoch: int = 0
    batch: int = 0
    step: int = 0

    def state_dict(self):
        return dataclasses.asdict(self)

    def load_state_dict(self, state):
        self.epoch, self.batch, self.step = state['epoch'], state['batch'], state['step']

    def data_order(self, batches):
        """A part that keeps the current epoch's sample order, to check that a resumed run reads the same data."""
        return DataOrder(self, batches)


class DataOrder:
    """The sample order of the position's epoch; loading refuses a checkpoint made on other data."""

    def __init__(self, position, batches):
        self.position, self.batches = position, batches

    def state_dict(self):
        return {'order': torch.tensor(self.batches.order(self.position.epoch), dtype=torch.int32)}

    def load_state_dict(self, state):
        if state['order'].tolist() != self.batches.order(self.position.epoch):
            raise KilnError(
                'the training data or --seed differ from those of the checkpoint; resume with the same '
                '--train_list and --seed'
            )


class RandomStates:
    """The random generators of every process (each resumes its own)."""

    def state_dict(self):
        return {'per_rank': all_gather_objects(rng_states())}

    def load_state_dict(self, state):
        states = state['per_rank']
        set_rng_states(states[rank()] if len(states) == world_size() else states[0])


class Checkpointer:
    """Saves and restores the state of `parts` ({name: stateful object}); `rank_zero_parts` hold sums
    over every process and are restored on rank 0 only. `keeper` (rank 0's CheckpointKeeper) writes
    the files."""

    def __init__(self, parts, rank_zero_parts, keeper):
        self.parts, self.rank_zero_parts, self.keeper = parts, rank_zero_parts, keeper

    def state_dict(self, extra=None):
        """The full state (every process must call it: random states and sums are gathered)."""
        state = {name: part.state_dict() for name, part in {**self.parts, **self.rank_zero_parts}.items()}
        return {**state, **(extra or {})}

    def save(self, epoch, step, metric=None, is_best=False, extra=None):
        """Save the state as the checkpoint of (epoch, step) on rank 0; `metric` is its --monitor value."""
        state = self.state_dict(extra)
        if is_main_process():
            self.keeper.save(state, epoch, step, metric, is_best)
        barrier()

    def load(self, checkpoint, source):
        """Continue from `checkpoint` (a state_dict loaded from the file `source`)."""
        try:
            for name, part in self.parts.items():
                part.load_state_dict(checkpoint[name])
            if is_main_process():
                for name, part in self.rank_zero_parts.items():
                    part.load_state_dict(checkpoint[name])
        except KeyError as error:
            raise KilnError(
                f'{source} is not a full training checkpoint of this Kiln (it has no {error}); to start '
                f'a new run from its weights use --load_model_path instead of --resume'
            ) from None
        except (ValueError, RuntimeError) as error:
            raise KilnError(
                f'{source} does not fit the current options ({str(error).splitlines()[0]}); '
                f'resume with the options it was trained with'
            ) from None
