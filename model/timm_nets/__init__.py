from model.timm_nets.timm_nets import timm_net

__all__ = ['timm_net']
