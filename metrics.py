"""Classification metrics computed on the device, returned as tensors (no host sync)."""
import torch


def topk_accuracy(logits, targets, k=1):
    """Fraction of samples whose true class is among the k highest scores."""
    k = min(k, logits.shape[1])
    top = logits.topk(k, dim=1).indices
    return (top == targets.unsqueeze(1)).any(dim=1).double().mean()  # float64: sums over ranks stay exact to ~1e-15


def confusion_matrix(predictions, targets, num_classes):
    """Counts (num_classes, num_classes): row = true class, column = predicted class."""
    index = targets * num_classes + predictions
    return torch.bincount(index, minlength=num_classes * num_classes).view(num_classes, num_classes)


def accuracy_from_confusion(matrix):
    """Overall accuracy and per-class recall from a confusion matrix."""
    matrix = matrix.double()
    per_class = matrix.diagonal() / matrix.sum(dim=1).clamp(min=1)
    return matrix.diagonal().sum() / matrix.sum().clamp(min=1), per_class


def classification_metrics(logits, targets, k):
    """The metrics logged for classification: top-1 accuracy `acc` and top-k accuracy `top<k>`."""
    return {'acc': topk_accuracy(logits, targets, 1), f'top{k}': topk_accuracy(logits, targets, k)}


def iou_from_confusion(matrix):
    """Per-class intersection over union from a confusion matrix (NaN for classes never seen)."""
    matrix = matrix.double()
    intersection = matrix.diagonal()
    union = matrix.sum(dim=0) + matrix.sum(dim=1) - intersection
    return intersection / union  # 0/0 = NaN: absent from both prediction and truth


def segmentation_metrics(logits, targets, num_classes):
    """Per-batch segmentation metrics: pixel accuracy `pixel_acc` and `miou`, the mean IoU over the
    classes present in the batch (the Evaluator computes the exact mIoU over the whole list)."""
    predicted = logits.argmax(dim=1)
    iou = iou_from_confusion(confusion_matrix(predicted.flatten(), targets.flatten(), num_classes))
    return {'pixel_acc': (predicted == targets).double().mean(), 'miou': iou.nanmean()}
