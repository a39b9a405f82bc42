"""Loss scaling: MindSpore's update cells and managers on Keras' ``LossScaleOptimizer``.

One module per concept:

- ``update_cells.py``: :class:`DynamicLossScaleUpdateCell`,
  :class:`FixedLossScaleUpdateCell`, the scale-update rules of MindSpore's ``nn``
  cells, callable as MindSpore calls them: ``cell(loss_scale_variable, overflow)
  -> overflow``;
- ``managers.py``: :class:`DynamicLossScaleManager`, :class:`FixedLossScaleManager`,
  MindSpore's ``amp`` managers (``get_update_cell``, host-side
  ``update_loss_scale``);
- ``optimizer.py``: :class:`LossScaleOptimizer`, a
  ``keras.optimizers.LossScaleOptimizer`` driven by a cell, a manager or a number,
  with an overflow verdict shared by every replica and a scale that stays in
  ``[1, float32 max]``;
- ``scale_sense.py``: the optimizer's two forms of its scale, MindSpore's
  ``scale_sense`` and Keras' ``initial_scale`` / ``dynamic_growth_steps``: to an
  update cell, into and out of a config with Keras' keys, and from Keras' class;
- ``monitor.py``: :class:`LossScaleMonitor`, a callback that puts the scale and the
  skip counters into ``fit`` logs (progress bar, ``History``, ``TensorBoard``).
"""
from tf_msopt.loss_scale.managers import DynamicLossScaleManager, FixedLossScaleManager
from tf_msopt.loss_scale.monitor import LossScaleMonitor
from tf_msopt.loss_scale.optimizer import LossScaleOptimizer
from tf_msopt.loss_scale.update_cells import DynamicLossScaleUpdateCell, FixedLossScaleUpdateCell

__all__ = [
    "DynamicLossScaleManager",
    "DynamicLossScaleUpdateCell",
    "FixedLossScaleManager",
    "FixedLossScaleUpdateCell",
    "LossScaleMonitor",
    "LossScaleOptimizer",
]
