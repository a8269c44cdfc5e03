"""What does the training recipe give on real photos? `python bench/bench_recipe.py [--epochs 30] [--seeds 2]`

Trains the same model on the real-photo set (data/photo_set.py: 6 classes of photographs from
scikit-image, 60 training and 20 validation photos per class, 64 to 320 pixels a side) with:
- plain: `--data_type list` (the whole photo squashed to a square, a small shifted crop);
- photos: `--data_type photos` (aspect ratio kept, RandomResizedCrop and flips);
- recipe: photos plus colour jitter, random erasing, mixup and cutmix, label smoothing and an EMA;
- recipe_mild: the recipe with crops of at least 35% of a photo (--crop_scale 0.35 1), for small data.
Prints the best and final validation accuracy and the training time of each (mean over --seeds).
Needs the dev extra (scikit-image).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data.photo_set import make_photo_set

RECIPES = {
    'plain': ['--data_type', 'list'],
    'photos': ['--data_type', 'photos'],
    'recipe': [
        '--data_type',
        'photos',
        '--augment',
        'resized_crop,hflip,color,erase,mixup,cutmix',
        '--loss',
        'label_smoothing',
        '--ema_decay',
        '0.998',
    ],
}
RECIPES['recipe_mild'] = [*RECIPES['recipe'], '--crop_scale', '0.35', '1']  # crops of 35% of a photo or more


def main():
    """Train every recipe with every seed and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--epochs', type=int, default=30)
    parser.add_argument('--seeds', type=int, default=2)
    parser.add_argument('--img_size', type=int, default=64)
    parser.add_argument('--model_type', default='small_cnn')
    parser.add_argument('extra', nargs='*', help='more train.py options after --, e.g. -- --cpu')
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        photos = make_photo_set(os.path.join(scratch, 'photos'))
        results = {name: [] for name in RECIPES}
        for seed in range(options.seeds):
            for name, recipe in RECIPES.items():
                folder = os.path.join(scratch, f'{name}{seed}')
                command = [
                    sys.executable,
                    'train.py',
                    *recipe,
                    '--train_list',
                    os.path.join(photos, 'train'),
                    '--val_list',
                    os.path.join(photos, 'val'),
                    '--model_type',
                    options.model_type,
                    '--img_size',
                    str(options.img_size),
                    '--epochs',
                    str(options.epochs),
                    '--batch_size',
                    '32',
                    '--seed',
                    str(seed),
                    '--checkpoints_dir',
                    folder,
                    '--no-progress_bar',
                    *options.extra,
                ]
                start = time.perf_counter()
                subprocess.run(command, cwd=REPO, check=True, capture_output=True)
                seconds = time.perf_counter() - start
                (experiment,) = os.listdir(folder)
                with open(os.path.join(folder, experiment, 'history.json')) as f:
                    accuracy = json.load(f)['metrics']['val/acc']
                results[name].append((max(accuracy), accuracy[-1], seconds))
                print(
                    f'  {name} seed {seed}: best {max(accuracy):.3f}, final {accuracy[-1]:.3f}, {seconds:.0f}s',
                    flush=True,
                )
    print(f'{options.model_type} at {options.img_size} px, {options.epochs} epochs, means over {options.seeds} seeds:')
    for name, runs in results.items():
        best, final, seconds = (statistics.mean(values) for values in zip(*runs))
        print(f'  {name:11s} best val acc {best:.3f}  final {final:.3f}  {seconds:.0f}s')


if __name__ == '__main__':
    main()
