"""MindSpore's loss-scale update cells: the rule that moves the scale after each step.

The argument checks shared with the managers and the optimizer are here too.
"""
import math

import numpy as np
import tensorflow as tf

from tf_msopt._common import register
from tf_msopt._validation import check_float, check_int, check_number_range

__all__ = ["DynamicLossScaleUpdateCell", "FixedLossScaleUpdateCell", "LossScaleUpdateCell",
           "check_loss_scale", "check_scale_factor", "check_scale_window", "select"]


def _check_real(value, arg, owner, low, low_inclusive):
    """A finite real number >= ``low`` (> ``low`` unless ``low_inclusive``), as ``float``."""
    return check_number_range(check_float(value, arg, owner), arg, owner, low=low, high=math.inf,
                              low_inclusive=low_inclusive, high_inclusive=False)


def check_loss_scale(value, arg, owner):
    return _check_real(value, arg, owner, low=1.0, low_inclusive=True)


def check_scale_factor(value, owner):
    return _check_real(value, "scale_factor", owner, low=0.0, low_inclusive=False)


def check_scale_window(value, owner):
    return check_int(value, "scale_window", owner, min_value=1)


def select(condition, if_true, if_false):
    """``tf.where``, decided while tracing when ``condition`` is a Python bool."""
    if isinstance(condition, bool):
        return if_true if condition else if_false
    return tf.where(condition, if_true, if_false)


def _bounded(candidate, scale):
    """Deviation from MindSpore: a new scale is finite and >= 1 whatever the factor."""
    return tf.where(tf.math.is_finite(candidate), tf.maximum(candidate, 1.0), scale)


class LossScaleUpdateCell:
    """Base of the update cells: a scale-update rule plus MindSpore's cell API."""

    def __init__(self, loss_scale_value):
        self.loss_scale_value = check_loss_scale(loss_scale_value, "loss_scale_value",
                                                  type(self).__name__)

    def get_loss_scale(self):
        """The scale the cell was created with."""
        return self.loss_scale_value

    def _next_state(self, scale, overflow, counter):
        """One step of the rule.

        Args:
            scale: the current scale (float tensor).
            overflow: True when this step's gradients were not finite (a bool
                tensor, or a Python bool that selects the branch while tracing).
            counter: int64 tensor, clean steps since the window last restarted.

        Returns:
            ``(new_scale, restart)``: the float32 scale after this step, and
            whether the window restarts (the counter goes back to 0).
        """
        raise NotImplementedError

    def get_config(self):
        return {"loss_scale_value": self.loss_scale_value}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@register
class DynamicLossScaleUpdateCell(LossScaleUpdateCell):
    """MindSpore's dynamic loss-scale update rule (``nn.DynamicLossScaleUpdateCell``).

    After each step, with ``overflow`` True when a gradient was not finite and
    ``clean`` the number of consecutive clean steps including this one::

        if overflow:                   scale = max(scale * (1/scale_factor), 1)
        elif clean == scale_window:    scale = scale * scale_factor
        # the window restarts on an overflow and after a growth

    ``1/scale_factor`` is a float32 reciprocal, as in MindSpore. Deviation:
    a growth that would overflow float32 keeps the scale (MindSpore's cell
    reaches ``inf``), and the scale never goes below 1, so it stays in
    ``[1, float32 max]``.

    Called as MindSpore calls it, ``cell(loss_scale, overflow)`` assigns the new
    scale to the ``loss_scale`` variable in place, advances the cell's own
    ``cur_iter`` / ``last_overflow_iter`` counters and returns ``overflow``.
    Inside :class:`LossScaleOptimizer` the rule runs on the optimizer's own
    variables instead, so that they are saved with it.

    Args:
        loss_scale_value: the initial scale, a finite number >= 1.
        scale_factor: the factor of each growth and each decrease, > 0.
        scale_window: the number of consecutive clean steps before a growth, an
            int >= 1.

    Reference:
        MindSpore ``mindspore.nn.DynamicLossScaleUpdateCell``;
        Micikevicius et al., Mixed Precision Training, ICLR 2018
        (arXiv:1710.03740).
    """

    def __init__(self, loss_scale_value, scale_factor, scale_window):
        super().__init__(loss_scale_value)
        owner = type(self).__name__
        self.scale_factor = check_scale_factor(scale_factor, owner)
        self.scale_window = check_scale_window(scale_window, owner)
        # MindSpore multiplies by the float32 reciprocal of the factor.
        self._inv_factor = float(np.float32(1) / np.float32(self.scale_factor))
        # MindSpore's counters, used only when the cell is called directly.
        self.cur_iter = tf.Variable(1, dtype=tf.int64, trainable=False, name="cur_iter")
        self.last_overflow_iter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                              name="last_overflow_iter")

    def __call__(self, loss_scale, overflow):
        overflow_flag = tf.cast(overflow, tf.bool)
        cur_iter = self.cur_iter.read_value()
        counter = cur_iter - self.last_overflow_iter - 1
        new_scale, restart = self._next_state(loss_scale, overflow_flag, counter)
        loss_scale.assign(tf.cast(new_scale, loss_scale.dtype))
        self.last_overflow_iter.assign(tf.where(restart, cur_iter, self.last_overflow_iter))
        self.cur_iter.assign_add(1)
        return overflow

    def _next_state(self, scale, overflow, counter):
        scale = tf.cast(scale, tf.float32)
        should_grow = tf.cast(counter, tf.int64) + 1 >= self.scale_window
        lowered = _bounded(scale * self._inv_factor, scale)      # max(scale/factor, 1)
        grown = _bounded(scale * self.scale_factor, scale)
        new_scale = select(overflow, lowered, tf.where(should_grow, grown, scale))
        return new_scale, select(overflow, True, should_grow)

    def get_config(self):
        return {**super().get_config(), "scale_factor": self.scale_factor,
                "scale_window": self.scale_window}


@register
class FixedLossScaleUpdateCell(LossScaleUpdateCell):
    """MindSpore's fixed loss scale (``nn.FixedLossScaleUpdateCell``).

    The scale never changes. ``cell(loss_scale, overflow)`` returns ``overflow``
    and does nothing else; :class:`LossScaleOptimizer` still skips the update of
    a step whose gradients are not finite, as MindSpore's training cell does.

    Args:
        loss_scale_value: the scale, a finite number >= 1.

    Reference:
        MindSpore ``mindspore.nn.FixedLossScaleUpdateCell``.
    """

    def __call__(self, loss_scale, overflow):
        return overflow

    def _next_state(self, scale, overflow, counter):
        # The counter then counts clean steps since the last overflow.
        return tf.cast(scale, tf.float32), overflow

