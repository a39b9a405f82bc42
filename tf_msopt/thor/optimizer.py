"""THOR: trace-based hardware-driven layer-oriented natural gradient (Chen et al. 2021)."""
import sys

import keras
import tensorflow as tf

from tf_msopt._common import register
from tf_msopt._validation import check_bool, check_float, check_int, check_number_range, type_name
from tf_msopt.optimizers.base import (MindSporeOptimizer, check_filter, make_variable_filter,
                                      resolve_learning_rate, serialize_filter)
from tf_msopt.thor import blocks
from tf_msopt.thor.capture import (EMBEDDING, LAYER_NORM, LayerSpec, LayerStatistics, ReportRow,
                                   describe, install, survey, treated_variables)
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
    """What :meth:`THOR.connect` sets up: the layers, the capture buffers, the report rows."""

    def __init__(self, layers, statistics, batch, rows):
        self.layers = layers
        self.statistics = statistics
        self.batch = batch
        self.rows = rows


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
        layers: the layer specs (set by :func:`tf_msopt.thor`; kept in the config).
        jit_compile: run each variable's update as one XLA function.
        name, **kwargs: the usual ``keras.optimizers.Optimizer`` arguments.

    Reference:
        Chen, Mingcong et al. THOR, Trace-based Hardware-driven layer-ORiented
        Natural Gradient Descent Computation. AAAI 2021.
    """

    def __init__(self, learning_rate, damping, momentum, weight_decay=0.0, loss_scale=1.0,
                 batch_size=32, use_nesterov=False, decay_filter=None, split_indices=None,
                 enable_clip_grad=False, frequency=100, block_size=128, layers=None, name="thor",
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
        for arg in ("use_ema", "gradient_accumulation_steps"):
            if kwargs.get(arg):
                raise ValueError(f"For '{_OWNER}', '{arg}' is not supported, but got "
                                 f"{arg}={kwargs[arg]!r}.")
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
        self._specs = None if layers is None else tuple(
            s if isinstance(s, LayerSpec) else LayerSpec.from_config(s) for s in layers)
        self._connection = None
        self._rules = None
        self._loss_scale_optimizer = None

    # --- layers and connection

    @property
    def _second_order_specs(self):
        return [spec for spec in self._specs if spec.second_order]

    def connect(self, model):
        """Connects THOR to ``model``: patches its layers to capture statistics.

        :func:`tf_msopt.thor` calls it. Call it yourself after
        ``keras.models.load_model`` (or use :func:`tf_msopt.thor.connect`),
        under the distribution strategy's scope if there is one. The model must
        have the layers THOR was created for (same names, kinds and shapes).

        Returns:
            this optimizer.
        """
        specs, layers, rows = survey(model, self.block_size)
        if self._specs is None:
            if self.built:
                raise ValueError(f"For '{_OWNER}', the optimizer was built without layer specs; "
                                 f"create it with tf_msopt.thor(model, ...) instead.")
            self._specs = tuple(specs)
        elif list(specs) != list(self._specs):
            raise ValueError(
                f"For '{_OWNER}', the model's layers do not match the layers this optimizer was "
                f"created for.\n  optimizer: {[s.get_config() for s in self._specs]}\n"
                f"  model:     {[s.get_config() for s in specs]}"
            )
        with self._distribution_strategy.scope():
            statistics = [LayerStatistics(spec, self.block_size) for spec in specs
                          if spec.second_order]
            batch = keras.Variable(float(self.batch_size), dtype="float32", trainable=False,
                                   name="global_batch")
        buffers = iter(statistics)
        for spec, layer in zip(specs, layers):
            install(layer, spec, next(buffers) if spec.second_order else None, batch,
                    self._is_thor_step, self.block_size)
        self._connection = _Connection(layers, statistics, batch, rows)
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
            rows = [ReportRow(spec.layer, spec.kind, f"{spec.layer}/{name}",
                              describe(spec, self.block_size), "")
                    for spec in self._specs or () for name in spec.variables]
        return ThorReport(tuple(rows), self.frequency, self.block_size, inverse_backend(),
                          self._connection is not None)

    # --- state

    def build(self, var_list):
        if self.built:
            return
        if self._specs is None:
            raise ValueError(f"For '{_OWNER}', the optimizer has no layers; create it with "
                             f"tf_msopt.thor(model, ...) or call connect(model) first.")
        super().build(var_list)
        self.momentums = [self.add_variable_from_reference(v, "momentum") for v in var_list]
        self.a_inverses, self.g_inverses = [], []
        for spec in self._second_order_specs:
            self.a_inverses.append(self.add_variable(
                spec.a_shape(self.block_size), initializer=_identity_blocks,
                name=f"{spec.layer}_a_inverse"))
            self.g_inverses.append(self.add_variable(
                spec.g_layout(self.block_size).shape, initializer=_identity_blocks,
                name=f"{spec.layer}_g_inverse"))
        self.damping_retries = self.add_variable((), initializer="zeros", dtype="int64",
                                                 name="damping_retries")
        self.failed_inverses = self.add_variable((), initializer="zeros", dtype="int64",
                                                 name="failed_inverses")
        self._decay_flags = [self.weight_decay > 0 and bool(self._decay_filter(v))
                             for v in var_list]

    # --- the step

    def _is_thor_step(self):
        return tf.equal(tf.math.floormod(tf.convert_to_tensor(self._iterations), self.frequency),
                        0)

    def _damping(self):
        if isinstance(self.damping, float):
            value = self.damping
        elif isinstance(self.damping, _Schedule):
            value = self.damping(self._iterations)
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
        self._loss_scale_optimizer = _calling_loss_scale_optimizer(self)
        # Embedding gradients arrive as IndexedSlices; the preconditioned update is dense.
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        return super().apply(grads, trainable_variables)

    def _apply_weight_decay(self, variables):
        """No decoupled decay: THOR adds ``weight_decay * w`` after preconditioning."""

    def _variable_rules(self):
        """Per variable index: ``(kind, index among preconditioned layers)``, or None.

        Matched by object (update_step only sees tf.Variables, and paths change
        when a model is loaded)."""
        rules = [None] * len(self._trainable_variables)
        second_order = 0
        for spec, layer in zip(self._specs, self._connection.layers):
            for variable in treated_variables(layer, spec):
                key = self._var_key(variable)
                if key in self._trainable_variables_indices:
                    rules[self._trainable_variables_indices[key]] = (
                        spec.kind, second_order if spec.second_order else None)
            second_order += spec.second_order
        return rules

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if self._rules is None:
            self._rules = self._variable_rules()
        # This replica's statistics, read in replica context; summed in _refresh_inverses.
        local = [(tf.convert_to_tensor(s.a), tf.convert_to_tensor(s.g),
                  tf.convert_to_tensor(s.rows)) for s in self._connection.statistics]
        tf.__internal__.distribute.interim.maybe_merge_call(
            self._refresh_inverses, self._distribution_strategy, local)
        super()._backend_update_step(grads, trainable_variables, learning_rate)

    def _loss_scale(self):
        """Every scale on the loss: ``loss_scale``, Keras' ``loss_scale_factor`` and the scale
        of the LossScaleOptimizer applying this one, if any."""
        scale = tf.constant(self.loss_scale * (self.loss_scale_factor or 1.0), tf.float32)
        outer = self._loss_scale_optimizer
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
        spec = self._second_order_specs[index]
        a_inverse, g_inverse = self.a_inverses[index], self.g_inverses[index]
        a_previous, g_previous = tf.convert_to_tensor(a_inverse), tf.convert_to_tensor(g_inverse)
        observed = rows > 0
        rows = tf.maximum(rows, 1.0)
        g_layout = spec.g_layout(self.block_size)
        g_new, g_retried, g_kept = blocks.robust_inverse(
            g / rows * g_scale + g_layout.padding_diagonal(), damping, g_previous)
        if spec.kind == EMBEDDING:
            a_new, a_retried, a_kept = blocks.robust_reciprocal(a / rows, damping, a_previous)
        else:
            a_new, a_retried, a_kept = blocks.robust_inverse(
                a / rows + spec.a_layout(self.block_size).padding_diagonal(), damping,
                a_previous)
        self.assign(a_inverse, tf.where(observed, a_new, a_previous))
        self.assign(g_inverse, tf.where(observed, g_new, g_previous))
        zero = tf.zeros((), tf.int64)
        self.assign_add(self.damping_retries, tf.where(observed, a_retried + g_retried, zero))
        self.assign_add(self.failed_inverses, tf.where(observed, a_kept + g_kept, zero))

    def _update(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        gradient = tf.cast(gradient, tf.float32)
        if self.loss_scale != 1.0:
            gradient = gradient / self.loss_scale
        rule = self._rules[index]
        if rule is not None and rule[0] == LAYER_NORM:
            batch = tf.convert_to_tensor(self._connection.batch)
            gradient = gradient / (tf.square(gradient) / batch + tf.sqrt(self._damping()))
        elif rule is not None:
            gradient = self._precondition(gradient, *rule)
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

    def _precondition(self, gradient, kind, index):
        """``A_inv g G_inv`` (``diag(a_inv) g G_inv`` for an embedding) on the kernel
        viewed as ``(a_dim, g_dim)``."""
        spec = self._second_order_specs[index]
        matrix = tf.reshape(gradient, [spec.a_dim, spec.g_dim])
        a_inverse = tf.convert_to_tensor(self.a_inverses[index])
        if kind == EMBEDDING:
            matrix = a_inverse[:, tf.newaxis] * matrix
        else:
            matrix = blocks.left_multiply(a_inverse, spec.a_layout(self.block_size), matrix)
        matrix = blocks.right_multiply(matrix, tf.convert_to_tensor(self.g_inverses[index]),
                                       spec.g_layout(self.block_size))
        return tf.reshape(matrix, tf.shape(gradient))

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
            "layers": None if self._specs is None else [s.get_config() for s in self._specs],
        })
        return config


def _calling_loss_scale_optimizer(inner, depth=32):
    """The ``keras.optimizers.LossScaleOptimizer`` (``tf_msopt``'s included) whose ``apply``
    is calling ``inner.apply`` right now, or None.

    A LossScaleOptimizer holds its inner optimizer but the inner one is not told
    about it; its scale is needed to undo the loss scale in G. Looked up while
    tracing, on the caller frames (in ``fit``, custom loops and replica threads).
    """
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if (isinstance(caller, keras.optimizers.LossScaleOptimizer)
                and caller.inner_optimizer is inner):
            return caller
        frame = frame.f_back
    return None


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
