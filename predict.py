"""Predict with a checkpoint on images without labels:
`python predict.py --load_model_path checkpoints/<experiment>/best.pth --input FOLDER_IMAGE_OR_LIST`.

Writes into `<experiment>/predict/<checkpoint>_<input>_<save_prefix>/` predictions.csv, with the
rows the checkpoint's task gives (a class per image, a mask file per image, a row per box, ...).
Images that cannot be read are listed in unreadable.txt and make the exit code non-zero; none is
skipped silently.
"""

import os

from utils.errors import KilnError, quiet_interrupts, run_cli, run_to_exit

if __name__ == '__main__':  # (imported, it changes no handler: see train.py)
    quiet_interrupts()
from options import parse_args, parse_predict_args


def parse_in_one_process(argv):
    """predict.py's options, refused under torchrun: every process would predict every image again."""
    if int(os.environ.get('WORLD_SIZE', '1')) > 1:
        raise KilnError('predict.py runs in one process: start it with python predict.py, not under torchrun')
    return parse_args(parse_predict_args, argv)


if __name__ == '__main__':
    ARGS = run_cli(parse_in_one_process)  # --help and mistakes answer before torch loads

import csv
import functools
import glob

import torch

from data.augment import BatchTransform
from data.image_io import IMAGE_EXTENSIONS, decode_image, find_images, image_format, special_file
from data.list_file import open_names_file, read_image_paths
from data.loader import default_workers, init_worker
from eval import load_for_inference
from options import NOT_USED_IN_PREDICTION, command_words, given_options, prefix_map
from utils.allocator import keep_freed_memory
from utils.device import select_device
from utils.fault_points import fault_point
from utils.model_setup import setup_model
from utils.progress import progress
from utils.run_folder import StagedResults, checkpoint_path, plain_name, result_folder
from utils.run_records import ARGS_TXT, ARGS_YAML


def is_run(folder):
    """Whether `folder` is an experiment folder or a result folder of Kiln's (its options files)."""
    return all(os.path.isfile(os.path.join(folder, name)) for name in (ARGS_YAML, ARGS_TXT))


def folders_holding(paths, top):
    """The folders from `top` down that hold the files `paths` (found under `top`), at any depth."""
    top, folders = os.path.abspath(top), set()
    for path in paths:
        folder = os.path.dirname(os.path.abspath(path))
        while folder not in folders and os.path.commonpath([folder, top]) == top:
            folders.add(folder)
            folder = os.path.dirname(folder)
    return folders


def refuse_runs(source, folders):
    """A KilnError where one of `folders` is a Kiln run or result folder (its pictures, masks or grids would
    be predicted)."""
    runs = sorted(folder for folder in folders if is_run(folder))
    if runs:
        raise KilnError(
            f'--input {source} holds Kiln runs or results, not only images ({runs[0]} holds {ARGS_YAML}): give '
            f'the images to predict alone'
        )


def images_to_predict(source):
    """Image paths from a folder (its image files, sorted, subfolders and links included), one image file (with
    any extension or none, if Pillow reads it), a quoted glob of image files (as eval.py takes checkpoints), or
    a list file (the first field of each entry; labels, masks or boxes after it are ignored)."""
    if os.path.isdir(source):
        paths = find_images(source)
        near = {os.path.abspath(path) for path in (source, *glob.glob(os.path.join(glob.escape(source), '*', '')))}
        refuse_runs(source, near | folders_holding(paths, source))
    elif os.path.isfile(source) and (source.lower().endswith(IMAGE_EXTENSIONS) or image_format(source)):
        paths = [source]
    elif os.path.isfile(source):
        paths = read_image_paths(source)
    elif glob.has_magic(source):
        pattern = os.path.expanduser(source)
        paths = sorted(
            path for path in glob.glob(pattern, recursive=True) if path.lower().endswith(IMAGE_EXTENSIONS)
        )  # (** for any depth)
        fixed = pattern.split(os.sep)  # the folder above the first part with a wildcard: where matches lie
        top = os.sep.join(fixed[: next(i for i, part in enumerate(fixed) if glob.has_magic(part))]) or os.curdir
        refuse_runs(source, folders_holding(paths, top))
    else:
        kind = special_file(source)
        raise KilnError(
            f'--input {source} {f"is {kind}, not a file or folder" if kind else "does not exist"}: give a folder of '
            f'images, an image, a quoted glob or a list file'
        )
    if not paths:
        raise KilnError(f'--input {source} holds no images ({", ".join(IMAGE_EXTENSIONS)})')
    return paths


def source_name(source):
    """The --input's name for the result folder: the file or folder name (a glob's deepest folder without
    wildcards), without extension, in letters, digits, '.', '_' and '-' only (a shell needs no quotes)."""
    while glob.has_magic(source):
        source = os.path.dirname(source)
    return plain_name(source or '.')


class DecodedImages(torch.utils.data.Dataset):
    """The images of `paths` resized as the model was trained (--img_size, --resize, --crop_pct): each
    item is (path, (uint8 image, region, image size)), or (path, reason) for an image that cannot be read."""

    def __init__(self, paths, options):
        self.paths, self.options = paths, options

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        path, o = self.paths[index], self.options
        try:
            return path, decode_image(path, o.img_size, resize=o.resize, crop_pct=o.crop_pct, with_box=True)
        except KilnError as error:
            return path, str(error)


def collate_decoded(items):
    """One batch of DecodedImages items as (paths, images (N, 3, S, S) or None, regions, image sizes,
    unreadable (path, reason) pairs): one tensor per batch crosses from a worker, not one per image."""
    readable = [(path, *result) for path, result in items if not isinstance(result, str)]
    unreadable = [(path, result) for path, result in items if isinstance(result, str)]
    paths, images, regions, sizes = zip(*readable) if readable else ((), (), (), ())
    return paths, torch.stack(images) if images else None, regions, sizes, unreadable


def read_batches(paths, options, unreadable):
    """Yield batches of (paths, uint8 images, regions, image sizes) of the readable images among each
    --batch_size of `paths`, decoded by --num_workers processes, in order (the region is the part of the
    image that became the input); add (path, reason) of the others to `unreadable`."""
    decoded = torch.utils.data.DataLoader(
        DecodedImages(paths, options),
        batch_size=options.batch_size,
        collate_fn=collate_decoded,
        num_workers=default_workers(options.num_workers),
        worker_init_fn=functools.partial(init_worker, os.getpid()),
    )
    for *batch, failed in decoded:
        unreadable += failed
        if batch[0]:
            yield batch


@torch.no_grad()
def predict(options, task, setup, device, paths, folder, named=None):
    """Predict every image of `paths` into `folder`/predictions.csv; return the unreadable (path, reason) pairs.
    The rows name the files written into `folder` (masks) as in `named` (the folder a staged one becomes)."""
    transform = BatchTransform((), options.img_size, options.channels_last, options)
    setup.wrapped.eval()
    unreadable, rows = [], []
    batches = read_batches(paths, options, unreadable)
    for names, images, regions, sizes in progress(
        batches, options.progress_bar, 'predict', total=-(-len(paths) // options.batch_size)
    ):
        inputs = transform({'image': images.to(device, non_blocking=True)})
        # where each input came from: the region of the upright image, and the image's (width, height)
        inputs['region'], inputs['image_size'] = torch.tensor(regions), torch.tensor(sizes)
        with setup.autocast():
            outputs = task.outputs_to_float(task.forward(setup.wrapped, inputs))
        for name, image_rows in zip(names, task.predict_rows(inputs, outputs, names, folder)):
            rows += [[name, *(_renamed(cell, folder, named) for cell in row)] for row in image_rows]
    fault_point('writing_results')
    with open_names_file(os.path.join(folder, 'predictions.csv')) as f:
        writer = csv.writer(f)
        writer.writerow(task.predict_header)
        writer.writerows(rows)
    if unreadable:
        with open_names_file(os.path.join(folder, 'unreadable.txt')) as f:
            f.writelines(f'{path}\t{reason}\n' for path, reason in unreadable)
    return unreadable


def _renamed(cell, folder, named):
    """`cell`, a path in `folder`, as the same path in `named`; anything else as it is."""
    inside = isinstance(cell, str) and named and cell.startswith(os.path.join(folder, ''))
    return os.path.join(named, cell[len(os.path.join(folder, '')) :]) if inside else cell


def main(argv=None, args=None):
    """Resolve the checkpoint and its options, make the result folder and predict."""
    argv = command_words(argv)
    args = args or parse_args(parse_predict_args, argv)
    path = checkpoint_path(args.load_model_path)
    given = given_options(parse_predict_args, argv)
    options, checkpoint, task_type = load_for_inference(args, given, path)
    unused = [f'--{name}' for name in NOT_USED_IN_PREDICTION if name in given]
    if unused:  # a note, not an error: a --config of a training run sets them
        acts = 'they act' if unused[1:] else 'it acts'
        print(f'note: predict.py does not use {", ".join(unused)}: {acts} in training and evaluation only')
    if not options.num_classes:
        raise KilnError(f'{path} does not say how many classes it predicts; give --num_classes')
    paths = images_to_predict(options.input)  # before the folder exists: a refused input leaves nothing
    input_name = source_name(options.input)
    folder = result_folder(path, 'predict', input_name, options.save_prefix, options.output_dir)
    # written whole under a hidden name, then renamed to `folder`; a failure or a stop removes it
    with StagedResults(folder, options, 'choose a new --save_prefix to keep the old predictions') as staged:
        keep_freed_memory()  # each batch reuses the last one's memory, not fresh pages
        device = select_device(options.cpu, options.gpus)
        task = task_type(options, checkpoint.get('class_names'))
        setup = setup_model(
            options,
            device,
            checkpoint,
            strict=not options.load_not_strict,
            source=path,
            prefix_map=prefix_map(options),
            inference=True,
        )
        unreadable = predict(options, task, setup, device, paths, staged.path, named=folder)
    predicted = len(paths) - len(unreadable)
    print(f'{predicted} image{"" if predicted == 1 else "s"} predicted in {folder}/predictions.csv')
    if unreadable:
        raise KilnError(
            f'{len(unreadable)} of {len(paths)} images could not be read (listed with the '
            f'reasons in {folder}/unreadable.txt)' + ('; the others were predicted' if predicted else '')
        )


if __name__ == '__main__':
    run_to_exit(lambda argv: main(argv, ARGS))
