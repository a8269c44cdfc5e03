"""Object detection: boxes and classes of every object in an image; COCO-style mAP@0.5 and mAP@0.5:0.95.

The task's whole contract is here: batches carry padded boxes ('boxes' (N, M, 4) xyxy pixels,
'box_labels' (N, M), -1 for padding: the default collate pads them), the model gives CenterNet-style
maps (model/center_net: a per-class centre heatmap, box sizes and centre offsets at 1/4 of the
input's resolution), and this file turns them into a loss, into boxes, into mAP, pictures and rows.
Every tensor has a fixed shape and nothing waits for the GPU until the metrics are computed.
"""

import numpy as np
import torch
import torch.nn.functional as F

from data.sampler import in_global_order
from tasks.task import Task
from utils.distributed import all_gather_objects
from utils.viz import caption, font_for

STRIDE = 4  # input pixels per heatmap cell
MIN_SCORE = 0.3  # detections shown in pictures and written as rows
MAX_DETECTIONS = 100  # detections kept per image (CenterNet's K; COCO's evaluation counts at most 100 too)
IOU_THRESHOLDS = np.linspace(0.5, 0.95, int(np.round((0.95 - 0.5) / 0.05)) + 1, endpoint=True)  # COCO's, to the bit
RECALL_THRESHOLDS = np.linspace(0.0, 1.00, int(np.round((1.00 - 0.0) / 0.01)) + 1, endpoint=True)
PALETTE = (
    (255, 64, 64),
    (64, 200, 255),
    (255, 200, 0),
    (80, 230, 80),
    (230, 80, 230),
    (255, 140, 40),
    (150, 120, 255),
    (0, 180, 160),
)


class DetectTask(Task):
    """Finds the shapes in an image: the model gives {'heatmap', 'size', 'offset'} maps; targets are
    padded `boxes` and `box_labels`."""

    default_model = 'center_net'
    default_data = ('shapes_det', 'det_list')
    default_loss = None  # its own: detection_loss (--loss does not apply)
    default_image_size = 64
    monitor = 'val/map'  # mAP@0.5 reaches 1.0 early and stays there: best.pth would be its first epoch at 1.0
    targets = ('boxes', 'box_labels')
    min_classes = 1  # the boxes of one kind of object: found or not

    @classmethod
    def metric_names(cls, options):
        return ['loss', 'map50', 'map']

    @classmethod
    def train_metric_names(cls, options):
        return ['loss']  # (train_metrics: none)

    def check_outputs(self, outputs):
        if isinstance(outputs, torch.Tensor):  # a classifier's, or a segmenter's (a task of yours may read others)
            shown = f'outputs of shape {tuple(outputs.shape)}'
            raise self.wrong_outputs(shown, "CenterNet's heads (a dict of 'heatmap', 'size' and 'offset' maps)")
        return outputs

    def loss(self, outputs, batch):
        return detection_loss(outputs, batch['boxes'], batch['box_labels'])

    def outputs_to_float(self, outputs):
        return {key: value.float() for key, value in outputs.items()}

    def metrics(self):
        return DetectionMetrics(self.num_classes)

    def train_metrics(self):
        return None  # mAP needs every box of a split on the host: validation measures it, training logs the loss

    def pictures(self, batch, outputs):
        count = min(self.pictured, self.count(batch))
        boxes, scores, labels = decode_detections(outputs)
        images = (self.display_images(batch, count) * 255).round().byte()
        return {
            'detections': draw_detections(
                images, boxes, labels, scores, self.class_names, batch['boxes'], batch['box_labels'], count=count
            )
        }

    eval_header = ('image', 'class', 'class_name', 'score', 'x1', 'y1', 'x2', 'y2')

    def eval_rows(self, batch, outputs):
        """One row per detection scoring at least MIN_SCORE, one of empty fields for an image without (the
        true boxes are in the list file)."""
        return self.predict_rows(batch, outputs, None, None)

    predict_header = eval_header

    def predict_rows(self, batch, outputs, paths, folder):
        """A row per detection scoring at least MIN_SCORE (one of empty fields for an image without), its
        box in the image's own pixels when the batch says which part of each image became the input
        ('region' x0, y0, x1, y1: see data/det_list_dataset.py), else in the input's pixels."""
        boxes, scores, labels = self.to_host(*decode_detections(outputs))
        if 'region' in batch:  # the region of the (upright) image that was resized to the square input
            (region,) = self.to_host(batch['region'].float())
            scale = (region[:, 2:] - region[:, :2]) / batch['image'].shape[-1]
            boxes = boxes * scale.repeat(1, 2)[:, None] + region[:, None, :2].repeat(1, 1, 2)
        rows = [
            [
                [label, self.class_names[label], f'{score:.4f}', *(f'{v:.1f}' for v in box)]
                for box, score, label in zip(image_boxes.tolist(), image_scores.tolist(), image_labels.tolist())
                if score >= MIN_SCORE
            ]
            for image_boxes, image_scores, image_labels in zip(boxes, scores, labels)
        ]
        # an image without a detection still has its row (empty fields): every image read is in the file
        return [image_rows or [[''] * (len(self.eval_header) - 1)] for image_rows in rows]


class DetectionMetrics:
    """mAP over a whole split: the decoded detections and true boxes of every batch are kept on the
    device, then gathered from every process in split order and scored once (mean_average_precision)."""

    def __init__(self, num_classes):
        self.num_classes, self.kept = num_classes, []

    def update(self, outputs, batch):
        self.kept.append((*decode_detections(outputs), batch['boxes'], batch['box_labels']))

    def compute(self, class_names=None):
        batches = [
            [(boxes[i], scores[i], labels[i], true_boxes[i], true_labels[i]) for i in range(len(boxes))]
            for boxes, scores, labels, true_boxes, true_labels in ([t.cpu() for t in kept] for kept in self.kept)
        ]
        # every process has every world_size-th batch (data/sampler.py): the images in the split's order,
        # for the order decides between detections of equal score
        images = [image for batch in in_global_order(all_gather_objects(batches)) for image in batch]
        return mean_average_precision(
            [image[:3] for image in images], [image[3:] for image in images], self.num_classes, class_names
        )


def _centre_targets(outputs, boxes, box_labels, stride):
    """Heatmap targets (B, C, H*W), the cell index of each box centre (B, M), and the size and offset
    targets at those cells (B, M, 2) in cells; all fixed shapes, built without leaving the device."""
    batch, classes, height, width = outputs['heatmap'].shape
    valid = (box_labels >= 0).to(boxes.dtype)
    cells = boxes / stride
    centre = (cells[..., :2] + cells[..., 2:]) / 2
    size = cells[..., 2:] - cells[..., :2]
    # clamped per axis with Python numbers: a limits tensor made from a list would be a host copy
    cell = torch.stack([centre[..., 0].floor().clamp(0, width - 1), centre[..., 1].floor().clamp(0, height - 1)], -1)
    index = (cell[..., 1] * width + cell[..., 0]).long()
    # a Gaussian bump per box, elliptical like the box (TTFNet's sigma = 0.54 * side / 6), peaking
    # at exactly 1 on the centre cell: those cells are the focal loss's positives
    sigma = (size * (0.54 / 6)).clamp(min=0.25)
    gx = torch.exp(-((torch.arange(width, device=boxes.device) - cell[..., :1]) ** 2) / (2 * sigma[..., :1] ** 2))
    gy = torch.exp(-((torch.arange(height, device=boxes.device) - cell[..., 1:]) ** 2) / (2 * sigma[..., 1:] ** 2))
    bumps = (gy.unsqueeze(-1) * gx.unsqueeze(-2)).flatten(2) * valid.unsqueeze(-1)  # (B, M, H*W)
    target = boxes.new_zeros(batch, classes, height * width)
    channel = box_labels.clamp(min=0).unsqueeze(-1).expand_as(bumps)
    target = target.scatter_reduce(1, channel, bumps, reduce='amax')  # padded boxes add zeros: no effect
    return target, index, size, centre - cell, valid


def _at(prediction, index):
    """A (B, 2, H, W) map's values at cell indices (B, M), as (B, M, 2)."""
    flat = prediction.flatten(2)
    return flat.gather(2, index.unsqueeze(1).expand(-1, flat.shape[1], -1)).transpose(1, 2)


def detection_loss(outputs, boxes, box_labels, size_weight=0.1, offset_weight=1.0, stride=STRIDE, parts=False):
    """CenterNet's loss: focal loss on the Gaussian-splatted centre heatmap plus L1 on the size and
    offset at the true centres, each normalized by the number of boxes of its image, then averaged
    over the images (so a split's mean loss is the same whatever the batch size, as in eval.py).

    `boxes` (B, M, 4) xyxy pixels and `box_labels` (B, M), padded with the label -1. Runs fully
    batched without a host sync. With `parts`, returns (total, {'heatmap', 'size', 'offset'}).
    """
    logits = outputs['heatmap'].float().flatten(2)
    boxes = boxes.float()
    target, index, size, offset, valid = _centre_targets(outputs, boxes, box_labels, stride)
    positive = target.eq(1).float()
    count = positive.sum(dim=(1, 2)).clamp(min=1)  # per image
    p = logits.sigmoid()
    # focal loss with CenterNet's exponents (2 on the prediction, 4 on the distance to a centre)
    heat = (
        -(
            positive * (1 - p) ** 2 * F.logsigmoid(logits)
            + (1 - positive) * (1 - target) ** 4 * p**2 * F.logsigmoid(-logits)
        ).sum(dim=(1, 2))
        / count
    ).mean()
    boxes_count = valid.sum(dim=1).clamp(min=1)
    weights = valid.unsqueeze(-1)
    size_loss = (((_at(outputs['size'].float(), index) - size).abs() * weights).sum(dim=(1, 2)) / boxes_count).mean()
    offset_loss = (
        ((_at(outputs['offset'].float(), index) - offset).abs() * weights).sum(dim=(1, 2)) / boxes_count
    ).mean()
    total = heat + size_weight * size_loss + offset_weight * offset_loss
    if parts:
        return total, {'heatmap': heat.detach(), 'size': size_loss.detach(), 'offset': offset_loss.detach()}
    return total


@torch.no_grad()
def decode_detections(outputs, k=MAX_DETECTIONS, stride=STRIDE):
    """The k best detections per image: (boxes (B, k, 4) xyxy pixels, scores (B, k), labels (B, k)).

    A heatmap cell counts only where it is the maximum of its 3x3 neighbourhood (CenterNet's
    max-pool NMS). Fixed shapes, no host sync; k is capped at the number of heatmap values.
    """
    heat = outputs['heatmap'].float().sigmoid()
    batch, classes, height, width = heat.shape
    heat = heat * (F.max_pool2d(heat, 3, stride=1, padding=1) == heat)
    scores, index = heat.flatten(1).topk(min(k, classes * height * width), dim=1)
    labels, cell = index // (height * width), index % (height * width)
    size = _at(outputs['size'].float(), cell).clamp(min=0)
    centre = torch.stack([cell % width, cell // width], dim=-1) + _at(outputs['offset'].float(), cell)
    low, high = (centre - size / 2) * stride, (centre + size / 2) * stride
    # clamped per axis with Python numbers: a limits tensor made from a list would be a host copy; a centre
    # off the picture (an offset gone wild) gives an empty box at its edge, never one with x2 < x1
    low, high = (
        torch.stack([corner[..., 0].clamp(0, width * stride), corner[..., 1].clamp(0, height * stride)], -1)
        for corner in (low, high)
    )
    return torch.cat([low, torch.maximum(high, low)], dim=-1), scores, labels


def _box_iou(a, b):
    """IoU matrix (len(a), len(b)) of xyxy float64 arrays; 0 where the union is empty."""
    low = np.maximum(a[:, None, :2], b[None, :, :2])
    high = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (high - low).clip(min=0).prod(-1)
    union = (a[:, 2:] - a[:, :2]).prod(-1)[:, None] + (b[:, 2:] - b[:, :2]).prod(-1)[None] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0)


def _match(ious, thresholds):
    """COCO's greedy matching for one image and class: detections (rows of `ious`, by falling score)
    take the unmatched true box of highest IoU >= each threshold. Returns true positives (T, D)."""
    matched = np.zeros((len(thresholds), ious.shape[1]), dtype=bool)
    hits = np.zeros((len(thresholds), ious.shape[0]), dtype=bool)
    if ious.shape[1] == 0:  # no true box: every detection is a false positive
        return hits
    for d, row in enumerate(ious):
        candidates = np.where(~matched & (row >= thresholds[:, None]), row, -1.0)
        last_best = candidates.shape[1] - 1 - candidates[:, ::-1].argmax(axis=1)  # COCO keeps the last of ties
        found = candidates.max(axis=1) >= 0
        hits[found, d] = True
        matched[found.nonzero()[0], last_best[found]] = True
    return hits


def mean_average_precision(predictions, targets, num_classes, class_names=None, max_detections=MAX_DETECTIONS):
    """COCO-style box mAP: {'map50': AP at IoU 0.5, 'map': AP averaged over IoU 0.50:0.05:0.95}; with
    `class_names`, each class's AP at IoU 0.5 too ('ap50/<name>', NaN for a class without true boxes).

    `predictions` is a list per image of (boxes, scores, labels) tensors, `targets` a list per
    image of (boxes, labels); boxes xyxy. As pycocotools computes it (area range 'all', at most
    `max_detections` per image and class): 101-point interpolated AP per class, averaged over the
    classes that have true boxes (-1 when none has, as COCO reports).
    """
    as_array = lambda tensor, dtype: torch.as_tensor(tensor).detach().cpu().numpy().astype(dtype)  # noqa: E731
    images = [
        (
            as_array(pb, np.float64).reshape(-1, 4),
            as_array(ps, np.float64).reshape(-1),
            as_array(pl, np.int64).reshape(-1),
            as_array(tb, np.float64).reshape(-1, 4),
            as_array(tl, np.int64).reshape(-1),
        )
        for (pb, ps, pl), (tb, tl) in zip(predictions, targets)
    ]
    precision = {}  # per class with true boxes: (T, R)
    for c in range(num_classes):
        scores, hits, true_count = [], [], 0
        for pred_boxes, pred_scores, pred_labels, true_boxes, true_labels in images:
            gt = true_boxes[true_labels == c]
            true_count += len(gt)
            mine = np.flatnonzero(pred_labels == c)
            order = mine[np.argsort(-pred_scores[mine], kind='mergesort')][:max_detections]
            scores.append(pred_scores[order])
            hits.append(_match(_box_iou(pred_boxes[order], gt), IOU_THRESHOLDS))
        if true_count == 0:
            continue
        scores, hits = np.concatenate(scores), np.concatenate(hits, axis=1)
        hits = hits[:, np.argsort(-scores, kind='mergesort')]  # stable: ties keep image order, as COCO
        tp = np.cumsum(hits, axis=1, dtype=np.float64)
        fp = np.cumsum(~hits, axis=1, dtype=np.float64)
        q = np.zeros((len(IOU_THRESHOLDS), len(RECALL_THRESHOLDS)))
        for t in range(len(IOU_THRESHOLDS)):
            recall = tp[t] / true_count
            envelope = np.maximum.accumulate((tp[t] / (tp[t] + fp[t] + np.spacing(1)))[::-1])[::-1]
            at = np.searchsorted(recall, RECALL_THRESHOLDS, side='left')
            q[t, at < len(envelope)] = envelope[at[at < len(envelope)]]
        precision[c] = q
    per_class = {f'ap50/{name}': float(precision[c][0].mean()) if c in precision else float('nan')
                 for c, name in enumerate(class_names or ())}  # fmt: skip
    if not precision:
        return {'map50': -1.0, 'map': -1.0, **per_class}
    stacked = np.stack(list(precision.values()))
    return {'map50': float(stacked[:, 0].mean()), 'map': float(stacked.mean()), **per_class}


def draw_detections(
    images_uint8,
    boxes,
    labels,
    scores,
    class_names,
    true_boxes,
    true_labels,
    min_score=0.3,
    count=8,
    columns=4,
    scale=4,
):
    """An HxWx3 uint8 grid of the first `count` images, enlarged `scale` times, under a line saying what is
    drawn: the true boxes in thin white, the predicted boxes scoring at least `min_score` in a colour per
    class, each labelled 'class score' on that colour (labels of boxes that overlap are stacked, not drawn
    over each other). Per-image box lists may be padded (labels -1 are skipped)."""
    from PIL import Image, ImageDraw

    pictures = []
    for i in range(min(count, len(images_uint8))):
        pixels = images_uint8[i].detach().cpu().numpy().transpose(1, 2, 0).repeat(scale, 0).repeat(scale, 1)
        picture = Image.fromarray(np.ascontiguousarray(pixels))
        draw = ImageDraw.Draw(picture)
        truth = torch.as_tensor(true_boxes[i]).detach().cpu().float().reshape(-1, 4)
        for box in truth[torch.as_tensor(true_labels[i]).cpu().reshape(-1) >= 0].mul(scale).round().int().tolist():
            draw.rectangle(box, outline='white', width=1)
        keep = (torch.as_tensor(scores[i]).cpu() >= min_score) & (torch.as_tensor(labels[i]).cpu() >= 0)
        found = boxes[i].detach().cpu().float()[keep].mul(scale).round().int().tolist()
        kinds, confidence = labels[i].cpu()[keep].tolist(), scores[i].cpu()[keep].tolist()
        ranked = sorted(zip(confidence, kinds, found), key=lambda item: -item[0])  # the likeliest labelled first
        for _, kind, box in ranked:
            draw.rectangle(box, outline=PALETTE[kind % len(PALETTE)], width=2)
        taken = []  # the labels' rectangles so far
        for score, kind, box in ranked:
            text = f'{class_names[kind] if class_names else kind} {score:.2f}'
            font = font_for(text, 10)
            width, height = int(font.getlength(text)) + 4, 12
            x, y = max(0, min(box[0], picture.width - width)), max(0, box[1])
            while any(x < r[2] and r[0] < x + width and y < r[3] and r[1] < y + height for r in taken):
                y += height  # below the label it would cover
            colour = PALETTE[kind % len(PALETTE)]
            draw.rectangle((x, y, x + width - 1, y + height - 1), fill=colour)
            draw.text((x + 2, y), text, fill='black' if sum(colour) > 400 else 'white', font=font)
            taken.append((x, y, x + width, y + height))
        pictures.append(np.asarray(picture))
    return picture_grid(pictures, columns, 'white: true boxes; coloured: predicted (class, score)')


def picture_grid(pictures, columns, title, padding=4):
    """Equal-sized HxWx3 uint8 pictures in rows of `columns` on white, `padding` pixels apart, under `title`."""
    height, width = pictures[0].shape[:2]
    columns = min(columns, len(pictures))
    rows = -(-len(pictures) // columns)
    grid = np.full((rows * (height + padding) + padding, columns * (width + padding) + padding, 3), 255, np.uint8)
    for index, picture in enumerate(pictures):
        y, x = padding + index // columns * (height + padding), padding + index % columns * (width + padding)
        grid[y : y + height, x : x + width] = picture
    return np.concatenate([caption(title, (0, 0, 0), grid.shape[1]), grid])
