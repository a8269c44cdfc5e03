"""The progress bar of training, validation, evaluation and prediction."""

from tqdm import tqdm


def progress(iterable, enabled, description, total=None):
    """A tqdm progress bar over `iterable` (a no-op wrapper when `enabled` is False)."""
    return tqdm(
        iterable,
        desc=description,
        disable=not enabled,
        unit='batch',
        leave=False,
        dynamic_ncols=True,
        mininterval=0.5,
        total=total,
    )
