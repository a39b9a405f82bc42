"""The sampled (true) Fisher: ``G`` from labels drawn from the model's own predictions.

With ``fisher="sampled"``, THOR patches the model's ``call`` as it patches its
layers' (an instance attribute). In a training call on a statistics step, the
treated layers' pre-activation outputs are watched by a tape of THOR's own; after
the forward pass, labels ``y_hat`` are drawn from the output distribution and the
gradient of ``sum(-log p(y_hat | x)) / global_batch`` with respect to those outputs
(a second backward pass, through the layers above each one only) gives each
layer's ``G``. ``A`` comes from the same inputs as always. The training loss and
its gradients are untouched.

The output distribution is read off the compiled loss (``model.loss``) or set with
:meth:`tf_msopt.THOR.set_fisher_loss` for a custom loop.

The labels come from a counter-based hash of ``(seed, step, element)`` (splitmix64
[1], integer ops only) rather than TensorFlow's stateless random ops, whose stream
under XLA differs from the one they give otherwise: so a step compiled by XLA draws the
same labels as the same step run plainly, and a run can resume in either mode. The
element counts over the global batch (replicas get equal shares, as everywhere in
THOR), so replicas draw together what one device draws on the global batch.
Categorical labels are the Gumbel-max of the logits; Bernoulli labels are ``u < p``.

[1] Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
    OOPSLA 2014.
"""
import dataclasses

import keras
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt.thor.execution import global_batch, when

__all__ = ["OutputDistribution", "SampledFisher", "output_distribution", "stream_key",
           "uniform"]

# splitmix64's increment and its finaliser's multipliers.
_GOLDEN, _MIX_1, _MIX_2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LABEL_STREAM = 0   # last word of the labels' key: another stream of the same seed uses another

_CATEGORICAL = {"sparse_categorical_crossentropy", "categorical_crossentropy"}
_BINARY = {"binary_crossentropy"}
_LOSS_CLASSES = {keras.losses.SparseCategoricalCrossentropy: "sparse_categorical_crossentropy",
                 keras.losses.CategoricalCrossentropy: "categorical_crossentropy",
                 keras.losses.BinaryCrossentropy: "binary_crossentropy"}
SUPPORTED = ("sparse_categorical_crossentropy, categorical_crossentropy and "
             "binary_crossentropy (names, functions or keras.losses classes; logits or "
             "probabilities)")


def _mix(z):
    """splitmix64's finaliser, a bijection of uint64 (wrapping products)."""
    for shift, multiplier in ((30, _MIX_1), (27, _MIX_2)):
        z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, tf.constant(shift, tf.uint64)))
        z = z * tf.constant(multiplier, tf.uint64)
    return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, tf.constant(31, tf.uint64)))


def stream_key(*words):
    """A uint64 key folding in ``words`` (non-negative integers or integer tensors)."""
    key = tf.constant(0, tf.uint64)
    for word in words:
        # A Python int may exceed int64, the dtype tf.cast would convert it to first.
        word = tf.constant(word, tf.uint64) if isinstance(word, int) else tf.cast(word, tf.uint64)
        key = _mix(tf.bitwise.bitwise_xor(key, word))
    return key


def uniform(shape, key, offset=0):
    """float32 uniforms in (0, 1) (24 random bits each): element ``i`` (row-major) is
    ``(top 24 bits of mix(key + (offset + i + 1) * golden) + 1/2) / 2**24``, the same bits
    on every device and under XLA."""
    first = tf.cast(offset, tf.int64) + 1
    counters = tf.cast(tf.range(first, first + tf.cast(tf.reduce_prod(shape), tf.int64)),
                       tf.uint64)
    bits = _mix(key + counters * tf.constant(_GOLDEN, tf.uint64))
    top = tf.cast(tf.bitwise.right_shift(bits, tf.constant(40, tf.uint64)), tf.int32)
    return tf.reshape((tf.cast(top, tf.float32) + 0.5) * 2.0 ** -24, shape)


@dataclasses.dataclass(frozen=True)
class OutputDistribution:
    """``kind``: ``"categorical"`` (softmax over the last axis) or ``"bernoulli"`` (a
    sigmoid per entry); ``from_logits``: whether the model outputs logits."""

    kind: str
    from_logits: bool

    def sampled_loss(self, outputs, key, offset):
        """``sum(-log p(y_hat | x))`` over the batch with ``y_hat`` drawn from ``outputs``
        with the uniforms of :func:`uniform` under ``key``, from element ``offset`` on."""
        outputs = tf.cast(outputs, tf.float32)
        epsilon = keras.config.epsilon()
        if self.kind == "categorical":
            logits = outputs if self.from_logits else tf.math.log(
                tf.clip_by_value(outputs, epsilon, 1.0))
            flat = tf.reshape(logits, [-1, tf.shape(logits)[-1]])
            finite = tf.where(tf.math.is_finite(flat), flat, 0.0)
            gumbel = -tf.math.log(-tf.math.log(uniform(tf.shape(flat), key, offset)))
            labels = tf.argmax(tf.stop_gradient(finite) + gumbel, axis=-1)
            if self.from_logits:
                return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=labels, logits=flat))
            # A one-hot product, not a gather: its gradient is a few ops, not dozens.
            return -tf.reduce_sum(tf.one_hot(labels, tf.shape(flat)[-1]) * flat)
        probabilities = tf.sigmoid(outputs) if self.from_logits else outputs
        labels = tf.cast(uniform(tf.shape(outputs), key, offset) < tf.stop_gradient(probabilities),
                         tf.float32)
        if self.from_logits:
            return tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels,
                                                                         logits=outputs))
        p = tf.clip_by_value(outputs, epsilon, 1.0 - epsilon)
        return -tf.reduce_sum(labels * tf.math.log(p) + (1.0 - labels) * tf.math.log(1.0 - p))


def output_distribution(loss):
    """The :class:`OutputDistribution` a Keras loss (name, function or instance) implies;
    ``ValueError`` for any other loss."""
    if isinstance(loss, str):
        name, from_logits = loss, False
    elif isinstance(loss, keras.losses.Loss):
        name = _LOSS_CLASSES.get(type(loss), "")
        from_logits = bool(loss.get_config().get("from_logits", False))
    elif callable(loss):
        name, from_logits = getattr(loss, "__name__", ""), False
    else:
        name, from_logits = "", False
    if name in _CATEGORICAL:
        return OutputDistribution("categorical", from_logits)
    if name in _BINARY:
        return OutputDistribution("bernoulli", from_logits)
    raise ValueError(
        f"For 'THOR', fisher='sampled' draws labels from the model's output distribution, "
        f"which it reads off the loss; supported losses: {SUPPORTED}. Got {loss!r}. Use "
        f"fisher='empirical' for other losses.")


class SampledFisher:
    """The model-level half of the sampled-Fisher capture (one per connected model).

    Layer captures call :meth:`observe` in the forward pass; the patched model ``call``
    (:meth:`wrap`) opens the tape, draws the labels and writes the statistics.

    Args:
        seed: the labels' seed.
        step: the step counter (a variable) the labels' stream follows.
        output_distribution: returns the :class:`OutputDistribution` to draw from (read
            when a step is traced: the model may be compiled after it is connected).
        is_statistics_step: returns whether this step records statistics.
    """

    def __init__(self, seed, step, output_distribution, is_statistics_step):
        self.seed, self.step = seed, step
        self.output_distribution, self.is_statistics_step = (output_distribution,
                                                             is_statistics_step)
        self._watched = None    # [(layer, statistics, pieces, output)] in a training call
        self._tape = None

    def observe(self, layer, statistics, pieces, outputs):
        """In a training call: watch a treated layer's pre-activation output;
        ``pieces(d)`` gives each of its ``statistics`` buffers ``(inputs, delta)`` from the
        output's gradient ``d``."""
        if self._watched is None:
            return outputs
        outputs = tf.identity(outputs)
        self._tape.watch(outputs)
        self._watched.append((layer, statistics, pieces, outputs))
        return outputs

    def wrap(self, call):
        def sampled_fisher_call(inputs, *args, **kwargs):
            if (not kwargs.get("training") or self._watched is not None
                    or not compat.gradient_may_be_recorded()):
                return call(inputs, *args, **kwargs)
            self._watched = []
            try:
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    self._tape = tape
                    outputs = call(inputs, *args, **kwargs)
                    watched, self._watched = self._watched, None
                    # Still recording: the tape must see the sampled loss (computed in the
                    # branch) to differentiate it; _record stops it before the gradient.
                    if watched:
                        when(self.is_statistics_step(),
                             lambda: self._record(tape, watched, outputs))
            finally:
                self._watched, self._tape = None, None
            return outputs
        return sampled_fisher_call

    def _record(self, tape, watched, outputs):
        if isinstance(outputs, (list, tuple, dict)):
            raise ValueError("For 'THOR', fisher='sampled' needs a model with one output, "
                             f"but this one returns {type(outputs).__name__}.")
        distribution = self.output_distribution()
        context = tf.distribute.get_replica_context()
        replica = 0 if context is None else context.replica_id_in_sync_group
        key = stream_key(self.seed, self.step, _LABEL_STREAM)
        offset = tf.cast(replica, tf.int64) * tf.size(outputs, out_type=tf.int64)  # its share
        batch = global_batch(outputs)
        loss = distribution.sampled_loss(outputs, key, offset) / batch
        gradients = tape.gradient(loss, [entry[-1] for entry in watched])
        writes = {}     # per buffer: a later call of a shared layer adds to the earlier's
        for (layer, buffers, pieces, _), gradient in zip(watched, gradients):
            if gradient is None:     # the output does not depend on this call
                continue
            for statistics, (inputs, delta) in zip(buffers, pieces(gradient)):
                # float32 whatever the layers compute in (mixed precision: float16).
                a, g, rows = statistics.measure(layer, inputs,
                                                tf.cast(delta, tf.float32) * batch)
                # Non-finite outputs: this call's statistics count as unobserved.
                finite = (tf.reduce_all(tf.math.is_finite(a))
                          & tf.reduce_all(tf.math.is_finite(g)))
                writes[statistics] = statistics.write(
                    tf.where(finite, a, 0.0), tf.where(finite, g, 0.0),
                    tf.where(finite, rows, 0.0), after=writes.get(statistics))
        with tf.control_dependencies(list(writes.values())):
            return tf.constant(True)
