"""An exponential moving average of the weights (--ema_decay): what validation, best.pth, eval.py and
predict.py use when it is on."""

import copy

import torch
import torch.distributed as dist

from utils.checkpoint import unwrap_model
from utils.distributed import is_distributed


class ModelEma:
    """A copy of the model whose weights follow the trained ones: after every optimizer step,
    ema = d * ema + (1 - d) * weights with d = min(decay, (1 + n) / (10 + n)) at the n-th step (TensorFlow's
    ExponentialMovingAverage with num_updates), so early steps are not drowned by the random start. One
    fused foreach kernel on the device and no host sync per step; a stateful part of the checkpoint (its
    weights and n)."""

    def __init__(self, model, decay):
        self.decay, self.updates = decay, 0
        model = unwrap_model(model)
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        # parameters and buffers, not the state dict: a tied weight is listed there once per name, and would
        # be averaged as often (the decay squared)
        pairs = list(zip([*self.module.parameters(), *self.module.buffers()], [*model.parameters(), *model.buffers()]))
        self.floats = [list(side) for side in zip(*[pair for pair in pairs if pair[0].is_floating_point()])] or [[], []]
        self.others = [pair for pair in pairs if not pair[0].is_floating_point()]  # BatchNorm's batch counts

    def update(self):
        """Move the average towards the model's current weights (after an optimizer step)."""
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        with torch.no_grad():
            torch._foreach_lerp_(self.floats[0], self.floats[1], 1 - decay)

    def agree(self):
        """Under torchrun, give every process rank 0's averaged buffers (BatchNorm's running statistics
        follow each process's own batches; the weights agree already): validation, which every process
        runs on its share of the images, then uses the average that rank 0 saves. A collective."""
        if is_distributed():
            for buffer in self.module.buffers():
                if buffer.is_floating_point():
                    dist.broadcast(buffer, 0)

    def state_dict(self):
        with torch.no_grad():
            for average, current in self.others:
                average.copy_(current)
        return {'module': self.module.state_dict(), 'updates': self.updates}

    def load_state_dict(self, state):
        self.module.load_state_dict(state['module'])
        self.updates = state['updates']
