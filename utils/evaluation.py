"""The one evaluation loop: validation during training and eval.py both run it.

It adds up the task's metrics and the loss over the whole split, and can keep per-sample rows and
pictures of chosen batches. Under torchrun each process evaluates whole batches of the ones one
process evaluates (data/sampler.py); their losses, rows and pictures are gathered and put back in
the batches' order, so the results are one process's to the bit.
"""

import dataclasses
import math

import torch

from data.sampler import in_global_order
from metrics import BatchedUpdates
from utils.checkpointer import Snapshot
from utils.distributed import all_gather_objects, is_main_process, without_ddp
from utils.progress import progress


@dataclasses.dataclass
class Evaluation:
    """What `evaluate` found: `metrics` ({'loss': ..., ...}), the task's metric object after `compute`
    (e.g. its confusion matrix) and `rows`: per sample in split order, its list of rows (`task.eval_rows`)."""

    metrics: dict
    metric_object: object
    rows: list


def first(values, count):
    """The first `count` samples of a batch: a tensor, or a dict of them."""
    return {key: first(value, count) for key, value in values.items()} if isinstance(values, dict) else values[:count]


@torch.no_grad()
def evaluate(
    model,
    batches,
    task,
    autocast,
    *,
    class_names=None,
    keep_rows=False,
    picture_batches=(),
    pictures=None,
    progress_bar=False,
    description='val',
):
    """Run `model` over every batch of `batches` (a data.loader.Batches) in eval mode.

    `class_names` adds per-class metrics; `keep_rows` collects `task.eval_rows`. `picture_batches` are
    the numbers of the batches (as one process has them) whose first `task.pictured` samples go to
    `pictures` on rank 0, called as `pictures(number, source)`: rank 0's own as soon as they are copied,
    so that they are drawn (see utils/logger.py) while the evaluation goes on, other ranks' at the end;
    `source.get()` gives (batch, outputs) on the host once copied.
    """
    model = without_ddp(model)
    model.eval()
    metrics = BatchedUpdates(task.metrics())  # a few kernels per 32 batches, not per batch
    losses, weights = [], []  # per batch: its loss times what it is the mean over, and that; added up at the end
    rows, held = [], {}  # per batch: its rows; pictures of this process's batches for rank 0
    numbers = batches.numbers()
    evaluated = progress(batches.epoch(0), progress_bar, description, total=len(numbers))
    for batch, number in zip(evaluated, numbers, strict=True):
        with autocast():
            outputs = task.forward(model, batch)
            loss = task.loss(outputs, batch)
        outputs = task.outputs_to_float(outputs)
        weight = task.loss_weight(batch)  # a number on the host (a copy to the GPU would wait for it), or a tensor
        losses.append(loss.detach().double() * weight)
        weights.append(weight)
        metrics.update(outputs, batch)
        if keep_rows:
            rows.append(task.eval_rows(batch, outputs))
        if number in picture_batches and pictures is not None:
            source = Snapshot((first(batch, task.pictured), first(outputs, task.pictured)))
            if is_main_process():
                pictures(number, source)
            else:
                held[number] = source
    on_device = [weight.double() for weight in weights if torch.is_tensor(weight)]
    values = torch.stack(losses + on_device).tolist() if losses else []  # one sync
    own_losses, counted = values[: len(losses)], iter(values[len(losses) :])
    own_weights = [next(counted) if torch.is_tensor(weight) else float(weight) for weight in weights]
    pictured = {number: source.get() for number, source in held.items()}
    per_rank = all_gather_objects((own_losses, own_weights, rows, pictured))
    losses, weights, rows = (in_global_order([process[part] for process in per_rank]) for part in range(3))
    if is_main_process():
        for number, source in sorted(item for *_, elsewhere in per_rank for item in elsewhere.items()):
            pictures(number, Snapshot(source))
    # the batches' weighted losses added up exactly (fsum) on the host: one process's sum, on any device
    results = {'loss': math.fsum(losses) / max(math.fsum(weights), 1), **metrics.compute(class_names)}
    rows = [sample_rows for batch_rows in rows for sample_rows in batch_rows]
    return Evaluation(results, metrics.metrics, rows)
