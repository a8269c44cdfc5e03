"""Metrics that add up exactly over a whole split: counts kept on the device, reduced once.

A metric object takes `update(outputs, batch)` for every batch (device tensors, no host sync) and
`compute()` once at the end, which adds up the counts of every torchrun process, so validation,
eval.py and one or many processes all give the same numbers. Tasks pick theirs in tasks/*.py.
"""

import torch

from utils.distributed import all_reduce_sum, collective_device


def topk_hits(logits, targets, k):
    """Per sample, whether the true class is among the k highest scores (bool tensor): fewer than k
    classes rank above it, a tie going to the lower class index as argmax decides it (so top-1 is the
    accuracy, and constant outputs score no better than a guess); a NaN score ranks above every number
    and NaNs tie, as argmax and topk have it. Counting them is 4x faster than `topk` on a CPU."""
    own, targets = logits.gather(1, targets.unsqueeze(1)), targets.unsqueeze(1)
    lower = torch.arange(logits.shape[1], device=logits.device) < targets
    nan, own_nan = logits.isnan(), own.isnan()
    tied = (logits == own) | nan & own_nan
    above = (logits > own) | nan & ~own_nan | tied & lower
    return above.sum(dim=1) < k


def confusion_matrix(predictions, targets, num_classes, into=None, ignore=None):
    """Counts (num_classes, num_classes): row = true class, column = predicted class; with `into` (such
    counts, on the device of `targets`), added to it in place, so that a split's counting makes no
    num_classes² tensor per batch.

    Built with an accumulating index_put (not bincount, whose output size is data-dependent and
    so waits for the GPU).
    """
    targets = targets.flatten().long()  # (uint8 targets would wrap)
    index = targets * num_classes + predictions.flatten().long()
    counts = torch.ones_like(index)
    if ignore is not None:  # targets of value `ignore` count nothing (at cell 0: no data-dependent shape)
        counts = (targets != ignore).long()
        index = index * counts
    if into is None:
        into = torch.zeros(num_classes, num_classes, dtype=torch.long, device=index.device)
    into.view(-1).index_put_((index,), counts, accumulate=True)
    return into


def accuracy_from_confusion(matrix):
    """Overall accuracy and per-class recall from a confusion matrix (NaN for a class with no samples: a
    0 would read as a class always missed)."""
    matrix = matrix.double()
    per_class = matrix.diagonal() / matrix.sum(dim=1)  # 0/0 = NaN
    return matrix.diagonal().sum() / matrix.sum().clamp(min=1), per_class


def iou_from_confusion(matrix):
    """Per-class intersection over union from a confusion matrix (NaN for classes never seen)."""
    matrix = matrix.double()
    intersection = matrix.diagonal()
    union = matrix.sum(dim=0) + matrix.sum(dim=1) - intersection
    return intersection / union  # 0/0 = NaN: absent from both prediction and truth


def reduced(*tensors):
    """Host copies of `tensors` summed over all torchrun processes (one collective, one sync)."""
    flat = torch.cat([t.detach().double().flatten().to(collective_device()) for t in tensors])
    all_reduce_sum(flat)
    parts, start = [], 0
    for tensor in tensors:
        parts.append(flat[start : start + tensor.numel()].view(tensor.shape).cpu())
        start += tensor.numel()
    return parts


def add_counts(total, counts):
    """`total + counts`, or `counts` where nothing was counted yet. Counters a resume loaded sit on the
    CPU until the first update moves them to the device of the batch."""
    return counts if total is None else total.to(counts.device) + counts


class ConfusionMetrics:
    """The confusion matrix of argmax predictions against `batch[target]` over a split, summed on
    the device; subclasses turn it into metrics. After `compute`, `confusion` is the reduced matrix."""

    def __init__(self, num_classes, target, ignore=None):
        self.num_classes, self.target, self.ignore = num_classes, target, ignore
        self.confusion = None
        self.reset()

    def reset(self):
        """Start counting again (a new interval of training batches). The counters are made on the first
        update, on its device: copying zeros there would make the GPU wait."""
        self.matrix = None

    def update(self, logits, batch):
        """Add one batch of class scores `logits` (N, C, ...) and targets `batch[target]` (N, ...)."""
        targets = batch[self.target]
        into = None if self.matrix is None else self.matrix.to(targets.device)  # a resume's counts: on the CPU
        self.matrix = confusion_matrix(logits.argmax(dim=1), targets, self.num_classes, into, self.ignore)

    def totals(self):
        """The counters as tensors (zeros before any update)."""
        return [
            getattr(self, name) if getattr(self, name) is not None else torch.zeros(shape, dtype=torch.long)
            for name, shape in zip(self.sums, self.shapes())
        ]

    def shapes(self):
        return [(self.num_classes, self.num_classes)]

    def reduce(self):
        """The counters summed over all processes, as host tensors (one collective); sets `confusion`."""
        self.confusion, *rest = (t.long() for t in reduced(*self.totals()))
        return rest

    sums = ('matrix',)  # the counters a checkpoint keeps

    def state_dict(self):
        """This process's counters, as host tensors of their own (no communication: the checkpointer adds
        up those of every process)."""
        return {name: total.detach().to('cpu', torch.long, copy=True) for name, total in zip(self.sums, self.totals())}

    def load_state_dict(self, state):
        """Continue counting from `state_dict` (under torchrun, rank 0 loads everyone's counts)."""
        for name in self.sums:
            setattr(self, name, state[name].clone())


class ClassificationMetrics(ConfusionMetrics):
    """Accuracy `acc`, top-k accuracy `top<k>` (see `names`) and, in detail, the recall of each class.
    Without `per_class` (the training curves, which show no recall), it keeps three counts instead of
    the confusion matrix: its C² counts in every checkpoint grew to megabytes with a thousand classes."""

    def __init__(self, num_classes, topk=3, target='label', monitor=None, per_class=True):
        self.k, self.monitor = topk, monitor
        self.sums = ('matrix', 'hits') if per_class else ('correct', 'count', 'hits')  # what a checkpoint keeps
        super().__init__(num_classes, target)

    @staticmethod
    def names(num_classes, topk, monitor=None):
        """The metrics `compute` returns (besides the recalls): 'acc', and 'top<k>' unless k >= num_classes,
        where every label is among the k highest scores and it would always read 1 (num_classes None: not
        known yet, so kept; kept too where `monitor`, the run's --monitor, names it: the run chose it)."""
        kept = num_classes is None or topk < num_classes or str(monitor).endswith(f'/top{topk}')
        return ['acc'] + ([f'top{topk}'] if kept else [])

    def reset(self):
        super().reset()
        self.correct = self.count = self.hits = None

    def update(self, logits, batch):
        targets = batch[self.target]
        if 'matrix' in self.sums:
            super().update(logits, batch)
        else:
            self.correct = add_counts(self.correct, (logits.argmax(dim=1) == targets).sum())
            self.count = add_counts(self.count, torch.full((), targets.numel(), device=targets.device))
        self.hits = add_counts(self.hits, topk_hits(logits, targets, self.k).sum())

    def shapes(self):
        return super().shapes() + [()] if 'matrix' in self.sums else [(), (), ()]

    def load_state_dict(self, state):
        if 'matrix' in state and 'matrix' not in self.sums:  # a checkpoint of a Kiln that kept the matrix
            state = {'correct': state['matrix'].trace(), 'count': state['matrix'].sum(), 'hits': state['hits']}
        super().load_state_dict(state)

    def compute(self, class_names=None):
        """{'acc', 'top<k>'} and, with `class_names` (and `per_class`), 'recall/<name>' for each class (a
        collective)."""
        if 'matrix' in self.sums:
            (hits,) = self.reduce()
            accuracy, recall = accuracy_from_confusion(self.confusion)
            accuracy, count = accuracy.item(), self.confusion.sum().item()
        else:
            correct, count, hits = (t.item() for t in reduced(*self.totals()))
            accuracy, recall = correct / max(count, 1), None
        metrics = {'acc': accuracy, f'top{self.k}': int(hits) / max(count, 1)}
        metrics = {name: metrics[name] for name in self.names(self.num_classes, self.k, self.monitor)}
        if class_names and recall is not None:
            metrics.update({f'recall/{name}': value for name, value in zip(class_names, recall.tolist())})
        return metrics


class SegmentationMetrics(ConfusionMetrics):
    """Pixel accuracy `pixel_acc` and mean IoU `miou` (over the classes present) of every pixel;
    in detail, the IoU of each class."""

    def __init__(self, num_classes, target='mask', ignore=None):
        super().__init__(num_classes, target, ignore)

    def compute(self, class_names=None):
        """{'pixel_acc', 'miou'} and, with `class_names`, 'iou/<name>' for each class (a collective)."""
        self.reduce()
        iou = iou_from_confusion(self.confusion)
        accuracy, _ = accuracy_from_confusion(self.confusion)
        metrics = {'pixel_acc': accuracy.item(), 'miou': iou.nanmean().item()}
        if class_names:
            metrics.update({f'iou/{name}': value for name, value in zip(class_names, iou.tolist())})
        return metrics


class BatchedUpdates:
    """A metric object for the training loop: `update` only keeps the batch's outputs and targets (no
    kernel runs), and every `every` batches, or once they hold `budget` output values, the wrapped
    `metrics` take them concatenated in one `update`: a dozen small kernels per group of steps instead
    of per step. Valid for every metric here, which adds up per-sample counts; batches whose targets
    cannot be concatenated (padded boxes of different lengths) are added one by one. `prepare` turns
    kept outputs into what the metrics take (e.g. float32 from mixed precision), once per group."""

    def __init__(self, metrics, prepare=lambda outputs: outputs, every=32, budget=1 << 22):
        self.metrics, self.prepare, self.every, self.budget = metrics, prepare, every, budget
        self.kept, self.size = [], 0

    def update(self, outputs, batch):
        """Keep a batch's outputs and targets (everything but the images); outputs that are not one
        tensor (a dict of them) are added at once."""
        if not torch.is_tensor(outputs):
            self.metrics.update(self.prepare(outputs), batch)
            return
        self.kept.append((outputs.detach(), {key: value for key, value in batch.items() if key != 'image'}))
        self.size += outputs.numel()
        if len(self.kept) >= self.every or self.size >= self.budget:
            self.flush()

    def flush(self):
        """Hand the kept batches to the wrapped metrics."""
        kept, self.kept, self.size = self.kept, [], 0
        if len(kept) > 1:
            try:
                outputs = torch.cat([outputs for outputs, _ in kept])
                kept = [(outputs, {key: torch.cat([batch[key] for _, batch in kept]) for key in kept[0][1]})]
            except RuntimeError:  # shapes that differ beyond the batch dimension
                pass
        for outputs, batch in kept:
            self.metrics.update(self.prepare(outputs), batch)

    def compute(self, class_names=None):
        self.flush()
        return self.metrics.compute(class_names)

    def reset(self):
        self.kept, self.size = [], 0
        self.metrics.reset()

    def state_dict(self):
        self.flush()
        return self.metrics.state_dict()

    def load_state_dict(self, state):
        self.reset()
        self.metrics.load_state_dict(state)
