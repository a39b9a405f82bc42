"""MindSpore's training optimizers for TensorFlow 2.21 / Keras 3."""
from tf_msopt import ops, schedules
from tf_msopt.optimizers import AddSign, PowerSign

__version__ = "0.1.0"

__all__ = ["AddSign", "PowerSign", "ops", "schedules"]
