"""MindSpore's training optimizers for TensorFlow 2.21 / Keras 3."""
from tf_msopt import ops, schedules
from tf_msopt.loss_scale import (DynamicLossScaleManager, DynamicLossScaleUpdateCell,
                                 FixedLossScaleManager, FixedLossScaleUpdateCell,
                                 LossScaleOptimizer)
from tf_msopt.optimizers import AdamOffload, AddSign, LARS, PowerSign
from tf_msopt import thor  # the package; calling it creates a THOR (see its docstring)
from tf_msopt.thor import THOR

__version__ = "0.1.0"

__all__ = ["AdamOffload", "AddSign", "DynamicLossScaleManager", "DynamicLossScaleUpdateCell",
           "FixedLossScaleManager", "FixedLossScaleUpdateCell", "LossScaleOptimizer", "LARS",
           "PowerSign", "THOR", "ops", "schedules", "thor"]
