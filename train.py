"""Train a model: `python train.py --help`.

The Trainer is a plain class: adapt it to a new task by overriding `step`, `compute_loss`,
`compute_metrics` and `gen_imgs_to_write` (or any other method) in a subclass.
"""
from options import parse_args, parse_train_args

if __name__ == '__main__':
    parse_args(parse_train_args)  # answer --help and option mistakes before the slow torch import

import math
import time

import torch
from tqdm import tqdm

from data.augment import denormalize
from data.data_entry import select_eval_loader, select_train_loader
from loss import select_loss
from metrics import classification_metrics
from model.model_entry import equip_multi_gpu, select_model
from options import NOT_SAVED, discard_folder_if_setup_fails, prepare_train_args
from utils.errors import KilnError, run_cli
from utils.logger import Logger, progress
from utils.torch_utils import load_weights, select_device, set_seed, unwrap_model
from utils.viz import labeled_grid

OPTIMIZERS = {
    'sgd': lambda params, args: torch.optim.SGD(params, args.lr, momentum=args.momentum,
                                                weight_decay=args.weight_decay),
    'adam': lambda params, args: torch.optim.Adam(params, args.lr, weight_decay=args.weight_decay),
    'adamw': lambda params, args: torch.optim.AdamW(params, args.lr, weight_decay=args.weight_decay),
}


class Trainer:
    """Trains `--model_type` on `--data_type`, validates every epoch, keeps `last.pth` and `best.pth`."""

    def __init__(self, args):
        self.args = args
        set_seed(args.seed)
        self.device = select_device(args)
        self.train_loader = select_train_loader(args)
        args.num_classes = args.num_classes or self.train_loader.dataset.num_classes
        self.val_loader = select_eval_loader(args)
        self.class_names = self.train_loader.dataset.class_names
        model = select_model(args)
        if args.load_model_path:
            load_weights(model, args.load_model_path, strict=not args.load_not_strict)
        self.model = equip_multi_gpu(model.to(self.device), args)
        self.criterion = select_loss(args.loss)
        self.optimizer = self.make_optimizer()
        self.scheduler = self.make_scheduler()
        self.epoch = 0  # epochs completed
        self.global_step = 0  # optimizer updates made
        self.best_metric = None
        self.logger = Logger(args.model_dir)

    def make_optimizer(self):
        """The optimizer named by --optimizer over all trainable parameters."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return OPTIMIZERS[self.args.optimizer](params, self.args)

    def make_scheduler(self):
        """The learning-rate schedule named by --scheduler, stepped after every optimizer update."""
        steps_per_epoch = len(self.train_loader)
        if self.args.scheduler == 'cosine':
            return torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, self.args.epochs * steps_per_epoch)
        if self.args.scheduler == 'step':
            return torch.optim.lr_scheduler.StepLR(self.optimizer, self.args.lr_step_epochs * steps_per_epoch,
                                                   self.args.lr_gamma)
        return torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)

    def step(self, batch):
        """Move one batch to the device and run the model; return (inputs, outputs, targets)."""
        inputs, targets = batch
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        return inputs, self.model(inputs), targets

    def compute_loss(self, outputs, targets):
        """The training loss of one batch."""
        return self.criterion(outputs, targets)

    def compute_metrics(self, outputs, targets):
        """Metrics of one batch as {name: device tensor}; logged as train/<name> and val/<name>."""
        return classification_metrics(outputs, targets, self.args.topk)

    def gen_imgs_to_write(self, inputs, outputs, targets, split):
        """Pictures of one batch for TensorBoard as {tag: HxWx3 uint8 array}."""
        count = min(32, len(inputs))
        grid = labeled_grid(denormalize(inputs[:count]), outputs[:count].argmax(1).tolist(),
                            targets[:count].tolist(), self.class_names)
        return {f'{split}/predictions': grid}

    def train_per_epoch(self, epoch):
        """One pass over the training data; returns the epoch's mean train/* metrics."""
        self.model.train()
        bar = progress(self.train_loader, self.args.progress_bar, f'train {epoch + 1}/{self.args.epochs}')
        start, seen = time.perf_counter(), 0
        for i, batch in enumerate(bar):
            inputs, outputs, targets = self.step(batch)
            loss = self.compute_loss(outputs, targets)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.global_step += 1

            count = len(targets)
            seen += count
            self.logger.record_scalar('train/loss', loss, count)
            for name, value in self.compute_metrics(outputs.detach(), targets).items():
                self.logger.record_scalar(f'train/{name}', value, count)
            if (i + 1) % self.args.print_freq == 0:  # the only host sync inside the epoch
                running = ' '.join(f'{k} {v:.4f}' for k, v in self.logger.recorder.means().items())
                tqdm.write(f'epoch {epoch + 1} step {i + 1}/{len(self.train_loader)} {running} '
                           f'lr {self.optimizer.param_groups[0]["lr"]:.2e} '
                           f'{seen / (time.perf_counter() - start):.0f} img/s')
        self.logger.record_scalar('train/lr', self.optimizer.param_groups[0]['lr'])
        return self.logger.save_curves(self.global_step)

    @torch.no_grad()
    def val_per_epoch(self, epoch):
        """One pass over the validation data in eval mode; returns the mean val/* metrics."""
        self.model.eval()
        for i, batch in enumerate(progress(self.val_loader, self.args.progress_bar, f'val {epoch + 1}')):
            inputs, outputs, targets = self.step(batch)
            count = len(targets)
            self.logger.record_scalar('val/loss', self.compute_loss(outputs, targets), count)
            for name, value in self.compute_metrics(outputs, targets).items():
                self.logger.record_scalar(f'val/{name}', value, count)
            if i == 0 and self.args.log_images:
                self.logger.save_imgs(self.gen_imgs_to_write(inputs, outputs, targets, 'val'), self.global_step)
        return self.logger.save_curves(self.global_step)

    def state_dict(self):
        """Everything a checkpoint holds: weights, optimizer, scheduler, progress and the run's args."""
        return {
            'model': unwrap_model(self.model).state_dict(),
            'optimizer': self.optimizer.state_dict(),
            'scheduler': self.scheduler.state_dict(),
            'epoch': self.epoch,
            'global_step': self.global_step,
            'best_metric': self.best_metric,
            'class_names': self.class_names,
            'args': {k: v for k, v in vars(self.args).items() if k not in NOT_SAVED},
        }

    def save_checkpoints(self, metrics):
        """Write last.pth, and best.pth too when --monitor improved; return whether it did."""
        if self.args.monitor not in metrics:
            raise KilnError(f'--monitor {self.args.monitor} is not a logged metric; '
                            f'choose one of: {", ".join(sorted(metrics))}')
        value, best = metrics[self.args.monitor], self.best_metric
        improved = math.isfinite(value) and (best is None or (value > best if self.args.monitor_mode == 'max'
                                                              else value < best))
        if improved:
            self.best_metric = value
        self.logger.save_check_point(self.state_dict(), ['last.pth'] + (['best.pth'] if improved else []))
        return improved

    def train(self):
        """Train for --epochs, validating and saving checkpoints after every epoch."""
        start = time.perf_counter()
        try:
            for epoch in range(self.epoch, self.args.epochs):
                metrics = self.train_per_epoch(epoch)
                metrics.update(self.val_per_epoch(epoch))
                self.epoch = epoch + 1
                improved = self.save_checkpoints(metrics)
                shown = ' '.join(f'{k} {v:.4f}' for k, v in metrics.items() if k != 'train/lr')
                print(f'epoch {self.epoch}/{self.args.epochs} {shown}{" (best)" if improved else ""}', flush=True)
        finally:
            self.logger.close()
        folder = self.args.model_dir
        print(f'done in {time.perf_counter() - start:.0f}s; best {self.args.monitor} {self.best_metric:.4f}\n'
              f'  checkpoints: {folder}/best.pth, {folder}/last.pth\n'
              f'  TensorBoard: tensorboard --logdir {self.args.checkpoints_dir}\n'
              f'  evaluate:    python eval.py --load_model_path {folder}/best.pth')


def main(argv=None):
    """Parse the options, make the experiment folder and train."""
    args = prepare_train_args(argv)
    with discard_folder_if_setup_fails(args.model_dir):
        trainer = Trainer(args)
    trainer.train()


if __name__ == '__main__':
    run_cli(main)
