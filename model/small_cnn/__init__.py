from model.small_cnn.small_cnn import SmallCNN

__all__ = ['SmallCNN']
