"""THOR: trace-based hardware-driven layer-oriented natural gradient (Chen et al. 2021)."""
import dataclasses
import weakref

import keras
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import register
from tf_msopt._validation import check_bool, check_float, check_int, check_number_range, type_name
from tf_msopt.optimizers.base import (MindSporeOptimizer, check_filter, make_variable_filter,
                                      resolve_learning_rate, serialize_filter)
from tf_msopt.thor import curvature_blocks
from tf_msopt.thor.capture import LayerStatistics, ReportRow, install, survey
from tf_msopt.thor.curvature_blocks import Preconditioning
from tf_msopt.thor.report import ThorReport

__all__ = ["THOR", "connect", "thor"]

_OWNER = "THOR"
_Schedule = keras.optimizers.schedules.LearningRateSchedule


def _check_split_indices(split_indices):
    if split_indices is None:
        return None
    if not isinstance(split_indices, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in split_indices):
        raise TypeError(
            f"For '{_OWNER}', the 'split_indices' must be None or a list of int, "
            f"but got {split_indices!r}."
        )
    if any(i < 0 for i in split_indices) or list(split_indices) != sorted(set(split_indices)):
        raise ValueError(
            f"For '{_OWNER}', the 'split_indices' must be increasing indices >= 0 of the "
            f"preconditioned layers, but got {list(split_indices)}."
        )
    return list(split_indices)


def _check_block_size(block_size):
    if block_size is None:
        return None
    return check_int(block_size, "block_size", _OWNER, min_value=1)


def _serialize_schedule(value, arg):
    if isinstance(value, float):
        return value
    if isinstance(value, _Schedule):
        return keras.saving.serialize_keras_object(value)
    raise ValueError(
        f"For '{_OWNER}', the '{arg}' is the Python callable {value!r}, which cannot be saved. "
        f"Pass a number, an array or a keras LearningRateSchedule."
    )


def _identity_blocks(shape, dtype=None):
    if len(shape) == 1:
        return tf.ones(shape, dtype)
    return tf.eye(shape[-1], batch_shape=[shape[0]], dtype=dtype)


def _buckets(count, split_indices):
    """Layer indices per all-reduce bucket: MindSpore's ``split_indices`` close buckets."""
    bounds = [i + 1 for i in (split_indices or []) if i + 1 < count] + [count]
    starts = [0] + bounds[:-1]
    return [list(range(start, end)) for start, end in zip(starts, bounds) if end > start]


class _Connection:
    """What :meth:`THOR.connect` sets up: the model, its treated layers, the capture buffers,
    the report rows."""

    def __init__(self, model, layers, statistics, batch, rows):
        self.model = weakref.ref(model)
        self.layers = layers
        self.statistics = statistics
        self.batch = batch
        self.rows = rows


def _block_from_config(config):
    if isinstance(config, curvature_blocks.CurvatureBlock):
        return config
    cls = curvature_blocks.REGISTRY[config["kind"]]
    fields = {field.name for field in dataclasses.fields(cls)}
    return curvature_blocks.from_config(
        {key: value for key, value in config.items() if key in fields or key == "kind"})


@register
class THOR(MindSporeOptimizer):
    """THOR, MindSpore's second-order optimizer, on Keras layers.

    Create it with :func:`tf_msopt.thor` (which finds the layers and connects
    the statistics capture). Each step ``t``, with ``lambda`` the damping and
    ``F`` the frequency::

        if t % F == 0:                       # THOR step: fresh statistics, new inverses
            A = E[x x^T],  G = E[delta delta^T]        per preconditioned layer
            A_inv = blockinv(A + sqrt(lambda) I),  G_inv = blockinv(G + sqrt(lambda) I)
        g = g / loss_scale
        g = A_inv g G_inv                    # Dense / Conv kernels (in, out)
        g = diag(a_inv) g G_inv              # Embedding tables
        g = g / (g*g/batch + sqrt(lambda))   # LayerNormalization gamma and beta
        g = g + weight_decay * w             # variables passing decay_filter
        g = g / max(|g|, 1)                  # with enable_clip_grad
        v = momentum * v + g;  w = w - lr * v   (Nesterov: w = w - lr * (g + momentum * v))

    ``x`` is a layer's input (patches for a convolution), ``delta`` the
    gradient of its pre-activation output times the global batch size and
    divided by the loss scale, ``E`` the mean over rows (batch and every other
    leading axis). ``blockinv`` inverts the diagonal blocks of size
    ``block_size`` (Cholesky based). Stale steps reuse the stored inverses and
    capture nothing. Statistics are summed over replicas before inversion.

    Args:
        learning_rate: a number, a 0-D/1-D tensor or array (entry i at step i),
            an iterable or a ``LearningRateSchedule``.
        damping: ``lambda``, in the same forms.
        momentum: float >= 0 (an int is rejected, as in MindSpore).
        weight_decay: float >= 0, added to the preconditioned gradient.
        loss_scale: float > 0 by which the incoming gradients are scaled (a
            surrounding ``LossScaleOptimizer``'s scale is undone on top of it).
        batch_size: the per-step global batch size for when it cannot be
            observed (the LayerNorm rule before the first step).
        use_nesterov: bool.
        decay_filter: variables that get weight decay: a callable
            ``f(keras.Variable) -> bool`` or a list of regular expressions of
            paths to exclude. Default: all variables (as MindSpore).
        split_indices: indices of preconditioned layers that close an
            all-reduce bucket (default: one bucket).
        enable_clip_grad: bool; clip each gradient to norm 1.
        frequency: int >= 2, steps between THOR steps.
        block_size: int or None (one block per factor); default 128.
        layers: the curvature blocks' configs (set by :func:`tf_msopt.thor`; kept in
            the config).
        jit_compile: run each variable's update as one XLA function.
        name, **kwargs: the usual ``keras.optimizers.Optimizer`` arguments.

    Reference:
        Chen, Mingcong et al. THOR, Trace-based Hardware-driven layer-ORiented
        Natural Gradient Descent Computation. AAAI 2021.
    """

    def __init__(self, learning_rate, damping, momentum, weight_decay=0.0, loss_scale=1.0,
                 batch_size=32, use_nesterov=False, decay_filter=None, split_indices=None,
                 enable_clip_grad=False, frequency=100, block_size=128, layers=None, name=None,
                 jit_compile=None, **kwargs):
        loss_scale = check_number_range(check_float(loss_scale, "loss_scale", _OWNER),
                                        "loss_scale", _OWNER, low=0.0, low_inclusive=False)
        weight_decay = check_number_range(check_float(weight_decay, "weight_decay", _OWNER),
                                          "weight_decay", _OWNER, low=0.0)
        momentum = check_number_range(check_float(momentum, "momentum", _OWNER, allow_int=False),
                                      "momentum", _OWNER, low=0.0)
        frequency = check_int(frequency, "frequency", _OWNER, min_value=2)
        use_nesterov = check_bool(use_nesterov, "use_nesterov", _OWNER)
        enable_clip_grad = check_bool(enable_clip_grad, "enable_clip_grad", _OWNER)
        batch_size = check_int(batch_size, "batch_size", _OWNER, min_value=1)
        split_indices = _check_split_indices(split_indices)
        block_size = _check_block_size(block_size)
        check_filter(decay_filter, "decay_filter", _OWNER)
        if kwargs.get("gradient_accumulation_steps"):
            raise ValueError(
                f"For '{_OWNER}', 'gradient_accumulation_steps' cannot apply: THOR captures "
                f"curvature statistics from the backward pass of each step, and an "
                f"accumulated update would mix statistics of one batch with gradients of "
                f"several. Got gradient_accumulation_steps="
                f"{kwargs['gradient_accumulation_steps']!r}; use a larger batch instead.")
        damping = resolve_learning_rate(damping, _OWNER, arg="damping")
        super().__init__(learning_rate, name=name, jit_compile=jit_compile,
                         weight_decay=weight_decay, **kwargs)
        self.damping = damping
        self.momentum = momentum
        self.loss_scale = loss_scale
        self.batch_size = batch_size
        self.use_nesterov = use_nesterov
        self.decay_filter = decay_filter
        self._decay_filter = make_variable_filter(decay_filter, (), "decay_filter", _OWNER)
        self.split_indices = split_indices
        self.enable_clip_grad = enable_clip_grad
        self.frequency = frequency
        self.block_size = block_size
        self._blocks = None if layers is None else tuple(map(_block_from_config, layers))
        self._connection = None
        self._rules = None
        self._thor_initialised = True

    # --- layers and connection

    @property
    def _factored_blocks(self):
        return [block for block in self._blocks if block.has_factors]

    # --- the loss scale of a wrapping LossScaleOptimizer

    def __setattr__(self, name, value):
        # keras.optimizers.LossScaleOptimizer sets its inner optimizer's loss_scale_factor
        # to None when it wraps it (_keras_compat checks that it still does): from then on
        # the gradients THOR gets are unscaled, but G still carries the squared scale.
        if name == "loss_scale_factor" and value is None and self.__dict__.get(
                "_thor_initialised"):
            self.__dict__["_thor_wrapped"] = True
        super().__setattr__(name, value)

    def link_loss_scale_optimizer(self, optimizer):
        """Tells THOR which ``keras.optimizers.LossScaleOptimizer`` (``tf_msopt``'s
        included) applies it, so that ``G`` is divided by the square of its scale.

        ``tf_msopt.LossScaleOptimizer`` calls it itself, and a wrapper that is
        ``model.optimizer`` (or wraps it) is found without it; call it for Keras'
        class in a custom loop whose model is not compiled with the wrapper.
        """
        if not (isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
                and optimizer.inner_optimizer is self):
            raise ValueError(
                f"For '{_OWNER}', link_loss_scale_optimizer needs the LossScaleOptimizer whose "
                f"inner_optimizer is this THOR, but got '{type_name(optimizer)}'.")
        self._set_wrapper(optimizer)

    def _set_wrapper(self, optimizer):
        # A weak reference outside Keras' attribute tracking: the wrapper already tracks
        # THOR, and a reference back would make the two each other's dependency.
        self.__dict__["_thor_wrapper"] = weakref.ref(optimizer)
        self.__dict__["_thor_wrapped"] = True

    def _wrapping_loss_scale_optimizer(self):
        """The LossScaleOptimizer that applies this THOR, None if there is none; raises when
        THOR is wrapped by one it cannot find (G would keep the squared loss scale)."""
        linked = self.__dict__.get("_thor_wrapper")
        if linked is not None or not self.__dict__.get("_thor_wrapped"):
            return linked and linked()
        model = self._connection.model()
        outer = getattr(model, "optimizer", None)
        while outer is not None and outer is not self:
            if (isinstance(outer, keras.optimizers.LossScaleOptimizer)
                    and outer.inner_optimizer is self):
                self._set_wrapper(outer)
                return outer
            outer = getattr(outer, "inner_optimizer", None)
        raise RuntimeError(
            f"This {_OWNER} optimizer is wrapped in a keras.optimizers.LossScaleOptimizer that "
            f"it cannot find, so it cannot undo the loss scale in its curvature statistics. "
            f"Compile the model with the wrapper (model.compile(optimizer=wrapper)), use "
            f"tf_msopt.LossScaleOptimizer, or call thor_optimizer.link_loss_scale_optimizer("
            f"wrapper) before training.")

    def connect(self, model):
        """Connects THOR to ``model``: patches its layers to capture statistics.

        :func:`tf_msopt.thor` calls it. Call it yourself after
        ``keras.models.load_model`` (or use :func:`tf_msopt.thor.connect`),
        under the distribution strategy's scope if there is one. The model must
        have the layers THOR was created for (same names, kinds and shapes).

        Returns:
            this optimizer.
        """
        blocks, layers, rows = survey(model, self.block_size)
        if self._blocks is None:
            if self.built:
                raise ValueError(f"For '{_OWNER}', the optimizer was built without layer specs; "
                                 f"create it with tf_msopt.thor(model, ...) instead.")
            self._blocks = tuple(blocks)
        elif list(blocks) != list(self._blocks):
            raise ValueError(
                f"For '{_OWNER}', the model's layers do not match the layers this optimizer was "
                f"created for.\n  optimizer: {[b.get_config() for b in self._blocks]}\n"
                f"  model:     {[b.get_config() for b in blocks]}"
            )
        with compat.distribution_strategy(self).scope():
            statistics = [LayerStatistics(block, self.block_size) for block in blocks
                          if block.has_factors]
            batch = keras.Variable(float(self.batch_size), dtype="float32", trainable=False,
                                   name="global_batch")
        buffers = iter(statistics)
        for block, layer in zip(blocks, layers):
            install(layer, block, next(buffers) if block.has_factors else None, batch,
                    self._is_thor_step, self.block_size)
        self._connection = _Connection(model, layers, statistics, batch, rows)
        self._rules = None
        if getattr(model, "train_function", None) is not None:
            model.train_function = None    # traced without the capture: trace again
        return self

    def report(self):
        """A :class:`tf_msopt.thor.ThorReport`: every trainable variable's rule and why."""
        from tf_msopt.ops.inverse import inverse_backend

        if self._connection is not None:
            rows = self._connection.rows
        else:
            rows = [ReportRow(block.layer, block.kind, f"{block.layer}/{name}",
                              block.describe(self.block_size), "")
                    for block in self._blocks or () for name in block.variables]
        return ThorReport(tuple(rows), self.frequency, self.block_size, inverse_backend(),
                          self._connection is not None)

    # --- state

    def build(self, var_list):
        if self.built:
            return
        if self._blocks is None:
            raise ValueError(f"For '{_OWNER}', the optimizer has no layers; create it with "
                             f"tf_msopt.thor(model, ...) or call connect(model) first.")
        super().build(var_list)
        self.momentums = [self.add_variable_from_reference(v, "momentum") for v in var_list]
        self.a_inverses, self.g_inverses = [], []
        for block in self._factored_blocks:
            a_shape, g_shape = block.factor_shapes(self.block_size)
            self.a_inverses.append(self.add_variable(a_shape, initializer=_identity_blocks,
                                                     name=f"{block.layer}_a_inverse"))
            self.g_inverses.append(self.add_variable(g_shape, initializer=_identity_blocks,
                                                     name=f"{block.layer}_g_inverse"))
        self.damping_retries = self.add_variable((), initializer="zeros", dtype="int64",
                                                 name="damping_retries")
        self.failed_inverses = self.add_variable((), initializer="zeros", dtype="int64",
                                                 name="failed_inverses")
        self._decay_flags = [self.weight_decay > 0 and bool(self._decay_filter(v))
                             and not self.excluded_from_weight_decay(v) for v in var_list]

    # --- the step

    def _is_thor_step(self):
        return tf.equal(tf.math.floormod(tf.convert_to_tensor(self.iterations), self.frequency),
                        0)

    def _damping(self):
        if isinstance(self.damping, float):
            value = self.damping
        elif isinstance(self.damping, _Schedule):
            value = self.damping(self.iterations)
        else:
            value = self.damping()
        return tf.cast(value, tf.float32)

    def apply(self, grads, trainable_variables=None):
        if self._connection is None:
            raise RuntimeError(
                f"This {_OWNER} optimizer is not connected to a model, so it has no curvature "
                f"statistics and would silently act as momentum SGD. Create it with "
                f"tf_msopt.thor(model, ...), or after keras.models.load_model call "
                f"tf_msopt.thor.connect(model)."
            )
        self._wrapping_loss_scale_optimizer()
        # Embedding gradients arrive as IndexedSlices; the preconditioned update is dense.
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        return super().apply(grads, trainable_variables)

    def decay_weights(self, variables):
        """No decoupled decay: THOR adds ``weight_decay * w`` after preconditioning."""

    def _variable_rules(self):
        """Per variable index: ``(block, index among factored blocks)``, or None.

        Matched by object (update_step only sees tf.Variables, and paths change
        when a model is loaded)."""
        rules = [None] * len(compat.trainable_variables(self))
        factored = 0
        for block, layer in zip(self._blocks, self._connection.layers):
            for variable in block.treated_variables(layer):
                index = compat.tracked_index(self, variable)
                if index is not None:
                    rules[index] = (block, factored if block.has_factors else None)
            factored += block.has_factors
        return rules

    def update_variables(self, grads, trainable_variables, learning_rate):
        if self._rules is None:
            self._rules = self._variable_rules()
        # This replica's statistics, read in replica context; summed in _refresh_inverses.
        local = [(tf.convert_to_tensor(s.a), tf.convert_to_tensor(s.g),
                  tf.convert_to_tensor(s.rows)) for s in self._connection.statistics]
        compat.merge_call(self._refresh_inverses, compat.distribution_strategy(self), local)
        super().update_variables(grads, trainable_variables, learning_rate)

    def _loss_scale(self):
        """Every scale on the loss: ``loss_scale``, Keras' ``loss_scale_factor`` and the scale
        of the LossScaleOptimizer applying this one, if any."""
        scale = tf.constant(self.loss_scale * (self.loss_scale_factor or 1.0), tf.float32)
        outer = self._wrapping_loss_scale_optimizer()
        if outer is not None:
            scale *= tf.cast(tf.convert_to_tensor(outer.dynamic_scale), tf.float32)
        return scale

    def _refresh_inverses(self, distribution, local):
        """On THOR steps: sums the statistics over replicas (one all-reduce per bucket) and
        recomputes every layer's inverses (in cross-replica context)."""
        if not local:
            return
        damping = tf.sqrt(self._damping())
        g_scale = tf.math.reciprocal(tf.square(self._loss_scale()))

        def refresh():
            for bucket in _buckets(len(local), self.split_indices):
                reduced = _sum_over_replicas(
                    distribution, [value for index in bucket for value in local[index]],
                    self.a_inverses[bucket[0]])
                for offset, index in enumerate(bucket):
                    a, g, rows = reduced[3 * offset:3 * offset + 3]
                    _on_each_device(distribution, self.a_inverses[index], self._refresh_layer,
                                    (index, a, g, rows, damping, g_scale))
            return tf.constant(True)

        tf.cond(self._is_thor_step(), refresh, lambda: tf.constant(False))

    def _refresh_layer(self, _, index, a, g, rows, damping, g_scale):
        """New inverses of one layer on one device, from statistics summed over replicas."""
        block = self._factored_blocks[index]
        a_inverse, g_inverse = self.a_inverses[index], self.g_inverses[index]
        a_previous, g_previous = tf.convert_to_tensor(a_inverse), tf.convert_to_tensor(g_inverse)
        observed = rows > 0
        rows = tf.maximum(rows, 1.0)
        (a_new, g_new), retried, kept = block.invert(
            a / rows, g / rows * g_scale, damping, (a_previous, g_previous), self.block_size)
        self.assign(a_inverse, tf.where(observed, a_new, a_previous))
        self.assign(g_inverse, tf.where(observed, g_new, g_previous))
        zero = tf.zeros((), tf.int64)
        self.assign_add(self.damping_retries, tf.where(observed, retried, zero))
        self.assign_add(self.failed_inverses, tf.where(observed, kept, zero))

    def _update(self, gradient, variable, learning_rate):
        index = compat.variable_index(self, variable)
        gradient = tf.cast(gradient, tf.float32)
        if self.loss_scale != 1.0:
            gradient = gradient / self.loss_scale
        if self._rules[index] is not None:
            gradient = self._precondition(gradient, *self._rules[index])
        gradient = tf.cast(gradient, variable.dtype)
        if self._decay_flags[index]:
            gradient += tf.cast(self.weight_decay, variable.dtype) * variable
        if self.enable_clip_grad:
            gradient = tf.clip_by_norm(gradient, 1.0)
        momentum = self.momentums[index]
        tf.raw_ops.ResourceApplyMomentum(
            var=_handle(variable), accum=_handle(momentum),
            lr=tf.cast(learning_rate, variable.dtype), grad=gradient,
            momentum=tf.cast(self.momentum, variable.dtype), use_nesterov=self.use_nesterov)

    def _precondition(self, gradient, block, index):
        if block.has_factors:
            state = Preconditioning(a_inverse=tf.convert_to_tensor(self.a_inverses[index]),
                                    g_inverse=tf.convert_to_tensor(self.g_inverses[index]))
        else:
            state = Preconditioning(batch=tf.convert_to_tensor(self._connection.batch),
                                    damping=self._damping())
        return block.precondition(gradient, state, self.block_size)

    # --- serialization

    def get_config(self):
        config = super().get_config()
        config.update({
            "damping": _serialize_schedule(self.damping, "damping"),
            "momentum": self.momentum,
            "loss_scale": self.loss_scale,
            "batch_size": self.batch_size,
            "use_nesterov": self.use_nesterov,
            "decay_filter": serialize_filter(self.decay_filter, "decay_filter", _OWNER),
            "split_indices": self.split_indices,
            "enable_clip_grad": self.enable_clip_grad,
            "frequency": self.frequency,
            "block_size": self.block_size,
            "layers": None if self._blocks is None else [b.get_config() for b in self._blocks],
        })
        return config


def _sum_over_replicas(distribution, values, destination):
    """All-reduces ``values`` as one batch, onto the devices of the mirrored variable
    ``destination``; unchanged without a strategy."""
    if not tf.distribute.in_cross_replica_context():
        return values
    return distribution.extended.batch_reduce_to(
        tf.distribute.ReduceOp.SUM, [(value, destination.value) for value in values])


def _on_each_device(distribution, variable, fn, args):
    """``fn(variable_component, *args)`` on each device of a (mirrored) optimizer variable."""
    if not tf.distribute.in_cross_replica_context():
        return fn(variable.value, *args)
    return distribution.extended.update(variable.value, fn, args=args, group=False)


def _handle(variable):
    return (variable.value if isinstance(variable, keras.Variable) else variable).handle


def thor(model, learning_rate, damping, momentum, weight_decay=0.0, loss_scale=1.0,
         batch_size=32, use_nesterov=False, decay_filter=None, split_indices=None,
         enable_clip_grad=False, frequency=100, block_size=128, **kwargs):
    """Creates a :class:`THOR` optimizer for ``model`` and connects it to the model's layers.

    Dense, Conv1D/Conv2D and Embedding kernels get Kronecker-factored
    preconditioning, LayerNormalization gamma/beta the LayerNorm rule, every
    other variable its plain gradient; ``optimizer.report()`` lists which and
    why. Call it under the distribution strategy's scope, if any, and pass the
    result to ``model.compile``. Arguments: as :class:`THOR` (MindSpore's
    ``nn.thor`` names and defaults, plus ``block_size``).
    """
    optimizer = THOR(learning_rate, damping, momentum, weight_decay=weight_decay,
                     loss_scale=loss_scale, batch_size=batch_size, use_nesterov=use_nesterov,
                     decay_filter=decay_filter, split_indices=split_indices,
                     enable_clip_grad=enable_clip_grad, frequency=frequency,
                     block_size=block_size, **kwargs)
    return optimizer.connect(model)


def connect(model):
    """Connects the THOR optimizer of a compiled ``model`` (e.g. after ``load_model``).

    Finds THOR in ``model.optimizer``, inside any ``LossScaleOptimizer``, and
    calls :meth:`THOR.connect`. Returns the THOR optimizer.
    """
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None and not isinstance(optimizer, THOR):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    if optimizer is None:
        raise ValueError(
            f"For '{_OWNER}', the model has no THOR optimizer to connect (its optimizer is "
            f"'{type_name(getattr(model, 'optimizer', None))}'); compile it with one first."
        )
    return optimizer.connect(model)


thor.connect = connect
