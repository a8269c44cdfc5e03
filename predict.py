"""Predict with a checkpoint on images without labels:
`python predict.py --load_model_path checkpoints/<experiment>/best.pth --input FOLDER_OR_LIST`.

Writes into `<experiment>/predict/<checkpoint>_<input>_<save_prefix>/`: predictions.csv (class,
name and confidence per image; for segmentation, the path of each predicted mask) and, for
segmentation, masks/<image>.png holding the class index of every pixel. Images that cannot be
read are listed in unreadable.txt and make the exit code non-zero; none is skipped silently.
"""
from options import parse_args, parse_predict_args

if __name__ == '__main__':
    parse_args(parse_predict_args)  # answer --help and option mistakes before the slow torch import

import csv
import os

import numpy as np
import torch
from PIL import Image

from data.augment import eval_transform
from data.list_dataset import load_image
from eval import load_evaluated_checkpoint
from model.model_entry import select_model
from options import discard_folder_if_setup_fails, prepare_predict_args
from utils.errors import KilnError, run_cli
from utils.logger import progress
from utils.torch_utils import autocast_for, load_weights, place_model, select_device

IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg', '.bmp', '.gif', '.tif', '.tiff', '.webp')


def images_to_predict(source):
    """Image paths from a folder (its image files, sorted, subfolders included) or a list file
    (the first column of each line; labels or masks after it are ignored)."""
    if os.path.isdir(source):
        paths = sorted(os.path.join(folder, name) for folder, _, names in os.walk(source) for name in names
                       if name.lower().endswith(IMAGE_EXTENSIONS))
    elif os.path.isfile(source):
        base = os.path.dirname(os.path.abspath(source))
        with open(source) as f:
            lines = [line.split('#', 1)[0].split() for line in f]
        paths = [os.path.join(base, parts[0]) for parts in lines if parts]
    else:
        raise KilnError(f'--input {source} is neither a folder nor a list file')
    if not paths:
        raise KilnError(f'--input {source} holds no images ({", ".join(IMAGE_EXTENSIONS)})')
    return paths


class Predictor:
    """Runs a checkpoint over unlabelled images in batches and writes what it predicts."""

    def __init__(self, args, checkpoint):
        self.args = args
        self.device = select_device(args)
        class_names = checkpoint.get('class_names')
        args.num_classes = args.num_classes or (len(class_names) if class_names else None)
        if not args.num_classes:
            raise KilnError(f'{args.load_model_path} does not say how many classes it predicts; give --num_classes')
        self.class_names = class_names or [str(c) for c in range(args.num_classes)]
        model = select_model(args)
        load_weights(model, checkpoint, source=args.load_model_path)
        self.model = place_model(model, args, self.device).eval()
        self.autocast = autocast_for(self.device, args.amp)
        self.transform = eval_transform(args)

    def read_batches(self, paths):
        """Yield (paths, images) batches of readable images; note unreadable ones in self.unreadable."""
        self.unreadable = []
        batch = []
        for path in paths:
            try:
                batch.append((path, self.transform(load_image(path, self.args.img_size))))
            except KilnError as error:
                self.unreadable.append((path, str(error)))
            if len(batch) == self.args.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    @torch.no_grad()
    def predict(self, paths):
        """Predict every image in `paths`; write the results; return the number of unreadable images."""
        folder, segment = self.args.result_dir, self.args.task == 'segment'
        if segment:
            os.makedirs(os.path.join(folder, 'masks'))
        rows = []
        for batch in progress(list(self.read_batches(paths)), self.args.progress_bar, 'predict'):
            names, images = zip(*batch)
            with self.autocast():
                outputs = self.model(torch.stack(images).to(self.device)).float()
            if segment:
                rows += [self.save_mask(len(rows) + i, name, mask)
                         for i, (name, mask) in enumerate(zip(names, outputs.argmax(1).cpu().numpy()))]
            else:
                confidence, predicted = outputs.softmax(1).max(1)
                rows += [[name, int(p), self.class_names[int(p)], f'{c:.4f}']
                         for name, p, c in zip(names, predicted.tolist(), confidence.tolist())]
        with open(os.path.join(folder, 'predictions.csv'), 'w', newline='') as f:
            writer = csv.writer(f)
            writer.writerow(['image', 'mask'] if segment else ['image', 'prediction', 'prediction_name', 'confidence'])
            writer.writerows(rows)
        if self.unreadable:
            with open(os.path.join(folder, 'unreadable.txt'), 'w') as f:
                f.writelines(f'{path}\t{reason}\n' for path, reason in self.unreadable)
        return len(rows)

    def save_mask(self, number, image_path, mask):
        """Write a predicted mask (class index per pixel, --img_size square) as masks/<number>_<image name>.png
        (numbered, so images with the same name in different folders keep their own); return its CSV row."""
        stem = os.path.splitext(os.path.basename(image_path))[0]
        path = os.path.join(self.args.result_dir, 'masks', f'{number:05d}_{stem}.png')
        Image.fromarray(mask.astype(np.uint8)).save(path)
        return [image_path, path]


def main(argv=None):
    """Parse the options, make the result folder and predict."""
    args = prepare_predict_args(argv)
    with discard_folder_if_setup_fails(args.result_dir):
        paths = images_to_predict(args.input)
        predictor = Predictor(args, load_evaluated_checkpoint(args))
    count = predictor.predict(paths)
    print(f'{count} predictions in {args.result_dir}/predictions.csv')
    if predictor.unreadable:
        raise KilnError(f'{len(predictor.unreadable)} of {len(paths)} images could not be read (listed with the '
                        f'reasons in {args.result_dir}/unreadable.txt); the others were predicted')


if __name__ == '__main__':
    run_cli(main)
