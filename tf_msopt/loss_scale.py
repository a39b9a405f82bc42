"""Loss scaling: MindSpore's update cells and managers on Keras' ``LossScaleOptimizer``.

- :class:`DynamicLossScaleUpdateCell`, :class:`FixedLossScaleUpdateCell`: the
  scale-update rules of MindSpore's ``nn`` cells, callable as MindSpore calls
  them: ``cell(loss_scale_variable, overflow) -> overflow``.
- :class:`DynamicLossScaleManager`, :class:`FixedLossScaleManager`: MindSpore's
  ``amp`` managers (``get_update_cell``, host-side ``update_loss_scale``).
- :class:`LossScaleOptimizer`: a ``keras.optimizers.LossScaleOptimizer`` driven
  by a cell, a manager or a number, with an overflow verdict shared by every
  replica and a scale that stays in ``[1, float32 max]``.
- :class:`LossScaleMonitor`: a callback that puts the scale and the skip
  counters into ``fit`` logs (progress bar, ``History``, ``TensorBoard``).
"""
import math
import numbers

import keras
import numpy as np
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import register
from tf_msopt._validation import (check_bool, check_float, check_int, check_number_range,
                                  type_name)
from tf_msopt.optimizers.base import (AcceptsEmptyGradients, BuildsOnceEveryReplicaIsReady,
                                      set_all_weights)

__all__ = [
    "DynamicLossScaleManager",
    "DynamicLossScaleUpdateCell",
    "FixedLossScaleManager",
    "FixedLossScaleUpdateCell",
    "LossScaleMonitor",
    "LossScaleOptimizer",
]

_FLOAT32_MAX = float(np.finfo(np.float32).max)
#: MindSpore's host-side manager gives up after this many consecutive overflows.
_MAX_CONSECUTIVE_OVERFLOWS = 1000


def _check_real(value, arg, owner, low, low_inclusive):
    """A finite real number >= ``low`` (> ``low`` unless ``low_inclusive``), as ``float``."""
    return check_number_range(check_float(value, arg, owner), arg, owner, low=low, high=math.inf,
                              low_inclusive=low_inclusive, high_inclusive=False)


def _check_loss_scale(value, arg, owner):
    return _check_real(value, arg, owner, low=1.0, low_inclusive=True)


def _check_scale_factor(value, owner):
    return _check_real(value, "scale_factor", owner, low=0.0, low_inclusive=False)


def _check_scale_window(value, owner):
    return check_int(value, "scale_window", owner, min_value=1)


# --------------------------------------------------------------------------- cells


def _select(condition, if_true, if_false):
    """``tf.where``, decided while tracing when ``condition`` is a Python bool."""
    if isinstance(condition, bool):
        return if_true if condition else if_false
    return tf.where(condition, if_true, if_false)


def _bounded(candidate, scale):
    """Deviation from MindSpore: a new scale is finite and >= 1 whatever the factor."""
    return tf.where(tf.math.is_finite(candidate), tf.maximum(candidate, 1.0), scale)


class _LossScaleUpdateCell:
    """Base of the update cells: a scale-update rule plus MindSpore's cell API."""

    def __init__(self, loss_scale_value):
        self.loss_scale_value = _check_loss_scale(loss_scale_value, "loss_scale_value",
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
class DynamicLossScaleUpdateCell(_LossScaleUpdateCell):
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
        self.scale_factor = _check_scale_factor(scale_factor, owner)
        self.scale_window = _check_scale_window(scale_window, owner)
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
        new_scale = _select(overflow, lowered, tf.where(should_grow, grown, scale))
        return new_scale, _select(overflow, True, should_grow)

    def get_config(self):
        return {**super().get_config(), "scale_factor": self.scale_factor,
                "scale_window": self.scale_window}


@register
class FixedLossScaleUpdateCell(_LossScaleUpdateCell):
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


# ------------------------------------------------------------------------ managers


@register
class FixedLossScaleManager:
    """MindSpore's ``amp.FixedLossScaleManager``: a constant loss scale.

    With ``drop_overflow_update=True`` a step whose gradients are not finite is
    skipped; with ``False`` the gradients are never checked and every step is
    applied (MindSpore then trains with a plain ``TrainOneStepCell``).

    Args:
        loss_scale: the scale, a finite number >= 1.
        drop_overflow_update: whether to skip steps that overflow.

    Reference:
        MindSpore ``mindspore.amp.FixedLossScaleManager``.
    """

    def __init__(self, loss_scale=128.0, drop_overflow_update=True):
        owner = type(self).__name__
        self.loss_scale = _check_loss_scale(loss_scale, "loss_scale", owner)
        self.drop_overflow_update = check_bool(drop_overflow_update, "drop_overflow_update",
                                               owner)

    def get_loss_scale(self):
        return self.loss_scale

    def get_drop_overflow_update(self):
        return self.drop_overflow_update

    def update_loss_scale(self, overflow):
        """Host-side update: a fixed scale never changes."""

    def get_update_cell(self):
        """A :class:`FixedLossScaleUpdateCell`, or ``None`` when overflows are not dropped."""
        if not self.drop_overflow_update:
            return None
        return FixedLossScaleUpdateCell(self.loss_scale)

    def get_config(self):
        return {"loss_scale": self.loss_scale, "drop_overflow_update": self.drop_overflow_update}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@register
class DynamicLossScaleManager:
    """MindSpore's ``amp.DynamicLossScaleManager``: the dynamic rule, host side.

    ``get_update_cell()`` returns a :class:`DynamicLossScaleUpdateCell` that
    starts from the manager's current scale; that is what
    :class:`LossScaleOptimizer` uses. ``update_loss_scale(overflow)`` runs the
    same rule on the host (Python floats)::

        if overflow: scale = max(scale / scale_factor, 1)
        elif (cur_iter - last_overflow_iter) % scale_window == 0: scale *= scale_factor

    and raises ``RuntimeError`` on the 1001st consecutive overflow. Deviation:
    a growth past float32's largest value keeps the scale.

    Args:
        init_loss_scale: the initial scale, a finite number >= 1.
        scale_factor: the factor of each growth and each decrease, > 0.
        scale_window: the number of consecutive clean steps before a growth, an
            int >= 1.

    Reference:
        MindSpore ``mindspore.amp.DynamicLossScaleManager``.
    """

    def __init__(self, init_loss_scale=2**24, scale_factor=2, scale_window=2000):
        owner = type(self).__name__
        self.init_loss_scale = _check_loss_scale(init_loss_scale, "init_loss_scale", owner)
        self.scale_window = _check_scale_window(scale_window, owner)
        self.scale_factor = _check_scale_factor(scale_factor, owner)
        self.loss_scale = self.init_loss_scale
        self.cur_iter = 1
        self.last_overflow_iter = 0
        self.bad_step = 0

    def get_loss_scale(self):
        return self.loss_scale

    def get_drop_overflow_update(self):
        return True

    def update_loss_scale(self, overflow):
        """Host-side update of :meth:`get_loss_scale` after a step."""
        if overflow:
            self.loss_scale = max(self.loss_scale / self.scale_factor, 1.0)
            self.last_overflow_iter = self.cur_iter
            self.bad_step += 1
        else:
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                grown = self.loss_scale * self.scale_factor
                if grown <= _FLOAT32_MAX:
                    self.loss_scale = grown
            self.bad_step = 0
        if self.bad_step > _MAX_CONSECUTIVE_OVERFLOWS:
            raise RuntimeError(
                f"Dynamic loss scale: {self.bad_step} consecutive overflows, more than the "
                f"maximum of {_MAX_CONSECUTIVE_OVERFLOWS}. The loss or its gradients are not "
                f"finite even at scale {self.loss_scale}."
            )
        self.cur_iter += 1

    def get_update_cell(self):
        """A :class:`DynamicLossScaleUpdateCell` starting from the current scale."""
        return DynamicLossScaleUpdateCell(self.loss_scale, self.scale_factor, self.scale_window)

    def get_config(self):
        return {"init_loss_scale": self.init_loss_scale, "scale_factor": self.scale_factor,
                "scale_window": self.scale_window}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


# ----------------------------------------------------------------------- optimizer

_Managers = (DynamicLossScaleManager, FixedLossScaleManager)
_Scalars = (tf.Tensor, tf.Variable, keras.Variable, np.ndarray, np.generic)


def _resolve_scale_sense(scale_sense, owner):
    """``(scale_sense to keep, update cell or None, initial scale)`` of a scale_sense."""
    if isinstance(scale_sense, _LossScaleUpdateCell):
        return scale_sense, scale_sense, scale_sense.get_loss_scale()
    if isinstance(scale_sense, _Managers):
        return scale_sense, scale_sense.get_update_cell(), scale_sense.get_loss_scale()
    if isinstance(scale_sense, _Scalars) and not isinstance(scale_sense, bool):
        array = np.asarray(scale_sense)
        if array.shape not in ((), (1,)):
            raise ValueError(f"For '{owner}', the shape of 'scale_sense' must be (1,) or (), "
                             f"but got {array.shape}.")
        if np.issubdtype(array.dtype, np.number) and array.dtype != bool:
            scale_sense = array.reshape(()).item()
    if isinstance(scale_sense, numbers.Real) and not isinstance(scale_sense, bool):
        value = _check_loss_scale(scale_sense, "scale_sense", owner)
        return value, FixedLossScaleUpdateCell(value), value
    raise TypeError(
        f"For '{owner}', the 'scale_sense' must be a DynamicLossScaleUpdateCell, "
        f"FixedLossScaleUpdateCell, DynamicLossScaleManager, FixedLossScaleManager, a number or a "
        f"scalar tensor, but got type '{type_name(scale_sense)}'."
    )


def _unscale(grad, inv_scale):
    """``grad * (1/scale)``, in float32 for float16 gradients (``1/scale`` would underflow)."""
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    wide = tf.float64 if values.dtype == tf.float64 else tf.float32
    values = tf.cast(tf.cast(values, wide) * tf.cast(inv_scale, wide), values.dtype)
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return values


@register
class LossScaleOptimizer(BuildsOnceEveryReplicaIsReady, AcceptsEmptyGradients,
                         compat.LossScaleOptimizer):
    """Loss scaling with MindSpore's cells and managers, on Keras' ``LossScaleOptimizer``.

    Each step (``fit`` scales the loss with :meth:`scale_loss`; a custom loop
    does it itself), with ``g`` the gradients of ``loss * scale``::

        overflow = any non-finite value in g, on any replica
        if overflow: skip the update of the inner optimizer
        else:        inner_optimizer.apply(g * (1/scale))
        scale = update_cell(scale, overflow)   # unchanged for a fixed scale

    As in MindSpore's ``TrainOneStepWithLossScaleCell``, a step that overflows is
    skipped for every kind of ``scale_sense``, fixed ones included, except
    ``FixedLossScaleManager(drop_overflow_update=False)``, which never checks
    and never skips.

    Differences from ``keras.optimizers.LossScaleOptimizer``: the overflow
    verdict is all-reduced, so an inf on any replica skips the step on every
    replica (Keras checks replica 0 only); the scale stays in
    ``[1, float32 max]`` (Keras' reaches 0, then writes NaN into the weights,
    or grows to inf); the scale follows MindSpore's rule; and the state below
    records skipped steps.

    State (variables, created in ``build``, saved by ``.keras`` and
    ``tf.train.Checkpoint``): ``dynamic_scale`` (the current scale),
    ``step_counter`` (clean steps since the window last restarted),
    ``last_step_skipped`` (1 if the last step was skipped, else 0) and
    ``skipped_steps`` (skipped steps so far). :class:`LossScaleMonitor` puts
    them into ``fit`` logs. ``iterations`` counts applied steps only.

    Custom loops: ``scale_loss(loss)`` and then ``apply(scaled_grads)`` (Keras
    3), or tf-keras' ``get_scaled_loss(loss)``, ``get_unscaled_gradients(grads)``
    and then ``apply_gradients`` (the next ``apply`` after
    ``get_unscaled_gradients`` takes its gradients as already unscaled).

    Two ways to create it, MindSpore's and Keras'::

        LossScaleOptimizer(inner, scale_sense)          # MindSpore's form
        LossScaleOptimizer(inner)                       # Keras' form and defaults:
        LossScaleOptimizer(inner, initial_scale=2**15, dynamic_growth_steps=2000)

    Keras' form means ``DynamicLossScaleUpdateCell(initial_scale, 2,
    dynamic_growth_steps)``: Keras' rule, with the bounds above. Giving
    ``scale_sense`` together with ``initial_scale`` or ``dynamic_growth_steps``
    is a ``ValueError``. A number as the second positional argument is
    MindSpore's ``scale_sense`` (a fixed scale), not Keras' ``initial_scale``.

    The config has Keras' keys (``initial_scale``, ``dynamic_growth_steps``),
    and ``scale_sense`` where Keras' class has no equivalent (a fixed scale, a
    manager, a factor other than 2): such a config loads into this class only,
    and Keras' class refuses it naming ``scale_sense``. A config written with
    Keras' class loads into this one; a model loaded from a ``.keras`` file
    written with Keras' class has Keras' class (the file names it):
    :meth:`from_keras` turns it into this one, state included.

    Args:
        inner_optimizer: the ``keras.optimizers.Optimizer`` that applies the
            unscaled gradients.
        scale_sense: a :class:`DynamicLossScaleUpdateCell`,
            :class:`FixedLossScaleUpdateCell`, :class:`DynamicLossScaleManager`,
            :class:`FixedLossScaleManager`, or a number / scalar tensor >= 1 (a
            fixed scale whose overflowing steps are skipped).
        name: the optimizer's name.
        initial_scale: Keras' form: the initial dynamic scale, a number >= 1
            (default ``2**15`` when ``scale_sense`` is not given).
        dynamic_growth_steps: Keras' form: clean steps before the scale
            doubles, an int >= 1 (default 2000).

    Reference:
        MindSpore ``mindspore.nn.TrainOneStepWithLossScaleCell``;
        Micikevicius et al., Mixed Precision Training, ICLR 2018
        (arXiv:1710.03740).
    """

    def __init__(self, inner_optimizer, scale_sense=None, name=None, initial_scale=None,
                 dynamic_growth_steps=None, **kwargs):
        owner = type(self).__name__
        keras_form = {key: value for key, value in (("initial_scale", initial_scale),
                                                    ("dynamic_growth_steps",
                                                     dynamic_growth_steps))
                      if value is not None}
        if scale_sense is not None and keras_form:
            raise ValueError(
                f"For '{owner}', give either MindSpore's 'scale_sense' or Keras' "
                f"'initial_scale' / 'dynamic_growth_steps', not both, but got "
                f"scale_sense={scale_sense!r} and {keras_form}."
            )
        if scale_sense is None:   # Keras' form: its dynamic rule (factor 2) and defaults
            scale_sense = DynamicLossScaleUpdateCell(
                _check_loss_scale(2.0**15 if initial_scale is None else initial_scale,
                                  "initial_scale", owner),
                2,
                check_int(2000 if dynamic_growth_steps is None else dynamic_growth_steps,
                          "dynamic_growth_steps", owner, min_value=1))
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"For '{owner}', the 'inner_optimizer' must be a "
                            f"keras.optimizers.Optimizer, but got type "
                            f"'{type_name(inner_optimizer)}'.")
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(f"For '{owner}', the 'inner_optimizer' must not be a "
                             f"LossScaleOptimizer (the loss would be scaled twice), but got "
                             f"'{type_name(inner_optimizer)}'.")
        scale_sense, update_cell, initial_scale = _resolve_scale_sense(scale_sense, owner)
        growth_steps = getattr(update_cell, "scale_window", None)
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=growth_steps, name=name, **kwargs)
        self.scale_sense = scale_sense
        self._update_cell = update_cell
        self._unscale_in_apply = True
        self._user_unscaled_gradients = False
        # An inner optimizer that needs the scale (THOR: in its curvature statistics).
        link = getattr(inner_optimizer, "link_loss_scale_optimizer", None)
        if link is not None:
            link(self)

    def set_weights(self, weights):
        """Sets every value of :attr:`variables`: its own and the inner optimizer's."""
        set_all_weights(self, weights)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Excludes variables from the inner optimizer's weight decay (it has the decay)."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)   # step_counter, dynamic_scale, the inner optimizer
        if getattr(self, "_initial_step_counter", None):   # from_keras: the window position
            with tf.init_scope():   # once, now (build may run while a train step is traced)
                self.step_counter.assign(self._initial_step_counter)
        self.last_step_skipped = self.add_variable((), initializer="zeros", dtype="int",
                                                   name="last_step_skipped")
        self.skipped_steps = self.add_variable((), initializer="zeros", dtype="int",
                                               name="skipped_steps")

    @property
    def loss_scale(self):
        """The current loss scale, as a float32 tensor."""
        return tf.convert_to_tensor(self.dynamic_scale if self.built else self.initial_scale,
                                    tf.float32)

    # --- the step

    def apply(self, grads, trainable_variables=None):
        if not len(grads):   # nothing to check or apply: no step, as in Keras' optimizers
            return
        # tf-keras' contract: gradients from get_unscaled_gradients are not unscaled again.
        self._unscale_in_apply = not self._user_unscaled_gradients
        self._user_unscaled_gradients = False
        if self._update_cell is not None:
            return super().apply(grads, trainable_variables)
        # FixedLossScaleManager(drop_overflow_update=False): never checks, never skips.
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        self.apply_finite(grads, trainable_variables)

    def check_finite(self, grads):
        """True when every gradient of every replica is finite (called in replica context)."""
        # Keras checks each replica's local gradients and follows replica 0;
        # the verdict must be the same everywhere (MindSpore all-reduces it).
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return super().check_finite(grads)
        overflows = ctx.all_reduce(tf.distribute.ReduceOp.SUM, self._local_overflow(grads))
        return tf.equal(overflows, 0.0)

    def _local_overflow(self, grads):
        """1.0 when one of this replica's gradients is not finite, else 0.0."""
        return tf.cast(tf.logical_not(super().check_finite(grads)), tf.float32)

    def apply_in_context(self, grads, trainable_variables=None):
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        if compat.strategy_supports_no_merge_call():
            # Every replica takes the branch itself: check_finite all-reduces the verdict.
            return self.apply_checked(grads, trainable_variables)
        # Keras' merge-call path, with the verdicts of all replicas combined
        # instead of replica 0's taken.
        return tf.distribute.get_replica_context().merge_call(
            self._cross_replica_apply, args=(grads, trainable_variables))

    def _cross_replica_apply(self, distribution, grads, trainable_variables):
        overflows = distribution.extended.call_for_each_replica(self._local_overflow,
                                                                args=(grads,))
        local = distribution.experimental_local_results(overflows)
        if len(local) == distribution.num_replicas_in_sync:
            total = tf.add_n(list(local))     # all replicas in this process: no collective
        else:
            total = distribution.reduce(tf.distribute.ReduceOp.SUM, overflows, axis=None)
        finite = tf.equal(total, 0.0)

        def apply_on_every_replica():
            distribution.extended.call_for_each_replica(
                self.apply_finite, args=(grads, trainable_variables))

        # In cross-replica context: a cond in replica context cannot reach merge_call.
        tf.cond(finite, apply_on_every_replica, self.skip_non_finite)

    def apply_finite(self, grads, trainable_variables):
        if self._unscale_in_apply:
            tvs = trainable_variables or compat.trainable_variables(self)
            inv_scale = tf.math.reciprocal(tf.convert_to_tensor(self.dynamic_scale))
            grads = [g if g is None or compat.overwrites_with_gradient(self, v)
                     else _unscale(g, inv_scale) for g, v in zip(grads, tvs)]
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)
        self._record_step(overflow=False)

    def skip_non_finite(self):
        self._record_step(overflow=True)

    def _record_step(self, overflow):
        if self._update_cell is None:
            return
        counter = tf.convert_to_tensor(self.step_counter)
        scale, restart = self._update_cell._next_state(
            tf.convert_to_tensor(self.dynamic_scale), overflow, counter)
        self.dynamic_scale.assign(scale)
        self.step_counter.assign(_select(restart, tf.zeros_like(counter), counter + 1))
        self.last_step_skipped.assign(int(overflow))
        if overflow:
            self.skipped_steps.assign_add(1)

    # --- tf-keras custom-loop API

    def get_scaled_loss(self, loss):
        """``loss * scale`` (tf-keras' name for :meth:`scale_loss`); ``loss`` may be a callable."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """``grads * (1/scale)``; the next :meth:`apply` then takes its gradients as unscaled."""
        inv_scale = tf.math.reciprocal(self.loss_scale)
        self._user_unscaled_gradients = True
        return [None if g is None else _unscale(g, inv_scale) for g in grads]

    # --- serialization

    @classmethod
    def from_keras(cls, optimizer):
        """This class in place of a ``keras.optimizers.LossScaleOptimizer``, with its state.

        For a model saved with Keras' class (``keras.models.load_model`` gives Keras'
        class back: the file names it)::

            model = keras.models.load_model("model.keras")
            model.compile(optimizer=mso.LossScaleOptimizer.from_keras(model.optimizer),
                          loss=...)

        The inner optimizer (and its state) is reused; the scale, its window counter and
        the step count are copied.
        """
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise TypeError(f"For '{cls.__name__}', from_keras() takes a "
                            f"keras.optimizers.LossScaleOptimizer, but got type "
                            f"'{type_name(optimizer)}'.")
        if isinstance(optimizer, cls):
            return optimizer
        scale = optimizer.initial_scale
        if optimizer.built:   # continue from the current scale and window position
            scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
        ours = cls(optimizer.inner_optimizer, initial_scale=scale,
                   dynamic_growth_steps=optimizer.dynamic_growth_steps, name=optimizer.name)
        if optimizer.built:
            ours._initial_step_counter = int(keras.ops.convert_to_numpy(optimizer.step_counter))
        return ours

    def _keras_equivalent(self):
        """True when Keras' class has the same rule: a dynamic cell with factor 2."""
        sense = self.scale_sense
        return type(sense) is DynamicLossScaleUpdateCell and sense.scale_factor == 2

    def get_config(self):
        # Keras' keys, so that Keras' class loads the config where it means the same;
        # scale_sense where it does not (Keras' class then refuses it, naming it).
        config = super().get_config()
        if not self._keras_equivalent():
            scale_sense = self.scale_sense
            if not isinstance(scale_sense, float):
                scale_sense = keras.saving.serialize_keras_object(scale_sense)
            config["scale_sense"] = scale_sense
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Loads this class's config (either form) or one written by Keras' class."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        scale_sense = config.pop("scale_sense", None)
        if scale_sense is None:
            return cls(inner, **config)           # Keras' form (also Keras' own configs)
        # initial_scale / dynamic_growth_steps were written beside it for Keras' class.
        config.pop("initial_scale", None)
        config.pop("dynamic_growth_steps", None)
        if isinstance(scale_sense, dict):
            scale_sense = keras.saving.deserialize_keras_object(scale_sense,
                                                                custom_objects=custom_objects)
        return cls(inner, scale_sense, **config)


# ------------------------------------------------------------------------ callback


class LossScaleMonitor(keras.callbacks.Callback):
    """Adds the loss-scale state of the model's :class:`LossScaleOptimizer` to ``fit`` logs.

    After every batch and epoch, ``logs`` gains ``loss_scale``,
    ``last_step_skipped`` and ``skipped_steps``, so the progress bar,
    ``History`` and ``keras.callbacks.TensorBoard`` (listed after this callback)
    show them.
    """

    def on_train_begin(self, logs=None):
        if not isinstance(self.model.optimizer, LossScaleOptimizer):
            raise ValueError(
                f"LossScaleMonitor needs a model compiled with tf_msopt.LossScaleOptimizer, but "
                f"the optimizer is '{type_name(self.model.optimizer)}'."
            )

    def on_train_batch_end(self, batch, logs=None):
        self._add_state(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._add_state(logs)

    def _add_state(self, logs):
        optimizer = self.model.optimizer
        if logs is None or not optimizer.built:
            return
        logs["loss_scale"] = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
        logs["last_step_skipped"] = int(keras.ops.convert_to_numpy(optimizer.last_step_skipped))
        logs["skipped_steps"] = int(keras.ops.convert_to_numpy(optimizer.skipped_steps))
