"""Which layers THOR preconditions, and how their curvature statistics are captured.

:func:`survey` walks a model and gives each trainable variable a rule (a
Kronecker-factored layer, the LayerNorm rule, or first order, with the reason).
:func:`install` patches the ``call`` of each preconditioned layer (an instance
attribute; the class is untouched) so that its output passes through an
identity whose gradient function records, on THOR steps only:

- ``a``: the diagonal blocks of ``sum(x x^T)`` over the rows of the layer input
  (patches for a convolution, token counts for an embedding),
- ``g``: the diagonal blocks of ``sum(delta delta^T)`` over the rows of the
  gradient of the pre-activation output, ``delta = dL/dz * global_batch``,
- ``rows``: the number of rows.

Everything is recorded in the backward pass, so ``predict`` and ``evaluate``
record nothing, and a stale step costs one ``tf.cond`` per layer.
"""
import dataclasses
import math

import keras
import tensorflow as tf

from tf_msopt.thor.blocks import BlockLayout, covariance_blocks

__all__ = ["LayerSpec", "LayerStatistics", "ReportRow", "describe", "install", "survey",
           "treated_variables"]

DENSE, CONV, EMBEDDING, LAYER_NORM = "dense", "conv", "embedding", "layer_norm"
_KIND_NAMES = {DENSE: "Kronecker factors A (input) and G (output gradient)",
               CONV: "Kronecker factors A (patches) and G (output gradient)",
               EMBEDDING: "diagonal A (token frequencies), Kronecker factor G",
               LAYER_NORM: "LayerNorm rule g / (g*g/batch + sqrt(damping))"}
_ORIGINAL_CALL = "_tf_msopt_thor_original_call"


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer THOR treats with a rule of its own (serialised in the optimizer's config).

    Attributes:
        layer: the layer's name.
        kind: ``"dense"``, ``"conv"``, ``"embedding"`` or ``"layer_norm"``.
        variables: names (within the layer) of the variables the rule applies
            to: the kernel (``embeddings`` of an Embedding), or LayerNorm's
            gamma and beta.
        a_dim, g_dim: dimensions of the two factors (0 for LayerNorm).
    """

    layer: str
    kind: str
    variables: tuple
    a_dim: int = 0
    g_dim: int = 0

    @property
    def second_order(self):
        return self.kind != LAYER_NORM

    def a_layout(self, block_size):
        return BlockLayout.of(self.a_dim, block_size)

    def g_layout(self, block_size):
        return BlockLayout.of(self.g_dim, block_size)

    def a_shape(self, block_size):
        """Shape of A's statistics and inverse: a vector for an embedding, else blocks."""
        return (self.a_dim,) if self.kind == EMBEDDING else self.a_layout(block_size).shape

    def get_config(self):
        return dict(dataclasses.asdict(self), variables=list(self.variables))

    @classmethod
    def from_config(cls, config):
        return cls(**dict(config, variables=tuple(config["variables"])))


# --------------------------------------------------------------------------- survey


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """What THOR does with one trainable variable, and why."""

    layer: str
    layer_type: str
    variable: str
    rule: str
    reason: str


def _own_trainable_variables(layer):
    return [v for v in getattr(layer, "_trainable_variables", []) if v.trainable]


def _rule(layer):
    """``(kind, None)`` for a layer THOR treats, or ``(None, reason)``."""
    if isinstance(layer, keras.layers.LayerNormalization):
        return LAYER_NORM, None
    if isinstance(layer, keras.layers.Dense):
        kind, base = DENSE, keras.layers.Dense
    elif isinstance(layer, keras.layers.Conv1D):
        kind, base = CONV, keras.layers.Conv1D
    elif isinstance(layer, keras.layers.Conv2D):
        kind, base = CONV, keras.layers.Conv2D
    elif isinstance(layer, keras.layers.Embedding):
        kind, base = EMBEDDING, keras.layers.Embedding
    else:
        return None, f"no THOR rule for {type(layer).__name__} layers"
    if type(layer).call is not base.call:
        return None, f"{type(layer).__name__} overrides call(), so its statistics are unknown"
    if getattr(layer, "quantization_mode", None) is not None:
        return None, f"quantized layer ({layer.quantization_mode})"
    if getattr(layer, "lora_enabled", False):
        return None, "LoRA is enabled (the kernel is not the trained weight)"
    if kind == CONV and layer.groups != 1:
        return None, f"grouped convolution (groups={layer.groups})"
    if kind == CONV and layer.padding not in ("valid", "same"):
        return None, f"padding '{layer.padding}' has no patch rule"
    return kind, None


def _kernel(layer, kind):
    return layer.embeddings if kind == EMBEDDING else layer.kernel


def _spec(layer, kind):
    if kind == LAYER_NORM:
        return LayerSpec(layer.name, kind, tuple(v.name for v in _own_trainable_variables(layer)))
    kernel = _kernel(layer, kind)
    shape = tuple(kernel.shape)
    return LayerSpec(layer.name, kind, (kernel.name,), math.prod(shape[:-1]), shape[-1])


def treated_variables(layer, spec):
    """The layer's variables that ``spec``'s rule applies to."""
    return [v for v in _own_trainable_variables(layer) if v.name in spec.variables]


def describe(spec, block_size):
    """The rule of ``spec`` in words, with the factor sizes and block counts."""
    text = _KIND_NAMES[spec.kind]
    if not spec.second_order:
        return text
    a_blocks = ("" if spec.kind == EMBEDDING
                else f" in {spec.a_layout(block_size).count} block(s)")
    return (f"{text}; A {spec.a_dim}x{spec.a_dim}{a_blocks}, G {spec.g_dim}x{spec.g_dim} in "
            f"{spec.g_layout(block_size).count} block(s)")


def survey(model, block_size):
    """Gives every trainable variable of ``model`` a rule.

    Returns:
        ``(specs, layers, rows)``: the :class:`LayerSpec` of each layer THOR
        treats, those layers (same order), and a :class:`ReportRow` for every
        trainable variable of the model.
    """
    if not model.built:
        raise ValueError(
            "For 'thor', the model must be built (give it an Input, or call it once on a batch) "
            "so that its layers' shapes are known."
        )
    specs, layers, rows = [], [], []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        variables = _own_trainable_variables(layer)
        if not variables:
            continue
        kind, reason = _rule(layer)
        layer_type = type(layer).__name__
        treated = set()
        if kind is not None:
            spec = _spec(layer, kind)
            specs.append(spec)
            layers.append(layer)
            treated = {id(v) for v in treated_variables(layer, spec)}
            detail = describe(spec, block_size)
        for variable in variables:
            if id(variable) in treated:
                rows.append(ReportRow(layer.name, layer_type, variable.path, detail, ""))
            else:
                why = reason or f"THOR preconditions the {layer_type} kernel only"
                rows.append(ReportRow(layer.name, layer_type, variable.path, "first order", why))
    return specs, layers, rows


# ----------------------------------------------------------------------- statistics


class LayerStatistics:
    """The buffers one layer's capture writes (per replica) and the optimizer reads.

    They are transient (rewritten on every THOR step), so they are not optimizer
    state and are not saved.
    """

    def __init__(self, spec, block_size):
        def buffer(shape, name):
            return keras.Variable(initializer="zeros", shape=shape, dtype="float32",
                                  trainable=False, name=f"{spec.layer}_{name}")

        self.a = buffer(spec.a_shape(block_size), "a_statistics")
        self.g = buffer(spec.g_layout(block_size).shape, "g_statistics")
        self.rows = buffer((), "rows")


def _rows(tensor, width):
    return tf.reshape(tf.cast(tensor, tf.float32), [-1, width])


def _channels_last(layer, tensor):
    if layer.data_format == "channels_first":
        return tf.transpose(tensor, [0] + list(range(2, layer.rank + 2)) + [1])
    return tensor


def conv_patches(layer, inputs):
    """The patches ``layer`` multiplies with its kernel, ``[N*Ho*Wo, kh*kw*cin]``, in the
    row order of ``kernel.reshape(-1, filters)``."""
    x = tf.cast(_channels_last(layer, inputs), tf.float32)
    kernel_size, strides, dilation = (list(layer.kernel_size), list(layer.strides),
                                      list(layer.dilation_rate))
    if layer.rank == 1:
        x = x[:, tf.newaxis]
        kernel_size, strides, dilation = [1] + kernel_size, [1] + strides, [1] + dilation
    patches = tf.image.extract_patches(x, sizes=[1] + kernel_size + [1],
                                       strides=[1] + strides + [1],
                                       rates=[1] + dilation + [1],
                                       padding=layer.padding.upper())
    return tf.reshape(patches, [-1, patches.shape[-1]])


def layer_statistics(layer, spec, inputs, delta, block_size):
    """``(a, g, rows)`` of one layer: sums over rows (see the module docstring)."""
    if spec.kind == CONV:
        delta = _channels_last(layer, delta)
    delta_rows = _rows(delta, spec.g_dim)
    g = covariance_blocks(delta_rows, spec.g_layout(block_size))
    if spec.kind == EMBEDDING:
        ids = tf.reshape(tf.cast(inputs, tf.int32), [-1])
        a = tf.math.unsorted_segment_sum(tf.ones_like(ids, tf.float32), ids, spec.a_dim)
    else:
        a_rows = conv_patches(layer, inputs) if spec.kind == CONV else _rows(inputs, spec.a_dim)
        a = covariance_blocks(a_rows, spec.a_layout(block_size))
    return a, g, tf.cast(tf.shape(delta_rows)[0], tf.float32)


# -------------------------------------------------------------------------- capture


def _replicas_in_sync():
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def _global_batch(tensor):
    """The first axis of ``tensor`` summed over replicas (replicas get equal shares)."""
    return tf.cast(tf.shape(tensor)[0] * _replicas_in_sync(), tf.float32)


def _observe(output, record):
    """``output`` unchanged; in the backward pass ``record(d_output)`` runs before the
    gradient flows on."""
    @tf.custom_gradient
    def identity(value):
        def grad(upstream):
            with tf.control_dependencies([record(upstream)]):
                return tf.identity(upstream)
        return tf.identity(value), grad
    return identity(output)


class _Capture:
    """The patched ``call`` of one layer."""

    def __init__(self, layer, spec, original, statistics, batch, is_thor_step, block_size):
        self.layer, self.spec, self.original = layer, spec, original
        self.statistics, self.batch = statistics, batch
        self.is_thor_step, self.block_size = is_thor_step, block_size

    def __call__(self, inputs, *args, **kwargs):
        if self.spec.kind == LAYER_NORM:
            outputs = self.original(inputs, *args, **kwargs)
            return _observe(outputs, lambda d_outputs: self.batch.assign(_global_batch(d_outputs)))
        activation = getattr(self.layer, "activation", None)
        if activation is None:
            return _observe(self.original(inputs, *args, **kwargs),
                            lambda delta: self._record(inputs, delta))
        # Dense and Conv apply their activation inside call: take the pre-activation
        # output, observe it, then apply the activation.
        object.__setattr__(self.layer, "activation", None)
        try:
            outputs = self.original(inputs, *args, **kwargs)
        finally:
            object.__setattr__(self.layer, "activation", activation)
        return activation(_observe(outputs, lambda delta: self._record(inputs, delta)))

    def _record(self, inputs, d_outputs):
        def write():
            delta = tf.cast(d_outputs, tf.float32) * _global_batch(d_outputs)
            a, g, rows = layer_statistics(self.layer, self.spec, inputs, delta, self.block_size)
            with tf.control_dependencies([self.statistics.a.assign(a),
                                          self.statistics.g.assign(g),
                                          self.statistics.rows.assign(rows)]):
                return tf.constant(True)

        return tf.cond(self.is_thor_step(), write, lambda: tf.constant(False))


def install(layer, spec, statistics, batch, is_thor_step, block_size):
    """Patches ``layer.call`` to capture ``spec``'s statistics (replacing an earlier patch)."""
    original = layer.__dict__.get(_ORIGINAL_CALL, layer.call)
    capture = _Capture(layer, spec, original, statistics, batch, is_thor_step, block_size)
    object.__setattr__(layer, _ORIGINAL_CALL, original)
    object.__setattr__(layer, "call", capture)
