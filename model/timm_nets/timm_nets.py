"""Backbones from timm by name (`--model_type timm:convnext_tiny`), the optional extra
(`python3 -m pip install -e '.[timm]'`), with a head for --num_classes; weights come only from a
local file (--pretrained_path), loaded safely and checked tensor by tensor; nothing is downloaded."""

import difflib

from model.model_entry import TIMM_PREFIX
from utils.checkpoint import load_pretrained
from utils.errors import KilnError

INSTALL = "python3 -m pip install -e '.[timm]'"


def _timm():
    try:
        import timm
    except ImportError:
        raise KilnError(f'--model_type {TIMM_PREFIX}NAME needs timm, an optional extra: {INSTALL}') from None
    return timm


def timm_net(name, args):
    """timm's model `name`, built as its pretrained weights expect (their classes), loaded from
    --pretrained_path when given (all of its tensors must fit), then given a --num_classes head."""
    timm = _timm()
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f'did you mean {", ".join(close)}? ' if close else ''
        raise KilnError(f'timm has no model {name!r}; {hint}(python -c "import timm; print(timm.list_models())")')
    try:  # the image size for the models that depend on it (ViTs); the others take no such argument
        model = timm.create_model(name, pretrained=False, img_size=args.img_size)
    except TypeError:
        model = timm.create_model(name, pretrained=False)
    if getattr(args, 'pretrained_path', None):
        load_pretrained(
            model,
            args.pretrained_path,
            TIMM_PREFIX + name,
            f'run python -c "import timm; timm.create_model(\'{name}\', pretrained=True)": it saves a '
            f'model.safetensors under ~/.cache/huggingface/hub/',
        )
    if model.num_classes != args.num_classes:
        model.reset_classifier(args.num_classes)
    return model
