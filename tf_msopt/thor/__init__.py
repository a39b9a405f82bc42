"""THOR: MindSpore's second-order optimizer for Keras models.

``tf_msopt.thor`` is this package and can be called:
``tf_msopt.thor(model, learning_rate, damping, momentum, ...)`` is
:func:`tf_msopt.thor.optimizer.thor`, which creates a :class:`THOR` for a model
and connects the capture of curvature statistics to its layers.

- ``curvature_blocks.py``: one class per layer kind (Dense, EinsumDense,
  Conv1D/2D, DepthwiseConv2D, Embedding, LayerNormalization) and the registry
  from Keras layer types to them;
- ``capture.py``: walks a model and patches the treated layers' ``call``;
- ``blocks.py``: block-diagonal factor math (damped inverses that never go
  non-finite, block products);
- :func:`connect` reconnects a loaded model's THOR (after ``load_model``);
- :class:`ThorReport` (``optimizer.report()``) says what each variable gets.
"""
import sys
import types

from tf_msopt.thor.optimizer import THOR, connect, thor
from tf_msopt.thor.report import ThorReport

__all__ = ["THOR", "ThorReport", "connect", "thor"]


class _CallableModule(types.ModuleType):
    """The module type of ``tf_msopt.thor``: calling it calls :func:`thor`, so the package
    and the function are one object and neither shadows the other."""

    __call__ = staticmethod(thor)


sys.modules[__name__].__class__ = _CallableModule
