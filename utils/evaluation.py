"""The one evaluation loop: validation during training and eval.py both run it.

It adds up the task's metrics and the loss over the whole split (exactly, over every torchrun
process), and can keep per-sample rows (in the split's order, gathered from every process) and
pictures of chosen batches.
"""

import dataclasses

import torch

from metrics import BatchedUpdates, reduced
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
    the batch numbers whose first `task.pictured` samples go to `pictures` (on rank 0), called as
    `pictures(number, source)` as soon as they are copied, so that they are drawn (see utils/logger.py)
    while the evaluation goes on; `source.get()` gives (batch, outputs) on the host once copied.
    """
    model = without_ddp(model)
    model.eval()
    metrics = BatchedUpdates(task.metrics())  # a few kernels per 32 batches, not per batch
    losses, counts = [], []  # per batch: its mean loss and samples, added up at the end in one go
    rows = []
    for i, batch in enumerate(progress(batches.epoch(0), progress_bar, description, total=len(batches))):
        with autocast():
            outputs = task.forward(model, batch)
            loss = task.loss(outputs, batch)
        outputs = task.outputs_to_float(outputs)
        losses.append(loss.detach())
        counts.append(task.count(batch))
        metrics.update(outputs, batch)
        if keep_rows:
            rows += task.eval_rows(batch, outputs)
        if i in picture_batches and pictures is not None and is_main_process():
            pictures(i, Snapshot((first(batch, task.pictured), first(outputs, task.pictured))))
    loss_sum = torch.zeros((), dtype=torch.float64)
    if losses:
        loss_sum = torch.stack(losses).double() @ torch.tensor(counts, dtype=torch.float64, device=losses[0].device)
    total_loss, total = reduced(loss_sum, torch.tensor(float(sum(counts))))
    results = {'loss': (total_loss / total.clamp(min=1)).item(), **metrics.compute(class_names)}
    if keep_rows:  # every process has every world_size-th sample: put them back in order
        per_rank = all_gather_objects(rows)
        rows = [per_rank[i % len(per_rank)][i // len(per_rank)] for i in range(sum(map(len, per_rank)))]
    return Evaluation(results, metrics.metrics, rows)
