"""Curvature blocks of convolutions (KFC): ``Conv1D/2D/3D`` (grouped too), their transposes,
``DepthwiseConv1D/2D`` and ``SeparableConv1D/2D``, and the patches they multiply with their
kernels (:func:`conv_patches`)."""
import dataclasses
import math
from typing import ClassVar

import keras
import numpy as np
import tensorflow as tf

from tf_msopt.thor.block_diagonal import BlockLayout
from tf_msopt.thor.curvature_base import KroneckerBlock, as_rows, register
from tf_msopt.thor.curvature_blocks._shared import _built_input_shape, _kernel_block


def _channels_last(layer, tensor):
    if layer.data_format == "channels_first":
        return tf.transpose(tensor, [0] + list(range(2, tensor.shape.rank)) + [1])
    return tensor


def _channel_rows(layer, tensor, width):
    """``tensor`` (in ``layer``'s data format) as rows of its channels, ``[rows, width]``."""
    return as_rows(_channels_last(layer, tensor), width)


def _patch_axis(size, kernel, stride, dilation, padding):
    """``(outputs, pad_before, pad_after)`` of one spatial axis, as TensorFlow pads it."""
    extent = (kernel - 1) * dilation + 1
    if padding == "same":
        outputs = -(-size // stride)
        total = max((outputs - 1) * stride + extent - size, 0)
        return outputs, total // 2, total - total // 2
    return (size - extent) // stride + 1, 0, 0


def _volume_patches_refusal(layer):
    """Why a 3D convolution's patches cannot be taken, or None: with spatial sizes unknown
    until the step, they come from ``tf.extract_volume_patches``, which has no dilation."""
    shape = _built_input_shape(layer)
    if layer.rank != 3 or max(layer.dilation_rate) == 1 or shape is None:
        return None
    spatial = shape[2:] if layer.data_format == "channels_first" else shape[1:-1]
    if None in spatial:
        return "dilated 3D convolution over inputs of unknown size"
    return None


def conv_patches(layer, inputs):
    """The patches ``layer`` multiplies with its kernel, ``[N*Ho*Wo, kh*kw*cin]`` (and a
    depth axis in 3D), in the row order of ``kernel.reshape(-1, filters)`` (``[..., kh*kw,
    cin]`` flattened).

    With static spatial sizes, one gather of the padded input's positions at constant
    indices (on CPU faster than ``tf.image.extract_patches`` at THOR's shapes,
    docs/performance.md); otherwise ``extract_patches`` (``extract_volume_patches`` in 3D)."""
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
    spatial, channels = x.shape[1:-1], x.shape[-1]
    if None in spatial or channels is None:
        if len(spatial) == 3:      # no dilation (:func:`_volume_patches_refusal`)
            patches = tf.extract_volume_patches(x, [1] + kernel_size + [1],
                                                [1] + strides + [1], padding.upper())
        else:
            patches = tf.image.extract_patches(x, sizes=[1] + kernel_size + [1],
                                               strides=[1] + strides + [1],
                                               rates=[1] + dilation + [1],
                                               padding=padding.upper())
        return tf.reshape(patches, [-1, patches.shape[-1]])
    axes = [_patch_axis(size, k, s, d, padding)
            for size, k, s, d in zip(spatial, kernel_size, strides, dilation)]
    if any(before or after for _, before, after in axes):
        x = tf.pad(x, [[0, 0]] + [[before, after] for _, before, after in axes] + [[0, 0]])
    padded = x.shape[1:-1]
    # Flat position of (output position..., kernel offset...): each spatial axis adds its
    # index times the padded sizes after it.
    dims, positions, step = len(padded), 0, 1
    for axis in reversed(range(dims)):
        index = ((np.arange(axes[axis][0]) * strides[axis])[:, None]
                 + (np.arange(kernel_size[axis]) * dilation[axis])[None, :])
        shape = [1] * (2 * dims)
        shape[axis], shape[dims + axis] = index.shape
        positions = positions + index.reshape(shape) * step
        step *= padded[axis]
    positions = np.reshape(positions, -1).astype(np.int32)
    patches = tf.gather(tf.reshape(x, [-1, step, channels]), positions, axis=1)
    return tf.reshape(patches, [-1, math.prod(kernel_size) * channels])


@register
@dataclasses.dataclass(frozen=True)
class ConvBlock(KroneckerBlock):
    """``Conv1D`` / ``Conv2D`` (KFC): ``A = E[p p^T]`` over the patches the layer multiplies
    with its kernel (its padding, strides and dilation), ``G`` over output positions."""

    kind: ClassVar[str] = "conv"
    layer_types: ClassVar[tuple] = (keras.layers.Conv1D, keras.layers.Conv2D,
                                    keras.layers.Conv3D)
    rule: ClassVar[str] = "Kronecker factors A (patches) and G (output gradient)"

    @classmethod
    def refusal(cls, layer, base):
        return super().refusal(layer, base) or _volume_patches_refusal(layer)

    @classmethod
    def blocks_of(cls, layer):
        if layer.groups != 1:
            return (GroupedConvBlock.from_layer(layer),)
        return (_kernel_block(cls, layer, layer.kernel),)

    def input_rows(self, layer, inputs):
        return conv_patches(layer, inputs)

    def output_rows(self, layer, delta):
        return _channel_rows(layer, delta, self.g_dim)


@register
@dataclasses.dataclass(frozen=True)
class ConvTransposeBlock(KroneckerBlock):
    """``Conv1DTranspose`` / ``Conv2DTranspose``: the input gradient of the convolution over
    its output with the same kernel, so the kernel's gradient is ``sum x p^T`` over the input
    positions, ``p`` the patches of the output gradient that convolution would take (its
    padding, strides and dilation). The kernel ``(kh, kw, filters, cin)`` is the matrix
    ``(cin, kh*kw*filters)``: ``A = E[x x^T]`` over input positions,
    ``G = E[p p^T]`` over the output gradient's patches."""

    kind: ClassVar[str] = "conv_transpose"
    layer_types: ClassVar[tuple] = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
                                    keras.layers.Conv3DTranspose)
    rule: ClassVar[str] = ("Kronecker factors A (input) and G (patches of the output "
                           "gradient)")

    @classmethod
    def refusal(cls, layer, base):
        return super().refusal(layer, base) or _volume_patches_refusal(layer)

    @classmethod
    def from_layer(cls, layer):
        shape = tuple(layer.kernel.shape)
        return cls(layer.name, (layer.kernel.name,), shape[-1], math.prod(shape[:-1]))

    def input_rows(self, layer, inputs):
        return _channel_rows(layer, inputs, self.a_dim)

    def output_rows(self, layer, delta):
        return conv_patches(layer, delta)

    def rows_per_example(self, inputs, delta, block_size):
        return tf.size(inputs) // tf.maximum(tf.shape(inputs)[0], 1) // self.a_dim

    def kernel_matrix(self, gradient):
        return tf.transpose(tf.reshape(gradient, [self.g_dim, self.a_dim]))

    def kernel_from_matrix(self, matrix, gradient):
        return tf.reshape(tf.transpose(matrix), tf.shape(gradient))


@register
@dataclasses.dataclass(frozen=True)
class DepthwiseConvBlock(KroneckerBlock):
    """``DepthwiseConv2D`` / ``DepthwiseConv1D``: each input channel its own Kronecker pair,
    ``A_c`` over its ``kh*kw`` patch entries and ``G_c`` over its ``depth_multiplier`` outputs
    (factors are per channel, never split further by ``block_size``).

    Attributes:
        channels: the groups of input channels with a factor pair each: a depthwise layer's
            input channels (``a_dim = kh*kw``, ``g_dim = depth_multiplier``), a grouped
            convolution's groups.
        group_channels: input channels per group (1 for a depthwise layer).
    """

    channels: int = 1
    group_channels: int = 1

    kind: ClassVar[str] = "depthwise_conv"
    layer_types: ClassVar[tuple] = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
    rule: ClassVar[str] = "per-channel Kronecker factors A (patch) and G (output gradient)"
    #: What the report calls the units with a factor pair each.
    unit: ClassVar[str] = "channel"

    @classmethod
    def from_layer(cls, layer):
        return cls._of_kernel(layer, layer.kernel)

    @classmethod
    def _of_kernel(cls, layer, kernel):
        *window, channels, multiplier = tuple(kernel.shape)
        return cls(layer.name, (kernel.name,), math.prod(window), multiplier, channels)

    def a_layout(self, block_size):
        return BlockLayout(self.channels * self.a_dim, self.a_dim, self.channels)

    @property
    def kernel_elements(self):
        return self.channels * self.a_dim * self.g_dim

    def g_layout(self, block_size):
        return BlockLayout(self.channels * self.g_dim, self.g_dim, self.channels)

    def describe(self, block_size):
        return (f"{self.rule}; {self.channels} {self.unit}(s), A {self.a_dim}x{self.a_dim}, "
                f"G {self.g_dim}x{self.g_dim} each")

    def statistics(self, layer, inputs, delta, block_size):
        # Patch entries (window position w, input channel i of group c), as the kernel's.
        window = self.a_dim // self.group_channels
        patches = tf.reshape(conv_patches(layer, inputs),
                             [-1, window, self.channels, self.group_channels])
        delta = tf.reshape(tf.cast(_channels_last(layer, delta), tf.float32),
                           [-1, self.channels, self.g_dim])
        a = tf.reshape(tf.einsum("rwci,rvcj->cwivj", patches, patches),
                       [self.channels, self.a_dim, self.a_dim])
        g = tf.einsum("rca,rcb->cab", delta, delta)
        return a, g, tf.cast(tf.shape(delta)[0], tf.float32)

    def damped_trace(self, a, g, damping, block_size):
        # Block-diagonal over channels: the sum of each channel's Kronecker trace.
        a_traces = tf.linalg.trace(a) + damping.a * self.a_dim
        g_traces = tf.linalg.trace(g) + damping.g * self.g_dim
        return tf.reduce_sum(a_traces * g_traces)

    def precondition(self, gradient, state, block_size):
        per_channel = tf.transpose(
            tf.reshape(gradient, [self.a_dim, self.channels, self.g_dim]), [1, 0, 2])
        if state.a_inverse is not None:
            per_channel = tf.matmul(state.a_inverse, per_channel, transpose_a=state.transpose_a)
        per_channel = tf.matmul(per_channel, state.g_inverse, transpose_b=state.transpose_g)
        return tf.reshape(tf.transpose(per_channel, [1, 0, 2]), tf.shape(gradient))


@register
@dataclasses.dataclass(frozen=True)
class GroupedConvBlock(DepthwiseConvBlock):
    """A ``Conv1D`` / ``Conv2D`` with ``groups > 1`` (ConvNeXt's depthwise convolutions,
    ResNeXt's and RegNet's grouped ones): each group its own Kronecker pair, ``A_c`` over the
    patches of its input channels and ``G_c`` over its outputs, as a ``DepthwiseConv2D``'s
    channels (``channels``: the groups)."""

    kind: ClassVar[str] = "grouped_conv"
    rule: ClassVar[str] = "per-group Kronecker factors A (patches) and G (output gradient)"
    unit: ClassVar[str] = "group"

    @classmethod
    def from_layer(cls, layer):
        *window, group_channels, filters = tuple(layer.kernel.shape)
        return cls(layer.name, (layer.kernel.name,), math.prod(window) * group_channels,
                   filters // layer.groups, layer.groups, group_channels)


@register
@dataclasses.dataclass(frozen=True)
class SeparableDepthwiseBlock(DepthwiseConvBlock):
    """The depthwise kernel of a ``SeparableConv1D`` / ``SeparableConv2D``: a
    ``DepthwiseConv2D``'s per-channel factors, ``G_c`` over the gradient of the depthwise
    output, which is the layer's output gradient through the pointwise kernel. The layer's
    pointwise kernel is its second block (:class:`SeparablePointwiseBlock`): together they
    are the ``DepthwiseConv2D`` and the 1x1 ``Conv2D`` the layer computes."""

    kind: ClassVar[str] = "separable_depthwise"
    layer_types: ClassVar[tuple] = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
    rule: ClassVar[str] = ("per-channel Kronecker factors A (patch) and G (gradient of the "
                           "depthwise output)")
    per_kernel: ClassVar[bool] = True

    @classmethod
    def blocks_of(cls, layer):
        return (cls._of_kernel(layer, layer.depthwise_kernel),
                _kernel_block(SeparablePointwiseBlock, layer, layer.pointwise_kernel))

    def capture(self, layer, call, observe, inputs, *args, **kwargs):
        def pieces(delta):
            """Each kernel's ``(inputs, delta)``: the layer's inputs and the gradient of the
            depthwise output, then the depthwise output (recomputed: the layer's call keeps
            it inside one op) and the layer's output gradient."""
            depthwise = keras.ops.depthwise_conv(
                inputs, tf.cast(layer.depthwise_kernel, inputs.dtype), layer.strides,
                layer.padding, layer.data_format, layer.dilation_rate)
            pointwise = tf.reshape(tf.cast(layer.pointwise_kernel, delta.dtype),
                                   [-1, layer.filters])
            spec = "nf...,cf->nc..." if layer.data_format == "channels_first" else (
                "n...f,cf->n...c")
            return [(inputs, tf.einsum(spec, delta, pointwise)),
                    (tf.stop_gradient(depthwise), delta)]

        return super().capture(layer, call, lambda outputs: observe(outputs, pieces), inputs,
                               *args, **kwargs)


@register
@dataclasses.dataclass(frozen=True)
class SeparablePointwiseBlock(KroneckerBlock):
    """The pointwise kernel of a separable convolution, a 1x1 convolution of the depthwise
    output: ``A`` over the depthwise output's positions, ``G`` over the output gradient's
    (the second block of :class:`SeparableDepthwiseBlock`'s layers)."""

    kind: ClassVar[str] = "separable_pointwise"
    rule: ClassVar[str] = "Kronecker factors A (depthwise output) and G (output gradient)"
    per_kernel: ClassVar[bool] = True

    def input_rows(self, layer, inputs):
        return _channel_rows(layer, inputs, self.a_dim)

    def output_rows(self, layer, delta):
        return _channel_rows(layer, delta, self.g_dim)
