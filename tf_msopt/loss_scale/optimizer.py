"""``LossScaleOptimizer``: Keras' loss-scale wrapper driven by MindSpore's cells and managers."""
import keras
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import entry_point, register
from tf_msopt._validation import type_name
from tf_msopt.loss_scale.scale_sense import (add_scale_sense, constructor_arguments,
                                             keras_scale_state, resolve_scale_sense,
                                             scale_sense_of)
from tf_msopt.loss_scale.update_cells import select
from tf_msopt.optimizers.base import (AcceptsEmptyGradients, BuildsOnceEveryReplicaIsReady,
                                      WrapperOfOptimizer)

__all__ = ["LossScaleOptimizer"]


def _unscale(grad, inv_scale):
    """``grad * (1/scale)``, in float32 for float16 gradients (``1/scale`` would underflow)."""
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    wide = tf.float64 if values.dtype == tf.float64 else tf.float32
    values = tf.cast(tf.cast(values, wide) * tf.cast(inv_scale, wide), values.dtype)
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return values


def _sum_over_replicas(distribution, per_replica):
    """The sum of a per-replica scalar, called in cross-replica context."""
    local = distribution.experimental_local_results(per_replica)
    if len(local) == distribution.num_replicas_in_sync:
        return tf.add_n(list(local))     # all replicas in this process: no collective
    return distribution.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)


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

    Unlike ``keras.optimizers.LossScaleOptimizer``: the overflow verdict is
    all-reduced (an inf on any replica skips the step on every replica; Keras
    follows replica 0), the scale stays in ``[1, float32 max]`` (Keras' reaches
    0 or inf), it follows MindSpore's rule, and the state records skips.

    State (variables created in ``build``, saved by ``.keras`` and
    ``tf.train.Checkpoint``): ``dynamic_scale`` (the current scale),
    ``step_counter`` (clean steps since the window last restarted),
    ``last_step_skipped`` (1 or 0) and ``skipped_steps`` (so far), which
    :class:`LossScaleMonitor` logs. ``iterations`` counts applied steps only.

    Custom loops: ``scale_loss(loss)`` and then ``apply(scaled_grads)`` (Keras
    3), or tf-keras' ``get_scaled_loss(loss)``, ``get_unscaled_gradients(grads)``
    and then ``apply_gradients`` (the next ``apply`` after
    ``get_unscaled_gradients`` takes its gradients as already unscaled).

    Two ways to create it, MindSpore's and Keras'::

        LossScaleOptimizer(inner, scale_sense)          # MindSpore's form
        LossScaleOptimizer(inner)                       # Keras' form and defaults:
        LossScaleOptimizer(inner, initial_scale=2**15, dynamic_growth_steps=2000)

    Keras' form means ``DynamicLossScaleUpdateCell(initial_scale, 2,
    dynamic_growth_steps)``, with the bounds above; both forms at once are a
    ``ValueError``. A number as the second positional argument is MindSpore's
    ``scale_sense`` (a fixed scale), not Keras' ``initial_scale``.

    The config has Keras' keys, plus ``scale_sense`` where Keras' class has no
    equivalent (then only this class loads it); Keras' configs load into this
    class, and :meth:`from_keras` converts Keras' optimizer, state included
    (docs/loss_scaling.md, "A drop-in for Keras' class").

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
        scale_sense = scale_sense_of(scale_sense, initial_scale, dynamic_growth_steps, owner)
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"For '{owner}', the 'inner_optimizer' must be a "
                            f"keras.optimizers.Optimizer, but got type "
                            f"'{type_name(inner_optimizer)}'.")
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(f"For '{owner}', the 'inner_optimizer' must not be a "
                             f"LossScaleOptimizer (the loss would be scaled twice), but got "
                             f"'{type_name(inner_optimizer)}'.")
        scale_sense, update_cell, initial_scale = resolve_scale_sense(scale_sense, owner)
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
        finite = tf.equal(_sum_over_replicas(distribution, overflows), 0.0)

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
        scale, step_counter = keras_scale_state(optimizer)
        ours = cls(optimizer.inner_optimizer, initial_scale=scale,
                   dynamic_growth_steps=optimizer.dynamic_growth_steps, name=optimizer.name)
        if step_counter is not None:   # continue from Keras' window position
            ours._initial_step_counter = step_counter
        return ours

    def get_config(self):
        return add_scale_sense(super().get_config(), self.scale_sense)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Loads this class's config (either form) or one written by Keras' class."""
        args, kwargs = constructor_arguments(config, custom_objects)
        return cls(*args, **kwargs)
