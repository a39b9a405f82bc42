"""``LossScaleOptimizer``: Keras' loss-scale wrapper driven by MindSpore's cells and managers."""
import numbers

import keras
import numpy as np
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import entry_point, register
from tf_msopt._validation import check_int, type_name
from tf_msopt.loss_scale.managers import DynamicLossScaleManager, FixedLossScaleManager
from tf_msopt.loss_scale.update_cells import (DynamicLossScaleUpdateCell,
                                              FixedLossScaleUpdateCell, LossScaleUpdateCell,
                                              check_loss_scale, select)
from tf_msopt.optimizers.base import (AcceptsEmptyGradients, BuildsOnceEveryReplicaIsReady,
                                      WrapperOfOptimizer)

__all__ = ["LossScaleOptimizer"]


_Managers = (DynamicLossScaleManager, FixedLossScaleManager)
_Scalars = (tf.Tensor, tf.Variable, keras.Variable, np.ndarray, np.generic)


def _resolve_scale_sense(scale_sense, owner):
    """``(scale_sense to keep, update cell or None, initial scale)`` of a scale_sense."""
    if isinstance(scale_sense, LossScaleUpdateCell):
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
        value = check_loss_scale(scale_sense, "scale_sense", owner)
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
class LossScaleOptimizer(WrapperOfOptimizer, BuildsOnceEveryReplicaIsReady,
                         AcceptsEmptyGradients, compat.LossScaleOptimizer):
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
                check_loss_scale(2.0**15 if initial_scale is None else initial_scale,
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

    @entry_point
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
        self.step_counter.assign(select(restart, tf.zeros_like(counter), counter + 1))
        self.last_step_skipped.assign(int(overflow))
        if overflow:
            self.skipped_steps.assign_add(1)

    # --- tf-keras custom-loop API

    @entry_point
    def get_scaled_loss(self, loss):
        """``loss * scale`` (tf-keras' name for :meth:`scale_loss`); ``loss`` may be a callable."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    @entry_point
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

