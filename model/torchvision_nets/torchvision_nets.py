"""torchvision's ImageNet classifiers with a head for --num_classes, optionally starting from
weights in a local file (--pretrained_path); nothing is ever downloaded."""

import functools

import torchvision
from torch import nn

from utils.checkpoint import load_pretrained

# name -> (torchvision builder, dotted path of the final nn.Linear)
TORCHVISION_NETS = {
    'tv_resnet18': (torchvision.models.resnet18, 'fc'),
    'tv_resnet34': (torchvision.models.resnet34, 'fc'),
    'tv_resnet50': (torchvision.models.resnet50, 'fc'),
    'tv_mobilenet_v3_small': (torchvision.models.mobilenet_v3_small, 'classifier.3'),
    'tv_mobilenet_v3_large': (torchvision.models.mobilenet_v3_large, 'classifier.3'),
    'tv_efficientnet_b0': (torchvision.models.efficientnet_b0, 'classifier.1'),
}


def torchvision_net(name, args):
    """torchvision net `name` (a TORCHVISION_NETS key) with --pretrained_path weights and a --num_classes head."""
    builder, head_path = TORCHVISION_NETS[name]
    model = builder(weights=None)  # ImageNet shape (1000 classes), so a torchvision weights file fits it whole
    if getattr(args, 'pretrained_path', None):
        load_pretrained(
            model,
            args.pretrained_path,
            name,
            f'run python -c "import torchvision; torchvision.models.{builder.__name__}(weights=\'DEFAULT\')": it '
            f'saves a .pth file under ~/.cache/torch/hub/checkpoints/',
        )
    parent_path, _, attribute = head_path.rpartition('.')
    parent = model.get_submodule(parent_path) if parent_path else model
    head = parent[int(attribute)] if attribute.isdigit() else getattr(parent, attribute)
    if head.out_features != args.num_classes:
        new_head = nn.Linear(head.in_features, args.num_classes)
        if attribute.isdigit():
            parent[int(attribute)] = new_head
        else:
            setattr(parent, attribute, new_head)
    return model


# the MODELS entries (model/model_entry.py): one builder of args per net
tv_resnet18, tv_resnet34, tv_resnet50, tv_mobilenet_v3_small, tv_mobilenet_v3_large, tv_efficientnet_b0 = (
    functools.partial(torchvision_net, name) for name in TORCHVISION_NETS
)
