"""Adding a layer kind to THOR is one class: a curvature block for a custom layer, defined and
registered here, gets the Kronecker-factored update ``A^-1 g G^-1``."""
import dataclasses
from typing import ClassVar

import keras
import numpy as np
import pytest

import tf_msopt as mso
from tf_msopt.thor.curvature_blocks import REGISTRY, KroneckerBlock, register


class MatMul(keras.layers.Layer):
    """``x @ W``: a layer THOR has no block for."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")

    def call(self, inputs):
        return keras.ops.matmul(inputs, self.kernel)


@pytest.fixture
def matmul_block():
    @register
    @dataclasses.dataclass(frozen=True)
    class MatMulBlock(KroneckerBlock):
        """``MatMul``: ``A = E[x x^T]``, ``G = E[delta delta^T]``."""

        kind: ClassVar[str] = "test_matmul"
        layer_types: ClassVar[tuple] = (MatMul,)
        rule: ClassVar[str] = "Kronecker factors of a test matmul"

        @classmethod
        def from_layer(cls, layer):
            inputs, outputs = layer.kernel.shape
            return cls(layer.name, (layer.kernel.name,), inputs, outputs)

    yield MatMulBlock
    del REGISTRY[MatMulBlock.kind]


def test_a_registered_block_preconditions_its_layer(matmul_block):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), MatMul(3, name="toy")], name="model")
    lr, damping = 0.1, 0.04
    optimizer = mso.thor(model, lr, damping, 0.0, frequency=2, block_size=None)
    model.compile(optimizer=optimizer, loss="mse")
    assert optimizer.report().preconditioned == ["model/toy/kernel"]

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    w = model.get_weights()[0].astype(np.float64)
    model.train_on_batch(x, y)

    n, k = y.shape
    residual = x.astype(np.float64) @ w - y
    d_output = 2.0 * residual / (n * k)               # d mse / d output
    delta = d_output * n                             # per-example output gradient
    a = x.T.astype(np.float64) @ x / n
    g = delta.T @ delta / n
    a_inverse = np.linalg.inv(a + np.sqrt(damping) * np.eye(4))
    g_inverse = np.linalg.inv(g + np.sqrt(damping) * np.eye(3))
    want = w - lr * a_inverse @ (x.T @ d_output) @ g_inverse
    np.testing.assert_allclose(model.get_weights()[0], want, rtol=1e-4, atol=1e-6)
