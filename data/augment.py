"""Training augmentation and normalization, done per batch on the training device.

Batches arrive as uint8 images (N, C, H, W) with their targets (`label`, a `mask` (N, H, W), or
`boxes` (N, M, 4) with `box_labels`). Each augmentation moves the targets with the pixels (a
shifted mask, shifted and mirrored boxes). Its random parameters are drawn once per epoch for
every sample position from a generator seeded by (seed, epoch) — see `BatchTransform.draw` — so a
sample gets the same augmentation whatever the batch size, number of workers or processes, and
whether the run was interrupted. All of it is index arithmetic on fixed shapes: no host sync.

Add an augmentation: a class with `draw(count, generator)` and `apply(batch, params)`, one line in
AUGMENTATIONS (it gets the image size and the run's options, for its settings), and its name in
options.AUGMENTATIONS.
"""

import math

import numpy as np
import torch

from utils.errors import KilnError

# --normalize: the per-channel pixel mean and std in [0, 1] that images are normalized with
NORMALIZATIONS = {
    'kiln': ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
    'imagenet': ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # what ImageNet-pretrained backbones saw
}


def _reflect(index, size):
    """Map indices outside [0, size) back inside as mirror images, like padding_mode='reflect'."""
    period = max(2 * (size - 1), 1)
    index = index.remainder(period)
    return torch.where(index >= size, period - index, index)


def _reflect_pad(tensor, padding):
    """`tensor` (N, C, H, W) padded by `padding` pixels on each side by reflection (padding_mode='reflect')."""
    height, width = tensor.shape[-2:]
    if tensor.dtype == torch.bool:  # torch pads no bool tensors by reflection
        return _reflect_pad(tensor.view(torch.uint8), padding).view(torch.bool)
    if padding < min(height, width):
        return torch.nn.functional.pad(tensor, (padding,) * 4, mode='reflect')
    # an image no larger than the padding: reflected again and again (torch's pad refuses it)
    rows = _reflect(torch.arange(-padding, height + padding, device=tensor.device), height)
    columns = _reflect(torch.arange(-padding, width + padding, device=tensor.device), width)
    return tensor.index_select(-2, rows).index_select(-1, columns)


def _shifted(tensor, shift, padding, reflect=True):
    """`tensor` (N, ..., H, W) with sample i moved by `shift[i]` = (dy, dx), each within +-`padding`, the
    uncovered border filled by reflection (else with zeros). Padded once, then each sample's window is
    picked: indices per sample, not per pixel (a gather of every pixel costs 2 to 5 times as much)."""
    height, width = tensor.shape[-2:]
    flat = tensor.reshape(len(tensor), -1, height, width)
    padded = _reflect_pad(flat, padding) if reflect else torch.nn.functional.pad(flat, (padding,) * 4)
    windows = padded.unfold(2, height, 1).unfold(3, width, 1)  # (N, C, 2p + 1, 2p + 1, H, W), a view
    start = shift + padding
    samples = torch.arange(len(tensor), device=shift.device)
    return windows.movedim(1, 3)[samples, start[:, 0], start[:, 1]].reshape(tensor.shape)


def pixel_keys(batch):
    """The keys of the batch's tensors laid out as its images' pixels, which move with them: 'image', and
    every target of the images' height and width ((N, H, W) or (N, C, H, W): a mask, a depth map, ...)."""
    size = batch['image'].shape[-2:]
    return [
        key
        for key, value in batch.items()
        if key == 'image' or (torch.is_tensor(value) and value.dim() >= 3 and value.shape[-2:] == size)
    ]


class RandomCrop:
    """Shift each image by up to `padding` pixels each way, filling the border by reflection
    (torchvision's RandomCrop with reflect padding, batched); with boxes, by black, for a mirrored object
    at the edge would lie outside its box, a copy with no box of its own."""

    def __init__(self, image_size):
        self.padding = max(1, image_size // 16)

    def draw(self, count, generator):
        return {'shift': torch.randint(-self.padding, self.padding + 1, (count, 2), generator=generator)}

    def apply(self, batch, params):
        shift = params['shift']
        height, width = batch['image'].shape[-2:]
        for key in pixel_keys(batch):
            batch[key] = _shifted(batch[key], shift, self.padding, reflect='boxes' not in batch)
        if 'boxes' in batch:  # move with the pixels; a box pushed out of the picture is dropped
            offset = shift.flip(1).repeat(1, 2).to(batch['boxes'].dtype).unsqueeze(1)  # (dx, dy, dx, dy)
            boxes = batch['boxes'] - offset
            boxes = torch.stack(
                [
                    boxes[..., 0].clamp(0, width),
                    boxes[..., 1].clamp(0, height),
                    boxes[..., 2].clamp(0, width),
                    boxes[..., 3].clamp(0, height),
                ],
                dim=-1,
            )
            gone = (boxes[..., 2] - boxes[..., 0] < 1) | (boxes[..., 3] - boxes[..., 1] < 1)
            batch['boxes'] = boxes
            batch['box_labels'] = batch['box_labels'].masked_fill(gone, -1)
        return batch


class Flip:
    """Mirror a random half of the images left-right (`dim=-1`) or upside down (`dim=-2`)."""

    def __init__(self, image_size, dim):
        self.dim = dim

    def draw(self, count, generator):
        return {'flip': torch.rand(count, generator=generator) < 0.5}

    def apply(self, batch, params):
        flip = params['flip']
        for key in pixel_keys(batch):
            shape = (-1,) + (1,) * (batch[key].dim() - 1)
            batch[key] = torch.where(flip.view(shape), batch[key].flip(self.dim), batch[key])
        if 'boxes' in batch:
            boxes, size = batch['boxes'], batch['image'].shape[self.dim]
            low, high = (0, 2) if self.dim == -1 else (1, 3)
            mirrored = boxes.clone()
            mirrored[..., low], mirrored[..., high] = size - boxes[..., high], size - boxes[..., low]
            batch['boxes'] = torch.where(flip.view(-1, 1, 1), mirrored, boxes)
        return batch


class RandomResizedCrop:
    """torchvision's RandomResizedCrop, batched: each image's box covers a random share `scale` of its
    area at a random aspect `ratio` (log-uniform), the first of 10 tries that fits, else the largest
    centred box of an allowed ratio; the box is then resized to the whole picture. In-memory images are
    cropped here on the device (bilinear; masks nearest; boxes moved, those pushed out dropped); datasets
    read from disk crop at decode time, from the full-resolution image (data/image_io.decode_image),
    with the same `draw_boxes`."""

    def __init__(self, image_size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.side, self.scale, self.ratio = image_size, tuple(scale), tuple(ratio)

    def draw_boxes(self, widths, heights, generator=None):
        """Boxes (N, 4) as (x0, y0, x1, y1) pixels in images of `widths` x `heights` (tensors (N,));
        draws the same number of values for every image, so a sample's box depends only on its seed."""
        count, tries = len(widths), 10
        widths, heights = widths.double(), heights.double()
        area = (widths * heights)[:, None] * torch.empty(count, tries, dtype=torch.float64).uniform_(
            *self.scale, generator=generator
        )
        log_ratio = [math.log(r) for r in self.ratio]
        aspect = torch.empty(count, tries, dtype=torch.float64).uniform_(*log_ratio, generator=generator).exp()
        w, h = (area * aspect).sqrt().round(), (area / aspect).sqrt().round()
        fits = (w > 0) & (w <= widths[:, None]) & (h > 0) & (h <= heights[:, None])
        first = fits.double().argmax(1, keepdim=True)
        w, h = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0]
        # no try fitted: the whole image, cut to the nearest allowed aspect ratio
        shape = widths / heights
        fallback_w = torch.where(shape > self.ratio[1], (heights * self.ratio[1]).round(), widths)
        fallback_h = torch.where(shape < self.ratio[0], (widths / self.ratio[0]).round(), heights)
        fitted = fits.any(1)
        w, h = torch.where(fitted, w, fallback_w), torch.where(fitted, h, fallback_h)
        corner = torch.rand(count, 2, dtype=torch.float64, generator=generator)
        x0 = torch.where(fitted, (corner[:, 0] * (widths - w + 1)).floor(), ((widths - w) / 2).floor())
        y0 = torch.where(fitted, (corner[:, 1] * (heights - h + 1)).floor(), ((heights - h) / 2).floor())
        return torch.stack([x0, y0, x0 + w, y0 + h], dim=1).float()

    def draw(self, count, generator):
        # whole pixels of the in-memory images (--img_size squares), given in units of their side
        square = torch.full((count,), float(self.side))
        return {'box': self.draw_boxes(square, square, generator) / self.side}

    def apply(self, batch, params):
        box = params['box']
        x0, y0, x1, y1 = box.unbind(1)
        theta = torch.zeros(len(box), 2, 3, device=box.device)
        theta[:, 0, 0], theta[:, 0, 2] = x1 - x0, x0 + x1 - 1
        theta[:, 1, 1], theta[:, 1, 2] = y1 - y0, y0 + y1 - 1
        image = batch['image']
        grid = torch.nn.functional.affine_grid(theta, list(image.shape), align_corners=False)
        for key in pixel_keys(batch):  # targets sampled, not blended: a class (or a value) of their own
            values = batch[key] if batch[key].dim() == 4 else batch[key][:, None]
            sampled = torch.nn.functional.grid_sample(
                values.float(),
                grid,
                mode='bilinear' if key == 'image' else 'nearest',
                padding_mode='border',
                align_corners=False,
            )
            if values.dtype == torch.bool:
                sampled = sampled > 0.5
            elif not values.is_floating_point():  # uint8 pixels and masks: whole numbers of their type
                kind = torch.iinfo(values.dtype)
                sampled = sampled.round().clamp(kind.min, kind.max)
            batch[key] = sampled.to(values.dtype).view(batch[key].shape)
        if 'boxes' in batch:
            height, width = image.shape[-2:]
            scale = torch.stack([1 / (x1 - x0), 1 / (y1 - y0)], dim=1).repeat(1, 2)[:, None]
            # scaled and clamped per axis with Python numbers: a tensor made from a list would be a host copy
            offset = torch.stack([box[:, 0] * width, box[:, 1] * height], dim=1).repeat(1, 2)[:, None]
            boxes = (batch['boxes'] - offset) * scale
            boxes = torch.stack([boxes[..., i].clamp(0, width if i % 2 == 0 else height) for i in range(4)], -1)
            gone = (boxes[..., 2] - boxes[..., 0] < 1) | (boxes[..., 3] - boxes[..., 1] < 1)
            batch['boxes'] = boxes
            batch['box_labels'] = batch['box_labels'].masked_fill(gone, -1)
        return batch


class ColorJitter:
    """Brightness, contrast and saturation, each scaled by its own random factor in [1 - strength,
    1 + strength] (torchvision's ColorJitter without hue), in that order; on uint8 images, batched."""

    def __init__(self, image_size, strength=0.4):
        self.strength = strength

    def draw(self, count, generator):
        return {'factors': 1 + self.strength * (2 * torch.rand(count, 3, generator=generator) - 1)}

    def apply(self, batch, params):
        factors = params['factors'].view(-1, 3, 1, 1, 1).unbind(1)
        image = _pixels(batch['image'], 'color').float().mul_(factors[0]).clamp_(0, 255)
        mean = _gray(image).mean(dim=(-2, -1), keepdim=True)  # of the clamped image, as torchvision's
        image = ((image - mean) * factors[1] + mean).clamp_(0, 255)
        gray = _gray(image)
        image = (image - gray) * factors[2] + gray
        batch['image'] = image.clamp_(0, 255).round_().to(torch.uint8)
        return batch


def _pixels(image, name):
    """`image` if it holds uint8 pixels; a float image (already preprocessed: its units unknown) is refused."""
    if image.is_floating_point():
        raise KilnError(
            f'--augment {name} changes uint8 pixels, and this dataset gives float images (already '
            f'preprocessed): leave {name} out of --augment, or give uint8 images'
        )
    return image


def _gray(image):
    """The luma (ITU-R 601) of RGB images (N, 3, H, W), as (N, 1, H, W)."""
    return 0.299 * image[:, 0:1] + 0.587 * image[:, 1:2] + 0.114 * image[:, 2:3]


class RandomErasing:
    """timm's RandomErasing: with probability `p`, a rectangle of 2% to 1/3 of the image at an aspect
    ratio of 0.3 to 3.3, filled with one random colour; on uint8 images, batched."""

    def __init__(self, image_size, p=0.25):
        self.p = p

    def draw(self, count, generator):
        def uniform(low, high, *shape):
            return low + (high - low) * torch.rand(count, *shape, generator=generator)

        area, aspect = uniform(0.02, 1 / 3), uniform(math.log(0.3), math.log(1 / 0.3)).exp()
        height, width = (area * aspect).sqrt().clamp(max=1), (area / aspect).sqrt().clamp(max=1)
        top, left = uniform(0, 1) * (1 - height), uniform(0, 1) * (1 - width)
        return {
            'erase': torch.rand(count, generator=generator) < self.p,
            'box': torch.stack([left, top, left + width, top + height], dim=1),  # in units of the side
            'colour': torch.randint(0, 256, (count, 3), generator=generator, dtype=torch.uint8),
        }

    def apply(self, batch, params):
        image = _pixels(batch['image'], 'erase')
        inside = _inside(params['box'], *image.shape[-2:]) & params['erase'].view(-1, 1, 1, 1)
        batch['image'] = torch.where(inside, params['colour'].view(-1, 3, 1, 1), image)
        return batch


def _inside(box, height, width):
    """(N, 1, H, W) bool: the pixels whose centres lie in each image's `box` (N, 4) of side fractions."""
    rows = (torch.arange(height, device=box.device) + 0.5) / height
    columns = (torch.arange(width, device=box.device) + 0.5) / width
    x0, y0, x1, y1 = (value.view(-1, 1, 1, 1) for value in box.unbind(1))
    return (rows.view(1, 1, -1, 1) >= y0) & (rows.view(1, 1, -1, 1) < y1) & (columns >= x0) & (columns < x1)


class Mix:
    """Mixup and CutMix of pairs of samples: the samples at positions 2k and 2k + 1 of an epoch's order
    are mixed with each other (both with the pair's share), so a sample's mix is the same whatever the
    batch size, workers or processes; a sample whose partner is not in its batch is left alone.
    Mixup blends the two images (share lam ~ Beta(alpha, alpha)); CutMix pastes a box of the partner
    covering 1 - lam of the image, in whole pixels of `image_size` squares (lam then the share of pixels
    actually kept). With both, each pair takes one of them at random (`switch_prob` CutMix). The batch gets
    `mix_partner` (the partner's index in the batch) and `mix_lam` (the share of the sample's own target),
    for the task's loss and train metrics."""

    def __init__(self, mixup_alpha=0.0, cutmix_alpha=0.0, prob=1.0, switch_prob=0.5, image_size=None):
        self.mixup_alpha, self.cutmix_alpha, self.prob, self.switch_prob = mixup_alpha, cutmix_alpha, prob, switch_prob
        self.side = image_size  # None: a box of any size (its area then only nearly the pixels pasted)

    def draw(self, count, generator):
        pairs = (count + 1) // 2
        # Beta samples from numpy, seeded by the epoch's generator (torch's Beta takes no generator)
        rng = np.random.default_rng(int(torch.randint(2**62, (1,), generator=generator)))

        def beta(alpha):
            return torch.from_numpy(rng.beta(alpha, alpha, pairs) if alpha > 0 else np.ones(pairs)).float()

        mixup, cutmix = beta(self.mixup_alpha), beta(self.cutmix_alpha)
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            cut = torch.from_numpy(rng.random(pairs) < self.switch_prob)
        else:
            cut = torch.full((pairs,), self.cutmix_alpha > 0)
        side, centre = (1 - cutmix).sqrt(), torch.from_numpy(rng.random((pairs, 2))).float()
        box = torch.cat([(centre - side[:, None] / 2).clamp(0, 1), (centre + side[:, None] / 2).clamp(0, 1)], dim=1)
        if self.side:  # on pixel edges: `apply` pastes the pixels whose centres lie in the box, all of it
            box = (box * self.side).round() / self.side
        kept = 1 - (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1])
        mixed = torch.from_numpy(rng.random(pairs) < self.prob)
        lam = torch.where(mixed, torch.where(cut, kept, mixup), torch.ones(pairs))
        per_position = {'lam': lam, 'cut': cut & mixed, 'box': box}
        return {key: value.repeat_interleave(2, dim=0)[:count] for key, value in per_position.items()}

    def apply(self, batch, params, positions):
        """Mix the (normalized, float) images of `batch`; `positions` are its samples' places in the epoch."""
        image = batch['image']
        index = torch.arange(len(image), device=image.device)
        # the neighbour in the epoch's order: a batch (or a process's share) may start at an odd position
        partner = (index + 1 - 2 * (positions & 1)).clamp(0, len(image) - 1)
        partner = torch.where(positions[partner] == positions ^ 1, partner, index)
        lam = torch.where(partner == index, torch.ones_like(params['lam']), params['lam'])
        other = image[partner]
        pasted = torch.where(_inside(params['box'], *image.shape[-2:]), other, image)
        blended = torch.lerp(other, image, lam.view(-1, 1, 1, 1).to(image.dtype))
        batch['image'] = torch.where(params['cut'].view(-1, 1, 1, 1), pasted, blended)
        batch['mix_partner'], batch['mix_lam'] = partner, lam
        return batch


AUGMENTATIONS = {  # name -> augmentation(image size, the run's options or None)
    'crop': lambda image_size, options: RandomCrop(image_size),
    'resized_crop': lambda image_size, options: RandomResizedCrop(
        image_size, getattr(options, 'crop_scale', (0.08, 1.0)), getattr(options, 'crop_ratio', (3 / 4, 4 / 3))
    ),
    'hflip': lambda image_size, options: Flip(image_size, dim=-1),
    'vflip': lambda image_size, options: Flip(image_size, dim=-2),
    'color': lambda image_size, options: ColorJitter(image_size, getattr(options, 'color_jitter', 0.4)),
    'erase': lambda image_size, options: RandomErasing(image_size, getattr(options, 'erase_prob', 0.25)),
}
MIXES = ('mixup', 'cutmix')  # augmentation names that mix pairs of samples (Mix): classification only


def augmentation_names(option, dataset_default):
    """The augmentations a run uses: --augment ('default', 'none' or 'crop,hflip') over the dataset's own."""
    if option in (None, 'default'):
        return tuple(dataset_default)
    return () if option == 'none' else tuple(option.split(','))


class BatchTransform:
    """Turns a batch of uint8 images into normalized float images on the device, augmenting them
    first when it has augmentations (training); float images are taken as already preprocessed."""

    def __init__(self, names, image_size, channels_last=False, options=None):
        self.names = tuple(names)
        self.augmentations = [AUGMENTATIONS[name](image_size, options) for name in self.names if name not in MIXES]
        self.mix = None  # mixup / cutmix, after normalization
        if set(self.names) & set(MIXES):
            self.mix = Mix(
                getattr(options, 'mixup_alpha', 0.8) if 'mixup' in self.names else 0.0,
                getattr(options, 'cutmix_alpha', 1.0) if 'cutmix' in self.names else 0.0,
                getattr(options, 'mix_prob', 1.0),
                getattr(options, 'mix_switch_prob', 0.5),
                image_size,
            )
        self.random = [*self.augmentations, *([self.mix] if self.mix else [])]  # what draws parameters
        self.channels_last = channels_last
        self.normalization = NORMALIZATIONS[normalization(options)]
        self.scales = {}  # device -> (255 x mean, 255 x std), made once: a copy per batch would wait for the GPU

    def draw(self, count, generator):
        """Random parameters for `count` sample positions, as {(augmentation index, name): tensor (count, ...)}."""
        return {
            (i, key): value
            for i, augmentation in enumerate(self.random)
            for key, value in augmentation.draw(count, generator).items()
        }

    def __call__(self, batch, params=None, positions=None):
        """Augment (with `params`, this batch's rows of `draw`, and `positions`, its samples' places in
        the epoch) and normalize `batch` in place; return it."""

        def own(i):
            return {key: value for (index, key), value in params.items() if index == i}

        if params is not None:
            for i, augmentation in enumerate(self.augmentations):
                augmentation.apply(batch, own(i))
        image = batch['image']
        if image.dtype == torch.uint8:
            if image.device not in self.scales:
                self.scales[image.device] = tuple(
                    torch.tensor(values, device=image.device).view(1, -1, 1, 1) * 255 for values in self.normalization
                )
            mean, std = self.scales[image.device]
            image = image.float().sub_(mean).div_(std)  # in place: one new tensor, not three (same values)
        batch['image'] = image
        if self.mix is not None and params is not None:
            self.mix.apply(batch, own(len(self.augmentations)), positions)
        if self.channels_last and batch['image'].dim() == 4:
            batch['image'] = batch['image'].contiguous(memory_format=torch.channels_last)
        if 'mask' in batch:  # class indices (uint8 on disk and in memory); a float target goes by another name
            batch['mask'] = batch['mask'].long()
        return batch


def normalization(options):
    """The --normalize of `options` (resolved: options.resolve), 'kiln' where options have none."""
    return getattr(options, 'normalize', None) or 'kiln'


def denormalize(images, normalize='kiln'):
    """Map images (N, 3, H, W) normalized as --normalize `normalize` says back to [0, 1] for display: a
    float32 tensor on the CPU, computed in numpy (one thread: see utils/viz.py's `tiles`)."""
    mean, std = (np.asarray(values, np.float32).reshape(1, -1, 1, 1) for values in NORMALIZATIONS[normalize])
    pixels = images.detach().cpu().float().numpy() * std + mean
    return torch.from_numpy(np.clip(pixels, 0, 1, out=pixels))
