"""Curvature blocks of projections: ``Dense`` and ``EinsumDense`` (the kernel a matrix of
inputs by outputs, statistics over every other axis)."""
import dataclasses
import math
import string
from typing import ClassVar

import keras
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt.thor.curvature_base import KroneckerBlock, as_rows, register
from tf_msopt.thor.curvature_blocks._shared import _built_rank, _kernel_block


@register
@dataclasses.dataclass(frozen=True)
class DenseBlock(KroneckerBlock):
    """``keras.layers.Dense`` (any input rank): ``A = E[x x^T]``, ``G = E[delta delta^T]``."""

    kind: ClassVar[str] = "dense"
    layer_types: ClassVar[tuple] = (keras.layers.Dense,)
    rule: ClassVar[str] = "Kronecker factors A (input) and G (output gradient)"

    @classmethod
    def from_layer(cls, layer):
        return _kernel_block(cls, layer, layer.kernel)

    def projects_positions(self, layer):
        return _built_rank(layer) > 2

    def row_weights(self, layer, inputs):
        return _mask_over(inputs, inputs.shape.rank - 1)


def _mask_over(inputs, positions):
    """The Keras mask ``inputs`` carries, where it covers its first ``positions`` axes (the
    rows of a projection of every position)."""
    mask = compat.keras_mask(inputs)
    return mask if mask is not None and mask.shape.rank == positions else None


def _expand_ellipsis(spec, rank, letters):
    if "..." not in spec:
        return spec
    return spec.replace("...", letters[:rank - (len(spec) - 3)])


@register
@dataclasses.dataclass(frozen=True)
class EinsumDenseBlock(KroneckerBlock):
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

    def projects_positions(self, layer):
        (contracted, _), _ = self._axes(layer.equation)
        return _built_rank(layer) - len(contracted) > 1

    def row_weights(self, layer, inputs):
        # Only where the axes the kernel does not see lead, in the same order on both sides.
        inputs_spec, kernel, output = self._specs(layer.equation)
        batch = [c for c in inputs_spec if c not in kernel]
        if "..." in inputs_spec or inputs_spec[:len(batch)] != "".join(batch) or (
                [c for c in output if c not in kernel] != batch):
            return None
        return _mask_over(inputs, len(batch))

    def _rows_of(self, layer, tensor, spec, kernel_letters, width):
        """``tensor`` (laid out as ``spec``) as ``[rows, width]``: the axes the kernel does
        not see first, then ``kernel_letters``."""
        free = "".join(c for c in string.ascii_letters if c not in layer.equation)
        spec = _expand_ellipsis(spec, tensor.shape.rank, free)
        kernel = self._specs(layer.equation)[1]
        batch = "".join(c for c in spec if c not in kernel)
        return as_rows(tf.einsum(f"{spec}->{batch}{''.join(kernel_letters)}", tensor), width)

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
