"""Schedules: per-step arrays (MindSpore's 1-D learning rates), THOR's model-zoo
learning rate and damping, and sign decays.

The classes are ``keras.optimizers.schedules.LearningRateSchedule`` subclasses
registered under the ``tf_msopt`` package, so they serialize with the optimizer
and load with ``keras.models.load_model(safe_mode=True)``. ``thor_lr`` and
``thor_damping`` return per-step arrays, as MindSpore's model zoo does.

:func:`value_at_step` and :func:`serialize_step_value` read and save an optimizer
argument that may be a number, a schedule or a zero-argument callable.
"""
import math

import keras
import numpy as np
import tensorflow as tf

from tf_msopt._common import register
from tf_msopt._validation import check_float, check_int, check_number_range

__all__ = ["PerStepSchedule", "LinearSignDecay", "CosineSignDecay", "RestartSignDecay",
           "thor_damping", "thor_lr"]

#: Keras' base class of the schedules of the step.
Schedule = keras.optimizers.schedules.LearningRateSchedule


def value_at_step(value, step):
    """An argument at ``step``: a number as it is, a schedule called with ``step``, another
    callable called with no argument (Keras' form of a learning rate)."""
    if isinstance(value, Schedule):
        return value(step)
    return value() if callable(value) else value


def serialize_step_value(value, what, owner):
    """The config form of a :func:`value_at_step` argument; ``what`` names it in the error
    a Python callable raises (it cannot be saved)."""
    if isinstance(value, Schedule):
        return keras.saving.serialize_keras_object(value)
    if callable(value):
        raise ValueError(
            f"For '{owner}', {what} is the Python callable {value!r}, which cannot be saved. "
            f"Pass a number, an array or a keras LearningRateSchedule.")
    return value


@register
class PerStepSchedule(Schedule):
    """A value per step: ``values[step]``, the form of a MindSpore 1-D learning rate.

    MindSpore gathers ``learning_rate[global_step]`` and fails once the step runs
    past the end of the array. Here the last value is held instead, so a run that
    trains a few steps longer than planned keeps going.

    Args:
        values: 1-D sequence of floats, entry ``i`` used at step ``i``.
    """

    def __init__(self, values):
        array = np.asarray(values, dtype=np.float64)
        if array.ndim != 1 or array.size == 0:
            raise ValueError(
                "For 'PerStepSchedule', the 'values' must be a non-empty 1-D sequence, "
                f"but got shape {array.shape}."
            )
        self.values = [float(v) for v in array]
        self._table = tf.constant(array, dtype=tf.float32)

    def __call__(self, step):
        index = tf.minimum(tf.cast(step, tf.int32), len(self.values) - 1)
        return tf.gather(self._table, index)

    def get_config(self):
        return {"values": list(self.values)}


def _check_decay_steps(decay_steps, owner):
    return check_int(decay_steps, "decay_steps", owner, min_value=1)


def _check_zero_after(zero_after, owner):
    if zero_after is None:
        return None
    return check_number_range(check_float(zero_after, "zero_after", owner), "zero_after", owner,
                              low=0.0)


class _SignDecay(Schedule):
    """Shared clamp of the step to ``[0, decay_steps]`` (steps past the end keep the last value)."""

    def _clamped_step(self, step):
        return tf.minimum(tf.cast(step, tf.float32), float(self.decay_steps))


class _PeriodicSignDecay(_SignDecay):
    """Shared arguments of the cosine and restart decays."""

    def __init__(self, decay_steps, num_periods, zero_after):
        owner = type(self).__name__
        self.decay_steps = _check_decay_steps(decay_steps, owner)
        self.num_periods = check_number_range(
            check_float(num_periods, "num_periods", owner), "num_periods", owner, low=0.0,
            low_inclusive=False)
        self.zero_after = _check_zero_after(zero_after, owner)

    def get_config(self):
        return {"decay_steps": self.decay_steps, "num_periods": self.num_periods,
                "zero_after": self.zero_after}


@register
class LinearSignDecay(_SignDecay):
    """Linear decay of the sign term: ``max(0, (T - min(t, T)) / T)``.

    From Bello et al. 2017, "Neural Optimizer Search with Reinforcement
    Learning" (arXiv:1709.07417), as TensorFlow 1.x ``contrib.opt`` had it.

    Args:
        decay_steps: ``T``, the number of steps over which the sign term decays to 0.
    """

    def __init__(self, decay_steps):
        self.decay_steps = _check_decay_steps(decay_steps, "LinearSignDecay")

    def __call__(self, step):
        remaining = float(self.decay_steps) - self._clamped_step(step)
        return tf.maximum(0.0, remaining / float(self.decay_steps))

    def get_config(self):
        return {"decay_steps": self.decay_steps}


@register
class CosineSignDecay(_PeriodicSignDecay):
    """Cosine decay of the sign term: ``0.5 * (1 + cos(2*pi*n*min(t, T)/T))``.

    Args:
        decay_steps: ``T``.
        num_periods: ``n``; the default 0.5 reaches 0 at step ``T``.
        zero_after: if set, 0 once ``2*n*t/T >= 2*zero_after`` (contrib's rule).
    """

    def __init__(self, decay_steps, num_periods=0.5, zero_after=None):
        super().__init__(decay_steps, num_periods, zero_after)

    def __call__(self, step):
        fraction = 2.0 * self.num_periods * self._clamped_step(step) / float(self.decay_steps)
        decayed = 0.5 * (1.0 + tf.cos(math.pi * fraction))
        if self.zero_after is not None:
            decayed = tf.where(fraction >= 2.0 * self.zero_after, 0.0, decayed)
        return decayed


@register
class RestartSignDecay(_PeriodicSignDecay):
    """Restart (SGDR-style) decay: ``0.5 * (1 + cos(pi * ((n*min(t, T)) mod T) / T))``.

    Args:
        decay_steps: ``T``.
        num_periods: ``n``, the number of restarts within ``T`` steps.
        zero_after: if set, 0 once ``n*t/T >= zero_after``.
    """

    def __init__(self, decay_steps, num_periods=1.0, zero_after=None):
        super().__init__(decay_steps, num_periods, zero_after)

    def __call__(self, step):
        cycles = self.num_periods * self._clamped_step(step)
        fraction = tf.math.floormod(cycles, float(self.decay_steps)) / float(self.decay_steps)
        decayed = 0.5 * (1.0 + tf.cos(math.pi * fraction))
        if self.zero_after is not None:
            decayed = tf.where(cycles / float(self.decay_steps) >= self.zero_after, 0.0, decayed)
        return decayed


def _thor_steps(global_step, total_epochs, steps_per_epoch, owner):
    """Checks the shared arguments; returns ``(first step, epoch reached after each step)``."""
    global_step = check_int(global_step, "global_step", owner, min_value=0)
    total_epochs = check_int(total_epochs, "total_epochs", owner, min_value=1)
    steps_per_epoch = check_int(steps_per_epoch, "steps_per_epoch", owner, min_value=1)
    epochs = np.arange(1, total_epochs * steps_per_epoch + 1, dtype=np.float64) / steps_per_epoch
    return global_step, epochs


def thor_lr(global_step, lr_init, decay, total_epochs, steps_per_epoch, decay_epochs=100):
    """THOR's learning rate per step, as MindSpore's model zoo (ResNet-50) makes it.

    For step ``i`` with ``e = (i + 1) / steps_per_epoch`` the epoch it completes::

        lr[i] = lr_init * (1 - e / total_epochs) ** decay
                * (0.5 if e >= decay_epochs) * (0.5 if e >= decay_epochs + 1)

    Args:
        global_step: the first step returned (resuming at ``global_step``).
        lr_init: the initial rate.
        decay: the polynomial power.
        total_epochs: epochs over which the rate reaches 0.
        steps_per_epoch: steps in one epoch.
        decay_epochs: the epoch from which the rate is halved, and halved again
            one epoch later.

    Returns:
        float32 array of ``total_epochs * steps_per_epoch - global_step`` rates,
        ready to pass as THOR's ``learning_rate`` (entry ``i`` used at step ``i``).
    """
    owner = "thor_lr"
    start, epochs = _thor_steps(global_step, total_epochs, steps_per_epoch, owner)
    lr_init = check_float(lr_init, "lr_init", owner)
    decay = check_float(decay, "decay", owner)
    decay_epochs = check_float(decay_epochs, "decay_epochs", owner)
    rates = lr_init * (1.0 - epochs / total_epochs) ** decay
    rates = np.where(epochs >= decay_epochs, 0.5 * rates, rates)
    rates = np.where(epochs >= decay_epochs + 1, 0.5 * rates, rates)
    return rates.astype(np.float32)[start:]


def thor_damping(global_step, damping_init, decay_rate, total_epochs, steps_per_epoch):
    """THOR's damping per step, as MindSpore's model zoo (ResNet-50) makes it::

        damping[i] = damping_init * decay_rate ** (((i + 1) / steps_per_epoch) / 10)

    Arguments as :func:`thor_lr`. Returns a float32 array from ``global_step`` on,
    ready to pass as THOR's ``damping``.
    """
    owner = "thor_damping"
    start, epochs = _thor_steps(global_step, total_epochs, steps_per_epoch, owner)
    damping_init = check_float(damping_init, "damping_init", owner)
    decay_rate = check_float(decay_rate, "decay_rate", owner)
    return (damping_init * decay_rate ** (epochs / 10.0)).astype(np.float32)[start:]
