"""The Task: everything a kind of problem needs beyond the loop, in one object used by train.py,
eval.py and predict.py alike.

A task file (tasks/classify.py, tasks/segment.py, ...) subclasses Task and fills in:
- its defaults: model, datasets, loss, monitored metric;
- the batch contract: what a batch holds (`targets`), how samples are collated, how they are
  counted (batches are dicts of device tensors, e.g. {'image', 'label'}; see data/loader.py);
- `forward` and `loss`;
- `metrics()`: an object that adds up a whole split exactly (see metrics.py), the same in
  validation and in eval.py, under one process or many;
- `pictures` for TensorBoard and eval, `eval_rows` for eval's predictions.csv, and `predict_rows`
  for predict.py.
Register it with one line in tasks/task_entry.py; no loop, option or entry script changes.
"""

import torch

from data.augment import denormalize, normalization
from data.loader import pad_collate
from utils.errors import KilnError


class Task:
    """Base of all tasks: single-tensor image models whose batch holds 'image' and `targets`."""

    default_model = 'small_cnn'  # --model_type when none is given
    default_data = ('shapes', 'list')  # --data_type when none is given: without / with list files
    default_loss = 'cross_entropy'  # --loss, a LOSSES name (loss.py); None: `loss` is the task's own, --loss unused
    default_image_size = 32  # --img_size
    monitor = 'val/acc'  # default --monitor, and its --monitor_mode
    monitor_mode = 'max'
    minimized = ()  # names of this task's metrics that are better lower, beyond losses and errors (options.py)
    targets = ('label',)  # the batch keys a dataset must provide besides 'image'
    pictured = 8  # samples per pictured batch: `pictures` gets the first ones of a batch
    mixes = False  # whether `loss` and `metric_targets` take mixed batches (mixup, cutmix: data/augment.Mix)
    min_classes = 2  # fewer make every answer right: a class to tell apart from another (or from background)

    def __init__(self, options, class_names=None):
        """`options` are the run's resolved options (num_classes is set); `class_names` may be None."""
        from loss import select_loss

        self.options, self.num_classes = options, options.num_classes
        # a name per output: classes beyond the named ones (a larger --num_classes) go by their number
        names = list(class_names or [])
        self.class_names = names + [str(c) for c in range(len(names), self.num_classes)]
        own = self.default_loss is None  # `loss` is the task's own: a --loss given is said to be ignored (options.py)
        self.criterion = None if own else select_loss(options.loss or self.default_loss)

    @classmethod
    def metric_names(cls, options):
        """The names `metrics().compute()` returns, plus 'loss': checked against --monitor before training."""
        return ['loss']

    @classmethod
    def train_metric_names(cls, options):
        """The names the training curves have (train/<name>): `metric_names`, unless `train_metrics` gives
        fewer (then say which)."""
        return cls.metric_names(options)

    def check_dataset(self, dataset, data_type):
        """Refuse, with one line, a dataset that does not provide this task's targets."""
        provided = tuple(getattr(dataset, 'targets', ('label',)))
        if not set(self.targets) <= set(provided):
            raise KilnError(
                f'--task {self.options.task} needs a dataset that gives {", ".join(self.targets)}, but '
                f"--data_type {data_type} gives {', '.join(provided)}; use one of this task's datasets "
                f'(e.g. --data_type {self.default_data[0]}, or {self.default_data[1]} with list files)'
            )
        if self.num_classes < self.min_classes:
            raise KilnError(
                f'--task {self.options.task} needs {self.min_classes} classes or more, but the training data has '
                f'{self.num_classes} ({", ".join(self.class_names)}): with one, every answer is right and the '
                f'metrics say nothing; add the other classes (a folder or a label each) (a task of one output, '
                f'a regression, sets min_classes = 1 in its class)'
            )

    # the batch contract -------------------------------------------------------------------------
    def collate(self, samples):
        """Turn a list of sample dicts (from a dataset read from disk) into one batch dict."""
        return pad_collate(samples)

    def count(self, batch):
        """The number of samples in a batch (weights the means)."""
        return len(batch['image'])

    def loss_weight(self, batch):
        """What a batch's loss is the mean over, which weighs it in a split's mean loss: its samples (a
        number); a task whose loss leaves out some of each sample's parts (pixels) says how many it kept
        (a tensor on the device: no sync)."""
        return self.count(batch)

    # model ----------------------------------------------------------------------------------------
    def forward(self, model, batch):
        """The model's outputs for a batch."""
        return self.check_outputs(model(batch['image']))

    def check_outputs(self, outputs):
        """`outputs`, when the model gives what this task reads (their shape, not their values: no host sync);
        a KilnError naming the model otherwise (a classifier given to --task segment, say)."""
        return outputs

    def wrong_outputs(self, shown, wanted):
        """The KilnError for a model whose outputs (`shown`) are not what this task reads (`wanted`)."""
        return KilnError(
            f'--model_type {self.options.model_type} gives {shown}, and --task {self.options.task} reads {wanted}: '
            f'give a model made for it (its own: --model_type {self.default_model})'
        )

    def loss(self, outputs, batch):
        """The loss of one batch (a scalar tensor); of a mixed batch (mixup, cutmix), against its mixed targets."""
        if 'mix_lam' in batch:
            return self.criterion(outputs.float(), self.mixed_targets(batch))
        return self.criterion(outputs, batch[self.targets[0]])

    def mixed_targets(self, batch):
        """The targets of a mixed batch (tasks with `mixes` give them: e.g. class probabilities)."""
        raise NotImplementedError

    def metric_targets(self, batch):
        """The batch as the train metrics see it (a mixed batch: the target of the larger share)."""
        return batch

    def outputs_to_float(self, outputs):
        """Outputs in float32 (mixed precision gives half-precision ones), for metrics and pictures."""
        return outputs.float()

    # metrics, pictures, rows --------------------------------------------------------------------------
    def metrics(self):
        """A fresh metric object for one split or interval: `update(outputs, batch)` and
        `compute(class_names=None)` (a dict of numbers; under torchrun it adds up every process's counts);
        as train metrics also `reset()`, and `state_dict()`/`load_state_dict(state)` of counts that add up
        over processes (a checkpoint keeps them): see metrics.ConfusionMetrics."""
        raise NotImplementedError

    def train_metrics(self):
        """The metric object for training curves (defaults to `metrics()`; None for none)."""
        return self.metrics()

    def display_images(self, batch, count):
        """The first `count` images of a batch as float (N, 3, H, W) in [0, 1] for pictures."""
        return denormalize(batch['image'][:count], normalization(self.options))

    def pictures(self, batch, outputs):
        """Pictures of (the first `pictured` samples of) a batch as {name: HxWx3 uint8 array} (TensorBoard
        'val/<name>', eval '<name>_batchN.png'); drawn on the Logger's writer thread from host copies."""
        return {}

    def result_pictures(self, metrics_object):
        """Pictures of a whole evaluated split (e.g. the confusion matrix) as {file stem: array}."""
        return {}

    eval_header = ('image',)

    def eval_rows(self, batch, outputs):
        """Per sample of a batch with targets, a list of predictions.csv rows (after the image path column)."""
        return [[] for _ in range(self.count(batch))]

    predict_header = ('image',)

    def predict_rows(self, batch, outputs, paths, folder):
        """Per image of an unlabelled batch, the predictions.csv rows of predict.py (without the path column);
        may write files into `folder` (e.g. masks)."""
        raise NotImplementedError

    @staticmethod
    def to_host(*tensors):
        """Host copies of tensors, for rows and pictures (one sync per call)."""
        return [t.detach().cpu() if torch.is_tensor(t) else t for t in tensors]
