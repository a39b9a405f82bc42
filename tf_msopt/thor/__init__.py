"""THOR: MindSpore's second-order optimizer for Keras models.

``tf_msopt.thor`` is this package and can be called: ``tf_msopt.thor(model)`` (the
default configuration, :data:`DEFAULTS`) or ``tf_msopt.thor(model, learning_rate,
damping, momentum, ...)`` (MindSpore's THOR) is :func:`tf_msopt.thor.factory.thor`,
which creates a :class:`THOR` for a model and connects the capture of curvature
statistics to its layers.

- ``factory.py``: :func:`thor`, :data:`DEFAULTS` and :func:`connect` (reconnects a
  loaded model's THOR after ``load_model``);
- ``optimizer.py``: :class:`THOR`, the lifecycle (connect, build, config) and Keras'
  hooks of the step;
- ``step.py``: the schedule of steps and the step (``ThorStep``: each variable's update,
  planned on its first step, and the statistics handed to the estimator);
- ``preconditioners.py``: the inverse (MindSpore's) and the eigenbasis (the default's),
  each owning its state, refresh and step;
- ``step_modifiers.py``: the pieces of the step after preconditioning (weight decay, norm
  clip, KL clip, momentum, the cautious mask);
- ``model_link.py``: ``ModelLink``, the object THOR holds for its model (the connection,
  the blocks, the report);
- ``grafting.py``: Adam-grafted step lengths (``graft="adam"``);
- ``options.py``: THOR's options, each one entry of ``OPTIONS`` (name, defaults, check,
  meaning), from which the checks, the config, :data:`DEFAULTS` and the docs table come;
- ``experimental.py``: :class:`Experimental`, the options no default uses;
- ``curvature_estimator.py``: each factored layer's curvature state (the
  preconditioner's, moving averages, trace rule), owner of its updates from the captured
  statistics by the three modules below;
- ``curvature_averages.py``: the statistics' moving averages and the pending sums of
  gradient accumulation;
- ``refresh.py``: the refresh schedule, each layer's factor damping (``FactorDamping``)
  and the trace rule's decisions;
- ``replica_division.py``: the refresh divided among replicas, each layer's on its owner;
- ``curvature_base.py``: the base of the curvature blocks and the registry from
  Keras layer types to them;
- ``curvature_blocks/``: one curvature block per layer kind, a module per family
  (``dense.py``: Dense, EinsumDense; ``convolution.py``: Conv1D/2D/3D (grouped too), their
  transposes, DepthwiseConv1D/2D, SeparableConv1D/2D; ``embedding.py``;
  ``normalization.py``: LayerNormalization; ``recurrent.py``: SimpleRNN, GRU, LSTM);
- ``block_diagonal.py``: block-diagonal factor math (damped inverses that never
  go non-finite, block products);
- ``connection.py``: the connection to a model (patched layers, statistics
  buffers, the sampled Fisher);
- ``capture.py``: patches a treated layer's ``call`` to record its statistics;
- ``sampled_fisher.py``: ``G`` from labels sampled from the model's outputs;
- ``loss_scale_link.py``: ``LossScaleLink``, which finds the LossScaleOptimizer that
  applies THOR;
- ``execution.py``: conditionals on the step, one trace, replicas and devices;
- ``report.py``: which layers get which rule (:class:`ThorReport`,
  ``optimizer.report()``);
- ``monitor.py``: :class:`Monitor`, the callback that puts THOR's health (KL factor,
  damping, refreshes, bases kept and recomputed, failed factorisations) in ``fit`` logs;
- ``readings.py``: what THOR's refreshes did, read between steps (the refresh count, the
  bases the last refresh recomputed once counting is asked for, the damping);
- ``cost.py``: the floating-point operations the curvature adds to a step, per layer (the
  report's last table).
"""
import sys
import types

from tf_msopt.thor import block_diagonal as blocks  # the module's former name
from tf_msopt.thor.experimental import Experimental
from tf_msopt.thor.factory import DEFAULTS, connect, thor
from tf_msopt.thor.monitor import Monitor
from tf_msopt.thor.optimizer import THOR
from tf_msopt.thor.report import ThorReport

__all__ = ["DEFAULTS", "Experimental", "Monitor", "THOR", "ThorReport", "connect", "thor"]


class _CallableModule(types.ModuleType):
    """The module type of ``tf_msopt.thor``: calling it calls :func:`thor`, so the package
    and the function are one object and neither shadows the other."""

    __call__ = staticmethod(thor)


sys.modules[__name__].__class__ = _CallableModule
