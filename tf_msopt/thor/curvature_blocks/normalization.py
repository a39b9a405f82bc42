"""The curvature block of ``keras.layers.LayerNormalization``: an elementwise rule on gamma
and beta, no factors."""
import dataclasses
from typing import ClassVar

import keras
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt.thor.curvature_base import CurvatureBlock, register


@register
@dataclasses.dataclass(frozen=True)
class LayerNormBlock(CurvatureBlock):
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
                                     tf.square(gradient) / state.batch + state.root_damping)
