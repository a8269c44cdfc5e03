"""Setting up a model, the same way for train.py, eval.py and predict.py."""

import dataclasses

import torch

from model.model_entry import select_model
from utils.checkpoint import load_weights
from utils.device import autocast_for
from utils.distributed import wrap_model
from utils.errors import KilnError


@dataclasses.dataclass
class ModelSetup:
    """A model ready to run: `model` is the plain module (its state_dict has clean names), `compiled`
    the one torch.compile made (or the same), `wrapped` what the loop calls (DDP / DataParallel or
    the same), `autocast()` the --amp context and `load_report` what loading weights did (or None)."""

    model: torch.nn.Module
    compiled: torch.nn.Module
    wrapped: torch.nn.Module
    autocast: object
    load_report: object = None

    def wrap(self, options):
        """Wrap the compiled model for several devices (again after unfreezing: DDP syncs only the
        parameters that were trainable when it wrapped)."""
        self.wrapped = wrap_model(self.compiled, options)


class CopiedOutputs(torch.nn.Module):
    """A CUDA-graphed model whose outputs are copied: each replay of a graph writes into the same memory,
    and the metrics read a batch's outputs batches later (a copy of a batch's logits costs little)."""

    def __init__(self, module):
        super().__init__()
        self.module = module  # the name DataParallel uses: unwrap_model and load_match_dict see through it

    def forward(self, *args, **kwargs):
        return torch.utils._pytree.tree_map(
            lambda t: t.clone() if torch.is_tensor(t) else t, self.module(*args, **kwargs)
        )


def setup_model(
    options, device, weights=None, *, strict=True, prefix_map=None, source=None, wrap=True, inference=False
):
    """Build --model_type, load `weights` (a path or a loaded checkpoint; all of them when `strict`;
    `inference`: to run as they are, see load_weights), place it on `device` (channels-last with
    --channels_last), compile it with --compile/--compile_mode, and (with `wrap`; else call `.wrap`
    later) wrap it for several devices."""
    graphed = options.compile and options.compile_mode != 'default' and device.type == 'cuda'  # CUDA graphs, both
    if graphed and getattr(options, 'grad_accum_steps', 1) > 1:  # pytorch/pytorch#169545: an error or wrong gradients
        raise KilnError(
            f'--compile_mode {options.compile_mode} captures CUDA graphs, which cannot add up gradients over '
            f'--grad_accum_steps {options.grad_accum_steps}; use --compile_mode default or --grad_accum_steps 1'
        )
    model = select_model(options)
    report = None
    if weights is not None:
        report = load_weights(
            model,
            weights,
            strict=strict,
            source=source,
            prefix_map=prefix_map,
            model_type=options.model_type,
            inference=inference,
            built_with=options,
        )
    model = model.to(device, memory_format=torch.channels_last if options.channels_last else torch.preserve_format)
    compiled = torch.compile(model, mode=options.compile_mode) if options.compile else model
    if graphed:
        compiled = CopiedOutputs(compiled)
    setup = ModelSetup(model, compiled, compiled, autocast_for(device, options.amp), report)
    if wrap:
        setup.wrap(options)
    return setup
