from model.seg_net.seg_net import SegNet

__all__ = ['SegNet']
