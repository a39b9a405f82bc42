"""THOR: MindSpore's second-order optimizer for Keras models.

- :func:`thor` creates a :class:`THOR` for a model and connects the capture of
  curvature statistics to its layers (``capture.py``);
- ``blocks.py`` holds the block-diagonal factor math (statistics, damped
  inverses that never go non-finite, preconditioning);
- :func:`connect` reconnects a loaded model's THOR (after ``load_model``);
- :class:`ThorReport` (``optimizer.report()``) says what each variable gets.
"""
from tf_msopt.thor.optimizer import THOR, connect, thor
from tf_msopt.thor.report import ThorReport

__all__ = ["THOR", "ThorReport", "connect", "thor"]
