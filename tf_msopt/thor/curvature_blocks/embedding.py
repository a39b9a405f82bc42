"""The curvature block of ``keras.layers.Embedding``: a diagonal ``A`` of token counts, a
Kronecker ``G``."""
import dataclasses
from typing import ClassVar

import keras
import tensorflow as tf

from tf_msopt.thor.block_diagonal import covariance_blocks
from tf_msopt.thor.curvature_base import KroneckerBlock, register
from tf_msopt.thor.curvature_blocks._shared import _kernel_block


@register
@dataclasses.dataclass(frozen=True)
class EmbeddingBlock(KroneckerBlock):
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

    def left_precondition(self, matrix, a_inverse, block_size, transpose=False):
        return a_inverse[:, tf.newaxis] * matrix    # a diagonal: its own transpose
