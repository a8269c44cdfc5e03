"""Model names (--model_type) and where their classes live.

To add a model: create a package model/my_net/ whose my_net.py holds an nn.Module taking `args` (it
reads args.num_classes, args.img_size, ...), and add one line here: 'my_net': 'model.my_net.my_net:MyNet',
('model.my_net:MyNet' where the package's __init__.py imports the class, as Kiln's own packages do).
A model that takes only image sides of a multiple of N (its strides) says `size_multiple = N`; one
made for one task (its outputs: masks, boxes) says `made_for_task = 'segment'`.
Backbones from timm need no line: --model_type timm:<name> (model/timm_nets, the 'timm' extra).
(This file imports nothing heavy: `--help` and name checks read it before torch loads.)
"""

from utils.registry import load_entry

MODELS = {
    'small_cnn': 'model.small_cnn:SmallCNN',
    'resnet18': 'model.resnet:ResNet18',
    'linear': 'model.linear:LinearClassifier',
    'seg_net': 'model.seg_net:SegNet',  # segmentation (--task segment)
    'center_net': 'model.center_net:CenterNet',  # detection (--task detect)
    # torchvision's ImageNet nets with a new head; --pretrained_path loads local weights
    'tv_resnet18': 'model.torchvision_nets:tv_resnet18',
    'tv_resnet34': 'model.torchvision_nets:tv_resnet34',
    'tv_resnet50': 'model.torchvision_nets:tv_resnet50',
    'tv_mobilenet_v3_small': 'model.torchvision_nets:tv_mobilenet_v3_small',
    'tv_mobilenet_v3_large': 'model.torchvision_nets:tv_mobilenet_v3_large',
    'tv_efficientnet_b0': 'model.torchvision_nets:tv_efficientnet_b0',
}


TIMM_PREFIX = 'timm:'  # --model_type timm:<name>: a timm backbone (model/timm_nets)


def select_model(args):
    """Build the model named by --model_type (a KilnError for an --img_size it cannot take)."""
    if args.model_type.startswith(TIMM_PREFIX):
        from model.timm_nets import timm_net

        return timm_net(args.model_type[len(TIMM_PREFIX) :], args)
    model = load_entry(MODELS, args.model_type, '--model_type', 'model/model_entry.py')(args)
    from utils.errors import KilnError

    given = getattr(args, 'pretrained_path', None)
    if given and getattr(model, 'pretrained_path', None) != given:  # utils.checkpoint.load_pretrained marks it
        raise KilnError(
            f'--model_type {args.model_type} does not read --pretrained_path (ImageNet weights are for the tv_* '
            f'nets and timm:<name>: e.g. --model_type tv_resnet18); to start from a checkpoint of this model '
            f'give --load_model_path'
        )
    made_for, task = getattr(model, 'made_for_task', None), getattr(args, 'task', None)
    if made_for and task and task != made_for:
        from tasks.task_entry import task_class

        if not issubclass(task_class(task), task_class(made_for)):  # a project's own task built on it takes it
            raise KilnError(
                f'--model_type {args.model_type} is made for --task {made_for}; give --task {made_for}, or a model for '
                f'--task {task} (its own: --model_type {task_class(task).default_model})'
            )
    multiple = getattr(model, 'size_multiple', 1)
    if args.img_size % multiple:
        below = args.img_size // multiple * multiple
        sizes = f'{below} or {below + multiple}' if below else f'{multiple}'
        raise KilnError(
            f'--model_type {args.model_type} takes images whose side is a multiple of {multiple}; '
            f'--img_size {args.img_size} is not: give {sizes}'
        )
    return model
