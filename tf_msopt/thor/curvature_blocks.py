"""Curvature blocks: one class per layer kind THOR preconditions.

A block owns, for one layer: which of its variables it treats, how the layer's
statistics are read off its input and output gradient, the shapes of its factors,
how they are damped and inverted, and how a gradient is preconditioned. The
optimizer only schedules steps, all-reduces statistics and applies momentum.

Adding a layer kind is one new class decorated with :func:`register`; the
registry maps Keras layer types to blocks (the first registered class whose
``layer_types`` match wins).

Statistics are sums over rows (the optimizer divides by the summed row count):
``a = sum(x x^T)`` over the rows of the kernel's input, ``g = sum(delta delta^T)``
over the rows of the pre-activation output gradient.
"""
import dataclasses
import math
import string
from typing import ClassVar

import keras
import numpy as np
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt.thor.blocks import (BlockLayout, covariance_blocks, left_multiply, right_multiply,
                                  robust_inverses)

__all__ = ["Conv", "CurvatureBlock", "Dense", "DepthwiseConv2D", "EinsumDense", "Embedding",
           "KroneckerBlock", "LayerNorm", "Preconditioning", "block_for", "from_config",
           "register"]

REGISTRY = {}


def register(cls):
    """Class decorator: makes ``cls`` the block of its ``layer_types`` (under ``cls.kind``)."""
    REGISTRY[cls.kind] = cls
    return cls


def block_for(layer):
    """``(block, None)`` for a layer THOR treats, or ``(None, reason)``."""
    for cls in REGISTRY.values():
        base = next((t for t in cls.layer_types if isinstance(layer, t)), None)
        if base is None:
            continue
        reason = cls.refusal(layer, base)
        return (None, reason) if reason else (cls.from_layer(layer), None)
    return None, f"no THOR rule for {type(layer).__name__} layers"


def from_config(config):
    config = dict(config)
    cls = REGISTRY[config.pop("kind")]
    return cls(**{key: tuple(value) if isinstance(value, list) else value
                  for key, value in config.items()})


@dataclasses.dataclass(frozen=True)
class Preconditioning:
    """What a block may need to precondition a gradient (read once per variable)."""

    a_inverse: object = None
    g_inverse: object = None
    batch: object = None
    damping: object = None


@dataclasses.dataclass(frozen=True)
class CurvatureBlock:
    """One layer THOR treats with a rule of its own; serialised in the optimizer's config.

    Attributes:
        layer: the layer's name.
        variables: names (within the layer) of the variables the rule treats.
    """

    layer: str
    variables: tuple

    kind: ClassVar[str] = ""
    layer_types: ClassVar[tuple] = ()
    rule: ClassVar[str] = ""
    has_factors: ClassVar[bool] = True

    @classmethod
    def refusal(cls, layer, base):
        """Why ``layer`` (an instance of ``base``) falls back to first order, or None."""
        if type(layer).call is not base.call:
            return f"{type(layer).__name__} overrides call(), so its statistics are unknown"
        if getattr(layer, "quantization_mode", None) is not None:
            return f"quantized layer ({layer.quantization_mode})"
        if getattr(layer, "lora_enabled", False):
            return "LoRA is enabled (the kernel is not the trained weight)"
        return None

    @classmethod
    def from_layer(cls, layer):
        raise NotImplementedError

    def treated_variables(self, layer):
        return [v for v in compat.own_trainable_variables(layer) if v.name in self.variables]

    def get_config(self):
        config = dataclasses.asdict(self)
        config = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
        return dict(config, kind=self.kind)

    def describe(self, block_size):
        return self.rule

    # --- capture

    def capture(self, layer, call, observe, inputs, *args, **kwargs):
        """Runs ``call`` with the output that gets observed passed through ``observe``."""
        raise NotImplementedError

    # --- factors (blocks with ``has_factors``)

    def factor_shapes(self, block_size):
        """Shapes of ``(a, g)``: the statistics buffers and the inverses alike."""
        raise NotImplementedError

    def statistics(self, layer, inputs, delta, block_size):
        """``(a, g, rows)`` of one call: sums over rows."""
        raise NotImplementedError

    def inversion_factors(self, a, g, damping, previous, block_size):
        """``[(statistics, damping, previous)]`` of the factors to invert, from mean
        statistics ``(a, g)``, ``damping = (d_A, d_G)`` and the ``previous`` inverses
        (for :func:`tf_msopt.thor.blocks.robust_inverses`: several layers' factors are
        inverted together)."""
        raise NotImplementedError

    def invert(self, a, g, damping, previous, block_size):
        """New ``(a_inverse, g_inverse)`` of this layer alone, and the counts of blocks that
        were retried and that kept their ``previous`` inverse."""
        inverses, retried, kept = robust_inverses(
            self.inversion_factors(a, g, damping, previous, block_size))
        return tuple(inverses), retried, kept

    def mean_eigenvalues(self, a, g, block_size):
        """``(tr A / dim A, tr G / dim G)`` over real dimensions (padding excluded)."""
        raise NotImplementedError

    def damped_trace(self, a, g, damping, block_size):
        """``tr((A + d_A I) kron (G + d_G I))``, the trace of the damped curvature the
        inverses stand for."""
        raise NotImplementedError

    def precondition(self, gradient, state, block_size):
        raise NotImplementedError


def _pre_activation_capture(layer, call, observe, inputs, *args, **kwargs):
    """Layers that apply their activation inside ``call``: run without it, observe the
    pre-activation output, then apply it."""
    activation = getattr(layer, "activation", None)
    if activation is None:
        return observe(call(inputs, *args, **kwargs))
    object.__setattr__(layer, "activation", None)
    try:
        outputs = call(inputs, *args, **kwargs)
    finally:
        object.__setattr__(layer, "activation", activation)
    return activation(observe(outputs))


def _trace(factor):
    """Sum of the diagonal of a factor kept as blocks ``[count, n, n]`` or as a diagonal."""
    diagonal = factor if factor.shape.rank == 1 else tf.linalg.diag_part(factor)
    return tf.reduce_sum(diagonal)


def _rows(tensor, width):
    return tf.reshape(tf.cast(tensor, tf.float32), [-1, width])


@dataclasses.dataclass(frozen=True)
class KroneckerBlock(CurvatureBlock):
    """A kernel viewed as a matrix ``(a_dim, g_dim)``, preconditioned ``A^-1 g G^-1`` with
    factors split into diagonal blocks of ``block_size``."""

    a_dim: int = 0
    g_dim: int = 0

    def a_layout(self, block_size):
        return BlockLayout.of(self.a_dim, block_size)

    def g_layout(self, block_size):
        return BlockLayout.of(self.g_dim, block_size)

    def factor_shapes(self, block_size):
        return self.a_layout(block_size).shape, self.g_layout(block_size).shape

    def describe(self, block_size):
        return (f"{self.rule}; A {self.a_dim}x{self.a_dim} in {self.a_layout(block_size).count} "
                f"block(s), G {self.g_dim}x{self.g_dim} in "
                f"{self.g_layout(block_size).count} block(s)")

    def capture(self, layer, call, observe, inputs, *args, **kwargs):
        return _pre_activation_capture(layer, call, observe, inputs, *args, **kwargs)

    def input_rows(self, layer, inputs):
        """``[rows, a_dim]``: the kernel's input, one row per use of the kernel."""
        return _rows(inputs, self.a_dim)

    def output_rows(self, layer, delta):
        """``[rows, g_dim]``: the output gradient, rows in any order."""
        return _rows(delta, self.g_dim)

    def statistics(self, layer, inputs, delta, block_size):
        delta_rows = self.output_rows(layer, delta)
        a = self.input_statistics(self.input_rows(layer, inputs), block_size)
        g = covariance_blocks(delta_rows, self.g_layout(block_size))
        return a, g, tf.cast(tf.shape(delta_rows)[0], tf.float32)

    def input_statistics(self, rows, block_size):
        return covariance_blocks(rows, self.a_layout(block_size))

    def inversion_factors(self, a, g, damping, previous, block_size):
        return [(self.padded_a(a, block_size), damping[0], previous[0]),
                (self.g_layout(block_size).with_padding_identity(g), damping[1], previous[1])]

    def padded_a(self, a, block_size):
        return self.a_layout(block_size).with_padding_identity(a)

    def mean_eigenvalues(self, a, g, block_size):
        # Statistics are zero on padded positions (the 1s are added when inverting).
        return (_trace(a) / self.a_layout(block_size).dim,
                _trace(g) / self.g_layout(block_size).dim)

    def damped_trace(self, a, g, damping, block_size):
        a_dim, g_dim = self.a_layout(block_size).dim, self.g_layout(block_size).dim
        return (_trace(a) + damping[0] * a_dim) * (_trace(g) + damping[1] * g_dim)

    def kernel_matrix(self, gradient):
        return tf.reshape(gradient, [self.a_dim, self.g_dim])

    def kernel_from_matrix(self, matrix, gradient):
        return tf.reshape(matrix, tf.shape(gradient))

    def precondition(self, gradient, state, block_size):
        matrix = self.left_precondition(self.kernel_matrix(gradient), state.a_inverse,
                                        block_size)
        matrix = right_multiply(matrix, state.g_inverse, self.g_layout(block_size))
        return self.kernel_from_matrix(matrix, gradient)

    def left_precondition(self, matrix, a_inverse, block_size):
        return left_multiply(a_inverse, self.a_layout(block_size), matrix)


def _kernel_block(cls, layer, kernel):
    shape = tuple(kernel.shape)
    return cls(layer.name, (kernel.name,), math.prod(shape[:-1]), shape[-1])


@register
@dataclasses.dataclass(frozen=True)
class Dense(KroneckerBlock):
    """``keras.layers.Dense`` (any input rank): ``A = E[x x^T]``, ``G = E[delta delta^T]``."""

    kind: ClassVar[str] = "dense"
    layer_types: ClassVar[tuple] = (keras.layers.Dense,)
    rule: ClassVar[str] = "Kronecker factors A (input) and G (output gradient)"

    @classmethod
    def from_layer(cls, layer):
        return _kernel_block(cls, layer, layer.kernel)


def _expand_ellipsis(spec, rank, letters):
    if "..." not in spec:
        return spec
    return spec.replace("...", letters[:rank - (len(spec) - 3)])


@register
@dataclasses.dataclass(frozen=True)
class EinsumDense(KroneckerBlock):
    """``keras.layers.EinsumDense`` (the projections of ``MultiHeadAttention`` and of
    ``keras_hub`` transformer layers): the kernel viewed as (contracted input axes) x
    (output axes), statistics over every other axis, as for the equivalent Dense layer.

    Attributes:
        kernel_order: the kernel's axes, contracted ones first (empty: already so).
    """

    kernel_order: tuple = ()

    kind: ClassVar[str] = "einsum_dense"
    layer_types: ClassVar[tuple] = (keras.layers.EinsumDense,)
    rule: ClassVar[str] = ("Kronecker factors A (contracted input axes) and G (output axes "
                           "gradient)")

    @staticmethod
    def _specs(equation):
        sources, output = equation.replace(" ", "").split("->")
        inputs, kernel = sources.split(",")
        return inputs, kernel, output

    @classmethod
    def _axes(cls, equation):
        """``(contracted, produced)`` kernel letters, or a reason this equation has no rule."""
        inputs, kernel, output = cls._specs(equation)
        contracted = [c for c in kernel if c in inputs and c not in output]
        produced = [c for c in kernel if c in output and c not in inputs]
        if len(contracted) + len(produced) != len(kernel):
            return None, f"equation '{equation}' has kernel axes that are also batch axes"
        if any(c not in kernel and c not in output for c in inputs.replace("...", "")):
            return None, f"equation '{equation}' sums input axes the kernel does not see"
        return (contracted, produced), None

    @classmethod
    def refusal(cls, layer, base):
        return super().refusal(layer, base) or cls._axes(layer.equation)[1]

    @classmethod
    def from_layer(cls, layer):
        (contracted, produced), _ = cls._axes(layer.equation)
        kernel_spec = cls._specs(layer.equation)[1]
        order = tuple(kernel_spec.index(c) for c in contracted + produced)
        shape = tuple(layer.kernel.shape)
        return cls(layer.name, (layer.kernel.name,),
                   math.prod(shape[i] for i in order[:len(contracted)]),
                   math.prod(shape[i] for i in order[len(contracted):]),
                   () if order == tuple(range(len(order))) else order)

    def _rows_of(self, layer, tensor, spec, kernel_letters, width):
        """``tensor`` (laid out as ``spec``) as ``[rows, width]``: the axes the kernel does
        not see first, then ``kernel_letters``."""
        free = "".join(c for c in string.ascii_letters if c not in layer.equation)
        spec = _expand_ellipsis(spec, tensor.shape.rank, free)
        kernel = self._specs(layer.equation)[1]
        batch = "".join(c for c in spec if c not in kernel)
        return _rows(tf.einsum(f"{spec}->{batch}{''.join(kernel_letters)}", tensor), width)

    def input_rows(self, layer, inputs):
        (contracted, _), _ = self._axes(layer.equation)
        return self._rows_of(layer, inputs, self._specs(layer.equation)[0], contracted,
                             self.a_dim)

    def output_rows(self, layer, delta):
        (_, produced), _ = self._axes(layer.equation)
        return self._rows_of(layer, delta, self._specs(layer.equation)[2], produced, self.g_dim)

    def kernel_matrix(self, gradient):
        if self.kernel_order:
            gradient = tf.transpose(gradient, self.kernel_order)
        return tf.reshape(gradient, [self.a_dim, self.g_dim])

    def kernel_from_matrix(self, matrix, gradient):
        if not self.kernel_order:
            return tf.reshape(matrix, tf.shape(gradient))
        shape = [gradient.shape[i] for i in self.kernel_order]
        inverse = [self.kernel_order.index(i) for i in range(len(self.kernel_order))]
        return tf.transpose(tf.reshape(matrix, shape), inverse)


def _channels_last(layer, tensor):
    if layer.data_format == "channels_first":
        return tf.transpose(tensor, [0] + list(range(2, tensor.shape.rank)) + [1])
    return tensor


def _patch_axis(size, kernel, stride, dilation, padding):
    """``(outputs, pad_before, pad_after)`` of one spatial axis, as TensorFlow pads it."""
    extent = (kernel - 1) * dilation + 1
    if padding == "same":
        outputs = -(-size // stride)
        total = max((outputs - 1) * stride + extent - size, 0)
        return outputs, total // 2, total - total // 2
    return (size - extent) // stride + 1, 0, 0


def conv_patches(layer, inputs):
    """The patches ``layer`` multiplies with its kernel, ``[N*Ho*Wo, kh*kw*cin]``, in the
    row order of ``kernel.reshape(-1, filters)`` (``[..., kh*kw, cin]`` flattened).

    With static spatial sizes, one gather of the padded input's positions at constant
    indices (on CPU up to 7x faster than ``tf.image.extract_patches`` at THOR's benchmark
    shapes, docs/performance.md); otherwise ``extract_patches``."""
    x = tf.cast(_channels_last(layer, inputs), tf.float32)
    kernel_size, strides, dilation = (list(layer.kernel_size), list(layer.strides),
                                      list(layer.dilation_rate))
    padding = layer.padding
    if padding == "causal":        # Conv1D: zeros before the sequence, then 'valid'
        x = tf.pad(x, [[0, 0], [(kernel_size[0] - 1) * dilation[0], 0], [0, 0]])
        padding = "valid"
    if layer.rank == 1:
        x = x[:, tf.newaxis]
        kernel_size, strides, dilation = [1] + kernel_size, [1] + strides, [1] + dilation
    spatial, channels = x.shape[1:3], x.shape[-1]
    if None in spatial or channels is None:
        patches = tf.image.extract_patches(x, sizes=[1] + kernel_size + [1],
                                           strides=[1] + strides + [1],
                                           rates=[1] + dilation + [1],
                                           padding=padding.upper())
        return tf.reshape(patches, [-1, patches.shape[-1]])
    axes = [_patch_axis(*args, padding) for args in zip(spatial, kernel_size, strides, dilation)]
    if any(before or after for _, before, after in axes):
        x = tf.pad(x, [[0, 0]] + [[before, after] for _, before, after in axes] + [[0, 0]])
    (rows, _, _), (columns, _, _) = axes
    width = x.shape[2]
    # Flat position of (output row, output column, kernel row, kernel column).
    row = (np.arange(rows) * strides[0])[:, None, None, None] + (
        np.arange(kernel_size[0]) * dilation[0])[None, None, :, None]
    column = (np.arange(columns) * strides[1])[None, :, None, None] + (
        np.arange(kernel_size[1]) * dilation[1])[None, None, None, :]
    positions = (row * width + column).reshape(-1).astype(np.int32)
    patches = tf.gather(tf.reshape(x, [-1, x.shape[1] * width, channels]), positions, axis=1)
    return tf.reshape(patches, [-1, kernel_size[0] * kernel_size[1] * channels])


@register
@dataclasses.dataclass(frozen=True)
class Conv(KroneckerBlock):
    """``Conv1D`` / ``Conv2D`` (KFC): ``A = E[p p^T]`` over the patches the layer multiplies
    with its kernel (its padding, strides and dilation), ``G`` over output positions."""

    kind: ClassVar[str] = "conv"
    layer_types: ClassVar[tuple] = (keras.layers.Conv1D, keras.layers.Conv2D)
    rule: ClassVar[str] = "Kronecker factors A (patches) and G (output gradient)"

    @classmethod
    def refusal(cls, layer, base):
        reason = super().refusal(layer, base)
        if reason is None and layer.groups != 1:
            reason = f"grouped convolution (groups={layer.groups})"
        return reason

    @classmethod
    def from_layer(cls, layer):
        return _kernel_block(cls, layer, layer.kernel)

    def input_rows(self, layer, inputs):
        return conv_patches(layer, inputs)

    def output_rows(self, layer, delta):
        return _rows(_channels_last(layer, delta), self.g_dim)


@register
@dataclasses.dataclass(frozen=True)
class DepthwiseConv2D(KroneckerBlock):
    """``keras.layers.DepthwiseConv2D``: each input channel its own Kronecker pair, ``A_c``
    over its ``kh*kw`` patch entries and ``G_c`` over its ``depth_multiplier`` outputs
    (factors are per channel, never split further by ``block_size``).

    Attributes:
        channels: input channels (one factor pair each); ``a_dim = kh*kw``,
            ``g_dim = depth_multiplier``.
    """

    channels: int = 1

    kind: ClassVar[str] = "depthwise_conv"
    layer_types: ClassVar[tuple] = (keras.layers.DepthwiseConv2D,)
    rule: ClassVar[str] = "per-channel Kronecker factors A (patch) and G (output gradient)"

    @classmethod
    def from_layer(cls, layer):
        kh, kw, channels, multiplier = tuple(layer.kernel.shape)
        return cls(layer.name, (layer.kernel.name,), kh * kw, multiplier, channels)

    def a_layout(self, block_size):
        return BlockLayout(self.channels * self.a_dim, self.a_dim, self.channels)

    def g_layout(self, block_size):
        return BlockLayout(self.channels * self.g_dim, self.g_dim, self.channels)

    def describe(self, block_size):
        return (f"{self.rule}; {self.channels} channel(s), A {self.a_dim}x{self.a_dim}, "
                f"G {self.g_dim}x{self.g_dim} each")

    def statistics(self, layer, inputs, delta, block_size):
        patches = tf.reshape(conv_patches(layer, inputs), [-1, self.a_dim, self.channels])
        delta = tf.reshape(tf.cast(_channels_last(layer, delta), tf.float32),
                           [-1, self.channels, self.g_dim])
        a = tf.einsum("rac,rbc->cab", patches, patches)
        g = tf.einsum("rca,rcb->cab", delta, delta)
        return a, g, tf.cast(tf.shape(delta)[0], tf.float32)

    def damped_trace(self, a, g, damping, block_size):
        # Block-diagonal over channels: the sum of each channel's Kronecker trace.
        a_traces = tf.linalg.trace(a) + damping[0] * self.a_dim
        g_traces = tf.linalg.trace(g) + damping[1] * self.g_dim
        return tf.reduce_sum(a_traces * g_traces)

    def precondition(self, gradient, state, block_size):
        per_channel = tf.transpose(
            tf.reshape(gradient, [self.a_dim, self.channels, self.g_dim]), [1, 0, 2])
        per_channel = tf.matmul(tf.matmul(state.a_inverse, per_channel), state.g_inverse)
        return tf.reshape(tf.transpose(per_channel, [1, 0, 2]), tf.shape(gradient))


@register
@dataclasses.dataclass(frozen=True)
class Embedding(KroneckerBlock):
    """``keras.layers.Embedding``: diagonal ``A`` (token counts), Kronecker ``G``;
    preconditioned ``diag(a_inv) g G^-1`` with the true inverses."""

    kind: ClassVar[str] = "embedding"
    layer_types: ClassVar[tuple] = (keras.layers.Embedding,)
    rule: ClassVar[str] = "diagonal A (token frequencies), Kronecker factor G"

    @classmethod
    def from_layer(cls, layer):
        return _kernel_block(cls, layer, layer.embeddings)

    def factor_shapes(self, block_size):
        return (self.a_dim,), self.g_layout(block_size).shape

    def describe(self, block_size):
        return (f"{self.rule}; A {self.a_dim}x{self.a_dim}, G {self.g_dim}x{self.g_dim} in "
                f"{self.g_layout(block_size).count} block(s)")

    def capture(self, layer, call, observe, inputs, *args, **kwargs):
        return observe(call(inputs, *args, **kwargs))

    def statistics(self, layer, inputs, delta, block_size):
        delta_rows = self.output_rows(layer, delta)
        ids = tf.reshape(tf.cast(inputs, tf.int32), [-1])
        a = tf.math.unsorted_segment_sum(tf.ones_like(ids, tf.float32), ids, self.a_dim)
        g = covariance_blocks(delta_rows, self.g_layout(block_size))
        return a, g, tf.cast(tf.shape(delta_rows)[0], tf.float32)

    def padded_a(self, a, block_size):
        return a     # the diagonal: inverted elementwise

    def left_precondition(self, matrix, a_inverse, block_size):
        return a_inverse[:, tf.newaxis] * matrix


@register
@dataclasses.dataclass(frozen=True)
class LayerNorm(CurvatureBlock):
    """``keras.layers.LayerNormalization`` gamma and beta:
    ``g / (g*g/batch + sqrt(lambda))`` on every step (no factors)."""

    kind: ClassVar[str] = "layer_norm"
    layer_types: ClassVar[tuple] = (keras.layers.LayerNormalization,)
    rule: ClassVar[str] = "LayerNorm rule g / (g*g/batch + sqrt(damping))"
    has_factors: ClassVar[bool] = False

    @classmethod
    def refusal(cls, layer, base):
        return None

    @classmethod
    def from_layer(cls, layer):
        return cls(layer.name, tuple(v.name for v in compat.own_trainable_variables(layer)))

    def capture(self, layer, call, observe, inputs, *args, **kwargs):
        return observe(call(inputs, *args, **kwargs))

    def precondition(self, gradient, state, block_size):
        # divide_no_nan: a zero gradient with damping 0 stays 0 instead of 0/0.
        return tf.math.divide_no_nan(gradient,
                                     tf.square(gradient) / state.batch + tf.sqrt(state.damping))
