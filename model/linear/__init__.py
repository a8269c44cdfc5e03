from model.linear.linear import LinearClassifier

__all__ = ['LinearClassifier']
