"""Photos: a folder with a subfolder of images per class (or a list file), read from disk, trained as
timm and torchvision train ImageNet models."""

from data.list_dataset import ListDataset


class PhotosDataset(ListDataset):
    """Photos of any size and aspect ratio: the aspect ratio is kept (a centred crop to validate and
    evaluate, --resize crop) and training takes RandomResizedCrops (--crop_scale, --crop_ratio) and
    horizontal flips, cropped in the DataLoader workers from the full-resolution image."""

    resize = 'crop'
    augment = ('resized_crop', 'hflip')
