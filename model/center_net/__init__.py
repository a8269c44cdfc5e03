from model.center_net.center_net import CenterNet

__all__ = ['CenterNet']
