"""THOR: trace-based hardware-driven layer-oriented natural gradient (Chen et al. 2021)."""
import dataclasses
import random
import weakref

import keras
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt._common import register
from tf_msopt._validation import check_bool, check_float, check_int, check_number_range, type_name
from tf_msopt.optimizers.base import (MindSporeOptimizer, check_filter, make_variable_filter,
                                      resolve_learning_rate, serialize_filter)
from tf_msopt.thor import curvature_blocks
from tf_msopt.thor.capture import (LayerStatistics, ReportRow, install, install_model, survey,
                                   when)
from tf_msopt.thor.blocks import robust_inverses
from tf_msopt.thor.curvature_blocks import Preconditioning
from tf_msopt.thor.report import ThorReport
from tf_msopt.thor.sampled_fisher import SampledFisher, output_distribution

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


_DAMPING_MODES = ("sqrt", "pi")
_FISHERS = ("empirical", "sampled")
_WEIGHT_SHARINGS = ("mean", "expand")


def _check_choice(value, arg, choices):
    if value not in choices:
        raise ValueError(f"For '{_OWNER}', the '{arg}' must be one of {list(choices)}, "
                         f"but got {value!r}.")
    return value


def _check_statistics(decay, statistics_frequency, frequency):
    """``(decay, statistics_frequency)``: the frequency defaults to 1 with a decay and to
    ``frequency`` without one, and must divide ``frequency``."""
    if decay is not None:
        decay = check_number_range(check_float(decay, "statistics_decay", _OWNER),
                                   "statistics_decay", _OWNER, low=0.0, high=1.0,
                                   high_inclusive=False)
    if statistics_frequency is None:
        return decay, 1 if decay is not None else frequency
    statistics_frequency = check_int(statistics_frequency, "statistics_frequency", _OWNER,
                                     min_value=1)
    if decay is None and statistics_frequency != frequency:
        raise ValueError(
            f"For '{_OWNER}', 'statistics_frequency' needs 'statistics_decay' (without a moving "
            f"average, statistics are only used every 'frequency' steps), but got "
            f"statistics_frequency={statistics_frequency} and statistics_decay=None.")
    if frequency % statistics_frequency:
        raise ValueError(
            f"For '{_OWNER}', the 'statistics_frequency' must divide 'frequency' "
            f"({frequency}), but got {statistics_frequency}.")
    return decay, statistics_frequency


def _check_trace_thresholds(thresholds):
    if thresholds is None:
        return None
    if (not isinstance(thresholds, (list, tuple)) or len(thresholds) != 2
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                       for t in thresholds)):
        raise TypeError(f"For '{_OWNER}', the 'trace_thresholds' must be None or a pair of "
                        f"floats (omega1, omega2), but got {thresholds!r}.")
    omega1, omega2 = map(float, thresholds)
    if not 0.0 <= omega2 <= omega1:
        raise ValueError(f"For '{_OWNER}', the 'trace_thresholds' (omega1, omega2) must satisfy "
                         f"0 <= omega2 <= omega1, but got {thresholds!r}.")
    return omega1, omega2


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
        damping_mode: ``"sqrt"`` (MindSpore: ``sqrt(lambda)`` on both factors) or
            ``"pi"``: ``A + pi*sqrt(lambda) I`` and ``G + sqrt(lambda)/pi I`` with
            ``pi = sqrt((tr A/dim A) / (tr G/dim G))`` (1 when a trace is 0).
        statistics_decay: None (MindSpore: each inversion uses the statistics of
            its own step) or ``beta`` in [0, 1): ``A`` and ``G`` become moving
            averages ``m = beta*m + (1-beta)*stat``, bias-corrected by
            ``1 - beta**n`` (``n`` updates), kept as optimizer variables.
        statistics_frequency: steps between statistics captures (default 1 with a
            decay, else ``frequency``); must divide ``frequency``. Inverses are
            still recomputed every ``frequency`` steps.
        fisher: ``"empirical"`` (MindSpore: ``G`` from the training loss) or
            ``"sampled"``: ``G`` from the gradient of ``-log p(y_hat|x)`` with
            ``y_hat`` drawn from the model's output distribution (its compiled
            softmax/sigmoid cross-entropy loss, or :meth:`set_fisher_loss`).
        kl_clip: None or ``c > 0``: the preconditioned kernels' gradients are scaled
            by ``nu = min(1, sqrt(c / (lr^2 |sum <g, P g>|)))`` before weight decay
            and momentum.
        trace_thresholds: None or ``(omega1, omega2)``: on each inversion a layer's
            ``Delta = |T_k - T_prev| / T_prev`` (``T`` the trace of its damped
            Kronecker curvature) decides: above ``omega1`` new inverses, above
            ``omega2`` keep the previous ones, else keep them from then on (frozen).
            The decisions are counted in ``trace_decisions`` and shown by
            :meth:`report`.
        seed: int in [0, 2**64) seeding the sampled labels (``fisher="sampled"``); None draws one
            (kept in the config, so a resumed run samples as the original would).
        weight_sharing: how ``G`` treats the positions where a kernel is reused within an
            example (a convolution's output positions, a sequence's tokens): ``"mean"``
            (MindSpore: ``E`` over all rows, as ``A``) or ``"expand"``: summed over each
            example's positions, ``G = sum_rows delta delta^T / examples``, so that
            ``A (x) G`` has the Fisher's scale (KFC; K-FAC-expand). Layers without shared
            positions are unchanged.
        jit_compile: run each variable's update as one XLA function.
        name, **kwargs: the usual ``keras.optimizers.Optimizer`` arguments.

    With none of ``damping_mode``, ``statistics_decay``, ``fisher``, ``kl_clip``,
    ``trace_thresholds`` and ``weight_sharing`` changed, the update is MindSpore's exactly.

    References:
        Chen, Mingcong et al. THOR, Trace-based Hardware-driven layer-ORiented
        Natural Gradient Descent Computation. AAAI 2021.
        Grosse and Martens. A Kronecker-factored approximate Fisher matrix for
        convolution layers. ICML 2016 (KFC). Eschenhagen et al. Kronecker-Factored
        Approximate Curvature for Modern Neural Network Architectures. NeurIPS 2023
        (K-FAC-expand).
    """

    def __init__(self, learning_rate, damping, momentum, weight_decay=0.0, loss_scale=1.0,
                 batch_size=32, use_nesterov=False, decay_filter=None, split_indices=None,
                 enable_clip_grad=False, frequency=100, block_size=128, damping_mode="sqrt",
                 statistics_decay=None, statistics_frequency=None, fisher="empirical",
                 kl_clip=None, trace_thresholds=None, seed=None, weight_sharing="mean",
                 layers=None, name=None, jit_compile=None, **kwargs):
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
        damping_mode = _check_choice(damping_mode, "damping_mode", _DAMPING_MODES)
        statistics_decay, statistics_frequency = _check_statistics(
            statistics_decay, statistics_frequency, frequency)
        fisher = _check_choice(fisher, "fisher", _FISHERS)
        weight_sharing = _check_choice(weight_sharing, "weight_sharing", _WEIGHT_SHARINGS)
        if kl_clip is not None:
            kl_clip = check_number_range(check_float(kl_clip, "kl_clip", _OWNER), "kl_clip",
                                         _OWNER, low=0.0, low_inclusive=False)
        trace_thresholds = _check_trace_thresholds(trace_thresholds)
        if seed is None and fisher == "sampled":
            seed = random.SystemRandom().randrange(2**31)   # leaves Python's global state alone
        if seed is not None:
            seed = check_int(seed, "seed", _OWNER, min_value=0, max_value=2**64 - 1)
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
        self.damping_mode = damping_mode
        self.statistics_decay = statistics_decay
        self.statistics_frequency = statistics_frequency
        self.fisher = fisher
        self.kl_clip = kl_clip
        self.trace_thresholds = trace_thresholds
        self.seed = seed
        self.weight_sharing = weight_sharing
        self._fisher_loss = None
        self._blocks = None if layers is None else tuple(map(_block_from_config, layers))
        self._connection = None
        self._rules = None
        self._traced_refresh = _TracedOnce(self._refresh_bucket)
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
            statistics = [LayerStatistics(block, self.block_size, self.weight_sharing)
                          for block in blocks if block.has_factors]
            batch = keras.Variable(float(self.batch_size), dtype="float32", trainable=False,
                                   autocast=False, name="global_batch")
        sampled = (SampledFisher(self, self._is_statistics_step) if self.fisher == "sampled"
                   else None)
        buffers = iter(statistics)
        for block, layer in zip(blocks, layers):
            install(layer, block, next(buffers) if block.has_factors else None, batch,
                    self._is_statistics_step, sampled)
        install_model(model, sampled)
        self._connection = _Connection(model, layers, statistics, batch, rows)
        self._rules = None
        if getattr(model, "train_function", None) is not None:
            model.train_function = None    # traced without the capture: trace again
        return self

    def set_fisher_loss(self, loss):
        """The loss whose output distribution ``fisher="sampled"`` draws labels from, for a
        custom training loop (``fit`` reads it off the compiled loss): a Keras
        cross-entropy loss, e.g. ``keras.losses.SparseCategoricalCrossentropy(
        from_logits=True)`` or ``"binary_crossentropy"``. Returns this optimizer."""
        self._fisher_loss = output_distribution(loss)
        return self

    def fisher_output_distribution(self):
        """The output distribution of the sampled Fisher: from :meth:`set_fisher_loss`, or
        the connected model's compiled loss."""
        if self._fisher_loss is not None:
            return self._fisher_loss
        loss = getattr(self._connection.model(), "loss", None)
        if loss is None:
            raise ValueError(
                f"For '{_OWNER}', fisher='sampled' needs the model's loss to know its "
                f"output distribution: compile the model with it, or call "
                f"optimizer.set_fisher_loss(loss) before a custom training loop.")
        return output_distribution(loss)

    def report(self):
        """A :class:`tf_msopt.thor.ThorReport`: every trainable variable's rule and why."""
        from tf_msopt.ops.inverse import inverse_backend

        if self._connection is not None:
            rows = self._connection.rows
        else:
            rows = [ReportRow(block.layer, block.kind, f"{block.layer}/{name}",
                              block.describe(self.block_size), "")
                    for block in self._blocks or () for name in block.variables]
        decisions = {block.layer: tuple(int(n) for n in counts.numpy())
                     for block, counts in zip(self._factored_blocks, self.trace_decisions)
                     } if self.built else {}
        return ThorReport(tuple(rows), self.frequency, self.block_size, inverse_backend(),
                          self._connection is not None, decisions)

    def savedmodel_only_children(self):
        # A training step traced in a SavedModel captures the capture buffers, so the
        # SavedModel must hold them; they are rewritten on every THOR step, so no
        # checkpoint does.
        if self._connection is None:
            return {}
        buffers = [self._connection.batch] + [
            buffer for layer in self._connection.statistics
            for buffer in (layer.a, layer.g, layer.rows)]
        return {f"capture_buffer_{i}": buffer for i, buffer in enumerate(buffers)}

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
        self.a_averages, self.g_averages, self.statistics_counts = [], [], []
        self.traces, self.trace_decisions = [], []
        for block in self._factored_blocks:
            a_shape, g_shape = block.factor_shapes(self.block_size)
            self.a_inverses.append(self.add_variable(a_shape, initializer=_identity_blocks,
                                                     name=f"{block.layer}_a_inverse"))
            self.g_inverses.append(self.add_variable(g_shape, initializer=_identity_blocks,
                                                     name=f"{block.layer}_g_inverse"))
            if self.statistics_decay is not None:
                self.a_averages.append(self.add_variable(a_shape, initializer="zeros",
                                                         name=f"{block.layer}_a_average"))
                self.g_averages.append(self.add_variable(g_shape, initializer="zeros",
                                                         name=f"{block.layer}_g_average"))
                self.statistics_counts.append(self.add_variable(
                    (), initializer="zeros", name=f"{block.layer}_statistics_count"))
            if self.trace_thresholds is not None:
                self.traces.append(self.add_variable((), initializer="zeros",
                                                     name=f"{block.layer}_trace"))
                # (refreshed, reused, frozen) inversions
                self.trace_decisions.append(self.add_variable(
                    (3,), initializer="zeros", dtype="int64",
                    name=f"{block.layer}_trace_decisions"))
        if self.kl_clip is not None:
            self.kl_factor = self.add_variable((), initializer="ones", name="kl_factor")
        self.damping_retries = self.add_variable((), initializer="zeros", dtype="int64",
                                                 name="damping_retries")
        self.failed_inverses = self.add_variable((), initializer="zeros", dtype="int64",
                                                 name="failed_inverses")
        self._decay_flags = [self.weight_decay > 0 and bool(self._decay_filter(v))
                             and not self.excluded_from_weight_decay(v) for v in var_list]

    # --- the step

    def _every(self, steps):
        """Whether this step is a multiple of ``steps``; the Python ``True`` when every step is
        (see :func:`~tf_msopt.thor.capture.when`)."""
        if steps == 1:
            return True
        return tf.equal(tf.math.floormod(tf.convert_to_tensor(self.iterations), steps), 0)

    def _is_statistics_step(self):
        return self._every(self.statistics_frequency)

    def _is_inverse_step(self):
        return self._every(self.frequency)

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
        """On statistics steps: sums the statistics over replicas (one all-reduce per bucket)
        and, on inverse steps, recomputes every layer's inverses (cross-replica context)."""
        if not local:
            return
        damping = tf.sqrt(self._damping())
        # Sampled labels come with an unscaled loss; the training loss carries its scale.
        g_scale = (tf.constant(1.0) if self.fisher == "sampled"
                   else tf.math.reciprocal(tf.square(self._loss_scale())))

        def refresh():
            for bucket in _buckets(len(local), self.split_indices):
                reduced = _sum_over_replicas(
                    distribution, [value for index in bucket for value in local[index]],
                    self.a_inverses[bucket[0]])
                statistics = [reduced[3 * offset:3 * offset + 3]
                              for offset in range(len(bucket))]
                _on_each_device(distribution, self.a_inverses[bucket[0]], self._traced_refresh,
                                (bucket, statistics, damping, g_scale))
            return tf.constant(True)

        when(self._is_statistics_step(), refresh)

    def _refresh_bucket(self, device_variable, bucket, statistics, damping, g_scale):
        """One bucket's layers on one device, from statistics summed over replicas: the
        moving averages (with ``statistics_decay``), then new inverses on inverse steps.
        ``device_variable`` (the bucket's first A inverse there) only says which device."""
        layers = []
        for index, (a, g, rows) in zip(bucket, statistics):
            observed = rows > 0
            rows = tf.maximum(rows, 1.0)
            a, g = a / rows, g / rows * g_scale
            if self.statistics_decay is None:
                layers.append((index, a, g, observed))
            else:
                self._update_averages(index, a, g, observed)
        if self.statistics_decay is None:   # statistics steps are inverse steps
            return self._invert_layers(layers, damping)
        # The bias-corrected averages are read only where they are inverted.
        return when(self._is_inverse_step(), lambda: self._invert_layers(
            [self._corrected_averages(index) for index in bucket], damping))

    def _update_averages(self, index, a, g, observed):
        """Updates one layer's moving averages of A and G and its count of updates."""
        beta = self.statistics_decay
        # A step whose statistics are not finite leaves the averages alone.
        update = observed & tf.reduce_all(tf.math.is_finite(a)) & tf.reduce_all(
            tf.math.is_finite(g))
        for average, value in ((self.a_averages[index], a), (self.g_averages[index], g)):
            self.assign(average, tf.where(update, beta * average + (1.0 - beta) * value,
                                          average))
        self.assign_add(self.statistics_counts[index], tf.cast(update, tf.float32))

    def _corrected_averages(self, index):
        """``(index, A, G, observed)`` of one layer from its bias-corrected moving averages;
        observed once anything is averaged."""
        count = tf.convert_to_tensor(self.statistics_counts[index])
        correction = 1.0 - tf.pow(tf.constant(self.statistics_decay), tf.maximum(count, 1.0))
        return (index, tf.convert_to_tensor(self.a_averages[index]) / correction,
                tf.convert_to_tensor(self.g_averages[index]) / correction, count > 0)

    def _layer_damping(self, block, a, g, damping):
        """``(d_A, d_G)``: ``sqrt(lambda)`` on both, or split by the factors' traces."""
        if self.damping_mode == "sqrt":
            return damping, damping
        a_mean, g_mean = block.mean_eigenvalues(a, g, self.block_size)
        pi = tf.sqrt(tf.math.divide_no_nan(a_mean, g_mean))
        pi = tf.where((pi > 0) & tf.math.is_finite(pi), pi, 1.0)
        return damping * pi, damping / pi

    def _invert_layers(self, layers, damping):
        """New inverses for ``layers`` (``(index, a, g, observed)``), where ``observed`` and
        the trace rule (if any) say so."""
        layers = [(index, a, g, observed,
                   self._layer_damping(self._factored_blocks[index], a, g, damping))
                  for index, a, g, observed in layers]
        if self.trace_thresholds is None:
            self._assign_inverses(layers)
            return tf.constant(True)
        for index, a, g, observed, layer_damping in layers:
            block = self._factored_blocks[index]
            refresh = self._trace_rule(
                index, block.damped_trace(a, g, layer_damping, self.block_size), observed)
            layer = (index, a, g, refresh, layer_damping)
            # The rule exists to save the inversion: skip it, not only its result.
            tf.cond(refresh, lambda layer=layer: self._assign_inverses([layer]),
                    lambda: tf.constant(False))
        return tf.constant(True)

    def _assign_inverses(self, layers):
        """Inverts every factor of ``layers`` (blocks of one size in one call) and assigns
        them where the layer is ``observed``."""
        factors, use = [], []
        for index, a, g, observed, layer_damping in layers:
            old = (tf.convert_to_tensor(self.a_inverses[index]),
                   tf.convert_to_tensor(self.g_inverses[index]))
            factors += self._factored_blocks[index].inversion_factors(
                a, g, layer_damping, old, self.block_size)
            use += [observed, observed]
        inverses, retried, kept = robust_inverses(factors, use)
        inverses = iter(inverses)
        for index, *_ in layers:
            self.assign(self.a_inverses[index], next(inverses))
            self.assign(self.g_inverses[index], next(inverses))
        self.assign_add(self.damping_retries, retried)
        self.assign_add(self.failed_inverses, kept)
        return tf.constant(True)

    def _trace_rule(self, index, trace, observed):
        """THOR's per-layer rule; returns whether to invert, counts the decision."""
        omega1, omega2 = self.trace_thresholds
        previous, decisions = self.traces[index], self.trace_decisions[index]
        frozen = decisions[2] > 0
        change = tf.math.divide_no_nan(tf.abs(tf.abs(trace) - tf.abs(previous)),
                                       tf.abs(previous))
        first = tf.equal(previous, 0.0)
        refresh = observed & ~frozen & (first | (change > omega1))
        freeze = observed & ~frozen & ~first & (change <= omega2)
        reuse = observed & ~frozen & ~refresh & ~freeze
        self.assign_add(decisions, tf.cast(tf.stack([refresh, reuse, freeze | (
            observed & frozen)]), tf.int64))
        self.assign(previous, tf.where(observed & ~frozen, trace, previous))
        return refresh

    def distributed_update(self, distribution, grads_and_vars, learning_rate):
        if self.kl_clip is None:
            return super().distributed_update(distribution, grads_and_vars, learning_rate)
        # The KL factor needs every preconditioned gradient before any is applied.
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        return _on_each_device(distribution, self.kl_factor, self._clipped_update_step,
                               (grads_and_vars, learning_rate))

    def _clipped_update_step(self, kl_factor, grads_and_vars, learning_rate):
        """The update with ``kl_clip`` on one device: one XLA function with ``jit_compile``."""
        if not self.jit_compile or compat.in_xla_context():
            return self._clipped_update(kl_factor, grads_and_vars, learning_rate)
        variables = [v for _, v in grads_and_vars]
        compiled = self._compiled(
            (id(kl_factor), *map(id, variables)),
            lambda gradients, learning_rate: self._clipped_update(
                kl_factor, zip(gradients, variables), learning_rate))
        return compiled([g for g, _ in grads_and_vars], tf.convert_to_tensor(learning_rate))

    def _clipped_update(self, kl_factor, grads_and_vars, learning_rate):
        """Preconditions each gradient once, scales the Kronecker-factored ones by
        ``nu = min(1, sqrt(kl_clip / (lr^2 |sum <g, P g>|)))``, then applies them all."""
        steps, products = [], []
        for gradient, variable in grads_and_vars:
            index = compat.variable_index(self, variable)
            gradient = self._unscaled(gradient)
            direction = self._direction(gradient, index)
            factored = self._rules[index] is not None and self._rules[index][0].has_factors
            if factored:
                products.append(tf.reduce_sum(gradient * direction))
            steps.append((direction, variable, index, factored))
        nu = None
        if products:
            size = tf.abs(tf.add_n(products)) * tf.square(tf.cast(learning_rate, tf.float32))
            nu = tf.where(size > 0, tf.minimum(
                1.0, tf.sqrt(tf.math.divide_no_nan(self.kl_clip, size))), 1.0)
            self.assign(kl_factor, nu)
        for direction, variable, index, factored in steps:
            self._apply(direction * nu if factored else direction, variable, index,
                        learning_rate)

    def _unscaled(self, gradient):
        gradient = tf.cast(gradient, tf.float32)
        return gradient / self.loss_scale if self.loss_scale != 1.0 else gradient

    def _update(self, gradient, variable, learning_rate):
        index = compat.variable_index(self, variable)
        direction = self._direction(self._unscaled(gradient), index)
        self._apply(direction, variable, index, learning_rate)

    def _direction(self, gradient, index):
        rule = self._rules[index]
        return gradient if rule is None else self._precondition(gradient, *rule)

    def _apply(self, direction, variable, index, learning_rate):
        """Weight decay, the optional norm clip and the momentum step."""
        direction = tf.cast(direction, variable.dtype)
        if self._decay_flags[index]:
            direction += tf.cast(self.weight_decay, variable.dtype) * variable
        if self.enable_clip_grad:
            direction = tf.clip_by_norm(direction, 1.0)
        momentum = self.momentums[index]
        tf.raw_ops.ResourceApplyMomentum(
            var=_handle(variable), accum=_handle(momentum),
            lr=tf.cast(learning_rate, variable.dtype), grad=direction,
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
            "damping_mode": self.damping_mode,
            "statistics_decay": self.statistics_decay,
            "statistics_frequency": self.statistics_frequency,
            "fisher": self.fisher,
            "kl_clip": self.kl_clip,
            "trace_thresholds": (None if self.trace_thresholds is None
                                 else list(self.trace_thresholds)),
            "seed": self.seed,
            "weight_sharing": self.weight_sharing,
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


class _TracedOnce:
    """Calls ``fn`` through one ``tf.function`` while a graph is traced, plainly when eager.

    A step whose first trace builds the optimizer (a custom loop's first ``apply``) is
    traced twice; the statistics and inverses do not depend on the batch, so the second
    trace reuses their graph. Even traced once, a train step builds faster so (digits MLP,
    first ``fit`` epoch: 1.10x Adam's against 1.17x). Not itself a ``tf.function``, so a
    SavedModel export does not try to save it.
    """

    def __init__(self, fn):
        self._fn = fn
        self._traced = tf.function(fn, autograph=False)

    def __call__(self, *args):
        return self._fn(*args) if tf.executing_eagerly() else self._traced(*args)


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
