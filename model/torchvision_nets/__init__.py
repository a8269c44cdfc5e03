from model.torchvision_nets.torchvision_nets import TORCHVISION_NETS, torchvision_net

__all__ = ['TORCHVISION_NETS', 'torchvision_net']
