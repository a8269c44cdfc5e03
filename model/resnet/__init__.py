from model.resnet.resnet import ResNet18

__all__ = ['ResNet18']
