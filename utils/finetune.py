"""Fine-tuning in stages: freezing layer groups, their learning rates, and unfreezing them later."""

from torch import nn

from utils.checkpoint import unwrap_model
from utils.errors import KilnError

BATCH_NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


class ModelFreezer:
    """Freezes a model by layer groups: its direct children, in order, with its classifier last.

    Indices are inclusive and may be negative, as in Python: `freeze(0, -2)` freezes every group
    but the last (the head). The model's own parameters (a ViT's `cls_token` and `pos_embed`) go
    with group 0, the input layers they belong with. Where the model names its classifier (timm's
    `get_classifier()`) and that is one or more direct children (a distilled ViT's `head` and
    `head_dist`), they are the last group together. Normalization layers (BatchNorm, GroupNorm,
    LayerNorm) stay trainable unless `freeze_batch_norms=True`.
    """

    def __init__(self, model, freeze_batch_norms=False):
        self.model = unwrap_model(model)
        self.freeze_batch_norms = freeze_batch_norms
        self.eval_modules = []  # modules freeze() put in eval mode; keep_eval_modes() puts them back

    def get_layer_groups(self):
        """The layer groups, in order: modules (the heads of a model with several, in an nn.ModuleList)."""
        children = list(self.model.children())
        heads = classifier_children(self.model, children)
        if not heads:
            return children
        rest = [child for child in children if all(child is not head for head in heads)]
        return [*rest, heads[0] if len(heads) == 1 else nn.ModuleList(heads)]

    def get_trainable_parameters(self):
        """The parameters that currently require gradients."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _groups_between(self, from_index, to_index):
        """Each layer group `from_index`..`to_index` as [(module, its own parameters)] (see `_members`)."""
        groups = self.get_layer_groups()
        first, last = (
            index % len(groups) if -len(groups) <= index < len(groups) else None for index in (from_index, to_index)
        )
        if first is None or last is None:
            raise IndexError(
                f'layer group index out of range: the model has {len(groups)} groups '
                f'(0..{len(groups) - 1}, or -{len(groups)}..-1)'
            )
        step = 1 if first <= last else -1
        return [self._members(groups[i], i) for i in range(first, last + step, step)]

    def _members(self, group, index):
        """(module, its own parameters) for each module of `group`, the layer group `index`; group 0 also
        has (None, the model's own parameters): the model's mode is never set here."""
        members = [(module, list(module.parameters(recurse=False))) for module in group.modules()]
        if index == 0:
            members.append((None, list(self.model.parameters(recurse=False))))
        return members

    def _skipped(self, module):
        return isinstance(module, BATCH_NORMS) and not self.freeze_batch_norms

    def freeze(self, from_index=0, to_index=-2, set_modules_as_eval=False):
        """Stop training the layer groups `from_index`..`to_index`; with `set_modules_as_eval`,
        also put their modules in eval mode (BatchNorm statistics stop moving)."""
        for members in self._groups_between(from_index, to_index):
            for module, parameters in members:
                if self._skipped(module):
                    continue
                for param in parameters:
                    param.requires_grad = False
                if set_modules_as_eval and module is not None:
                    module.training = False  # this module only: .eval() would reach a kept BatchNorm inside
                    self.eval_modules.append(module)

    def unfreeze(self, from_index=-1, to_index=0, set_modules_as_training=True):
        """Train the layer groups `from_index`..`to_index` again; return the newly trainable
        parameters as optimizer param groups, one `{'params': [...]}` per layer group."""
        param_groups = []
        for members in self._groups_between(from_index, to_index):
            unfrozen = []
            for module, parameters in members:
                for param in parameters:
                    if not param.requires_grad:
                        param.requires_grad = True
                        unfrozen.append(param)
                if set_modules_as_training and module is not None:
                    module.training = True
                    if module in self.eval_modules:
                        self.eval_modules.remove(module)
            if unfrozen:
                param_groups.append({'params': unfrozen})
        return param_groups

    def keep_eval_modes(self):
        """Put the modules freeze() set to eval back in eval mode (after a `model.train()`)."""
        for module in self.eval_modules:
            module.training = False


def classifier_children(model, children):
    """The direct children that are the model's classifier by its own account (timm's
    `get_classifier()`: one module, or a tuple for models with several heads); [] where it gives none
    or they are not direct children (then the last child holds the head)."""
    classifier = getattr(model, 'get_classifier', None)
    heads = classifier() if callable(classifier) else None
    heads = list(heads) if isinstance(heads, (tuple, list)) else [heads]
    if any(not isinstance(head, nn.Module) or all(head is not child for child in children) for head in heads):
        return []
    return heads


class FineTuning:
    """--freeze_to, --unfreeze_at_epoch and the per-group learning rates of one training run.

    The optimizer holds every parameter from the start, frozen ones included (they have no
    gradient, so optimizers skip them), each layer set in its own param group at its own learning
    rate. Unfreezing then only switches `requires_grad` back on: the optimizer, its schedule and a
    checkpoint's optimizer state keep the same shape, with no private scheduler fields to edit.
    """

    def __init__(self, model, freeze_to=None, freeze_batch_norms=False, unfreeze_at_epoch=None, unfrozen_lr_scale=None):
        self.freezer = ModelFreezer(model, freeze_batch_norms)
        # without --freeze_to nothing is frozen, and the options about unfreezing do nothing (train.py says so)
        self.unfreeze_at_epoch = unfreeze_at_epoch if freeze_to is not None else None
        self.unfrozen_lr_scale = 1.0 if unfrozen_lr_scale is None else unfrozen_lr_scale
        self.frozen = set()
        if freeze_to is not None:
            before = {id(p) for p in self.freezer.get_trainable_parameters()}
            try:
                self.freezer.freeze(0, freeze_to, set_modules_as_eval=freeze_batch_norms)
            except IndexError as error:
                raise KilnError(f'--freeze_to {freeze_to}: {error}') from None
            self.frozen = before - {id(p) for p in self.freezer.get_trainable_parameters()}
            if before and not self.freezer.get_trainable_parameters():  # the first step's backward would fail
                groups = self.freezer.get_layer_groups()
                trainable = [any(id(p) in before for p in group.parameters()) for group in groups]
                fewer = [index - len(groups) for index in range(len(groups) - 1) if any(trainable[index + 1 :])]
                advice = (
                    f'freeze fewer, e.g. --freeze_to {fewer[-1]} trains the groups after it'
                    if fewer
                    else 'leave --freeze_to out: no group after the first has anything to train'
                )
                raise KilnError(
                    f'--freeze_to {freeze_to}{" --freeze_batch_norms" if freeze_batch_norms else ""} leaves nothing '
                    f'to train (all {len(groups)} layer groups frozen); {advice}'
                )

    def param_groups(self, lr, head_lr=None, backbone_lr=None):
        """Optimizer param groups: the last layer group (the head) at `head_lr`, the other trainable
        parameters at `backbone_lr`, the frozen ones at --unfrozen_lr_scale x `backbone_lr` (used once
        they are unfrozen); both rates default to `lr`. Empty groups are left out; the head's is last
        (the rate the run shows: see `shown_lr`)."""
        head = {id(p) for p in self.freezer.get_layer_groups()[-1].parameters()}
        backbone_lr, head_lr = backbone_lr or lr, head_lr or lr
        parameters = list(self.freezer.model.parameters())
        frozen_lr = backbone_lr * self.unfrozen_lr_scale
        groups = [
            ([p for p in parameters if id(p) not in head and id(p) not in self.frozen], backbone_lr),
            ([p for p in parameters if id(p) not in head and id(p) in self.frozen], frozen_lr),
            ([p for p in parameters if id(p) in head], head_lr),
        ]
        return [{'params': params, 'lr': group_lr} for params, group_lr in groups if params]

    @staticmethod
    def shown_lr(optimizer):
        """The learning rate the run prints and logs as `lr`: the last param group's, the head's (always
        trained; the other groups follow the same schedule at their own rates)."""
        return optimizer.param_groups[-1]['lr']

    def unfreezes_at(self, epoch, batch_in_epoch):
        """Whether (epoch, batch_in_epoch) is where --unfreeze_at_epoch takes effect: the start of epoch
        `unfreeze_at_epoch` (counting from 1)."""
        return self.unfreeze_at_epoch == epoch + 1 and batch_in_epoch == 0

    def is_unfrozen(self, epoch, batch_in_epoch):
        """Whether --unfreeze_at_epoch has taken effect at this position (e.g. of a resumed checkpoint)."""
        when = self.unfreeze_at_epoch
        return when is not None and (epoch + 1 > when or (epoch + 1 == when and batch_in_epoch > 0))

    def unfreeze(self):
        """Train every layer group from now on."""
        self.freezer.unfreeze(-1, 0)

    def train_mode(self, model):
        """Training mode, except for modules frozen in eval mode (--freeze_batch_norms)."""
        model.train()
        self.freezer.keep_eval_modes()
