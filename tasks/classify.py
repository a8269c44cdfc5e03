"""Image classification: one label per image; accuracy, top-k accuracy, per-class recall."""

import torch

from metrics import ClassificationMetrics
from tasks.task import Task
from utils.viz import confusion_matrix_image, labeled_grid


class ClassifyTask(Task):
    """Classifies images: the model gives class scores (N, C); targets are `label` (N,)."""

    default_model = 'small_cnn'
    default_data = ('shapes', 'list')
    monitor = 'val/acc'
    targets = ('label',)
    pictured = 16
    mixes = True

    @classmethod
    def metric_names(cls, options):
        monitor = getattr(options, 'monitor', None)  # a top-k that holds every class: kept where monitored
        return ['loss', *ClassificationMetrics.names(options.num_classes, options.topk, monitor)]

    def metrics(self, per_class=True):
        monitor = getattr(self.options, 'monitor', None)
        return ClassificationMetrics(self.num_classes, self.options.topk, monitor=monitor, per_class=per_class)

    def train_metrics(self):
        """acc and top-k without the per-class counts (a training curve shows no recall)."""
        return self.metrics(per_class=False)

    def mixed_targets(self, batch):
        """Class probabilities, as timm mixes them: share `mix_lam` of the sample's own label, the rest its
        partner's."""
        own, other = (torch.nn.functional.one_hot(label, self.num_classes) for label in self._pair_labels(batch))
        lam = batch['mix_lam'].unsqueeze(1)
        return lam * own + (1 - lam) * other

    def metric_targets(self, batch):
        if 'mix_lam' not in batch:
            return batch
        own, other = self._pair_labels(batch)
        return {**batch, 'label': torch.where(batch['mix_lam'] >= 0.5, own, other)}

    @staticmethod
    def _pair_labels(batch):
        return batch['label'], batch['label'][batch['mix_partner']]

    def pictures(self, batch, outputs):
        count = min(self.pictured, self.count(batch))
        predicted, true = self.to_host(outputs[:count].argmax(1), batch['label'][:count])
        return {
            'predictions': labeled_grid(
                self.display_images(batch, count), predicted.tolist(), true.tolist(), self.class_names
            )
        }

    def result_pictures(self, metrics):
        return {'confusion_matrix': confusion_matrix_image(metrics.confusion, self.class_names)}

    eval_header = ('image', 'label', 'prediction', 'confidence', 'label_name', 'prediction_name')

    def eval_rows(self, batch, outputs):
        labels, predicted, confidence = self.to_host(batch['label'], *predicted_with_confidence(outputs))
        names = self.class_names
        return [
            [[label, p, f'{c:.4f}', names[label], names[p]]]
            for label, p, c in zip(labels.tolist(), predicted.tolist(), confidence.tolist())
        ]

    predict_header = ('image', 'prediction', 'prediction_name', 'confidence')

    def predict_rows(self, batch, outputs, paths, folder):
        predicted, confidence = self.to_host(*predicted_with_confidence(outputs))
        return [[[p, self.class_names[p], f'{c:.4f}']] for p, c in zip(predicted.tolist(), confidence.tolist())]


def predicted_with_confidence(logits):
    """Each sample's predicted class, the one the metrics count (argmax of the logits: softmax can round
    two top scores to one value, and its max then names the lower class), and its softmax probability."""
    predicted = logits.argmax(dim=1)
    return predicted, logits.softmax(dim=1).gather(1, predicted[:, None]).squeeze(1)
