"""A NumPy (float64) reference of THOR as DESIGN §4.5 defines it, for the tests.

It has its own small network (forward and backward written out here, convolutions
through an explicit im2col) so that the layer inputs, the pre-activation
gradients and the weight gradients come from code independent of the package.
"""
import math

import numpy as np


def same_padding(size, kernel, stride, dilation=1):
    """TensorFlow's 'same' padding: ``(output size, pad before, pad after)``."""
    effective = (kernel - 1) * dilation + 1
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + effective - size, 0)
    return out, total // 2, total - total // 2


def im2col(x, kernel_size, strides, padding, dilation=(1, 1)):
    """Patches of an NHWC ``x``: ``[N*Ho*Wo, kh*kw*C]`` in ``(i, j, c)`` order."""
    n, h, w, c = x.shape
    geometry = []
    for size, k, s, d in zip((h, w), kernel_size, strides, dilation):
        if padding == "same":
            geometry.append(same_padding(size, k, s, d))
        else:
            geometry.append(((size - (k - 1) * d - 1) // s + 1, 0, 0))
    (ho, top, bottom), (wo, left, right) = geometry
    x = np.pad(x, [(0, 0), (top, bottom), (left, right), (0, 0)])
    kh, kw = kernel_size
    patches = np.empty((n, ho, wo, kh, kw, c))
    for i in range(kh):
        for j in range(kw):
            rows = i * dilation[0] + strides[0] * np.arange(ho)
            cols = j * dilation[1] + strides[1] * np.arange(wo)
            patches[:, :, :, i, j, :] = x[:, rows][:, :, cols]
    return patches.reshape(n * ho * wo, kh * kw * c), (n, ho, wo)


def block_inverse(matrix, damping, block_size):
    """``blockdiag(inv(M_b + damping*I))`` over diagonal blocks of ``block_size`` (None: full)."""
    n = matrix.shape[0]
    size = n if block_size is None else min(n, block_size)
    result = np.zeros_like(matrix)
    for start in range(0, n, size):
        end = min(start + size, n)
        block = matrix[start:end, start:end]
        result[start:end, start:end] = np.linalg.inv(block + damping * np.eye(end - start))
    return result


# ---------------------------------------------------------------------------- network

_ACTIVATIONS = {
    "linear": (lambda z: z, lambda z: np.ones_like(z)),
    "tanh": (np.tanh, lambda z: 1.0 - np.tanh(z) ** 2),
}


class Dense:
    kind = "dense"

    def __init__(self, name, kernel, bias, activation="linear"):
        self.name, self.activation = name, activation
        self.params = {"kernel": np.array(kernel, np.float64), "bias": np.array(bias, np.float64)}

    def forward(self, x):
        self.x = x
        self.z = x @ self.params["kernel"] + self.params["bias"]
        return _ACTIVATIONS[self.activation][0](self.z)

    def backward(self, dy):
        dz = dy * _ACTIVATIONS[self.activation][1](self.z)
        self.grads = {"kernel": self.x.T @ dz, "bias": dz.sum(0)}
        self.observed = (self.x, dz)
        return dz @ self.params["kernel"].T


class Conv2D:
    """A first layer (no input gradient), NHWC."""

    kind = "conv"

    def __init__(self, name, kernel, bias, strides, padding, activation="linear"):
        self.name, self.strides, self.padding, self.activation = name, strides, padding, activation
        self.params = {"kernel": np.array(kernel, np.float64), "bias": np.array(bias, np.float64)}

    def forward(self, x):
        kernel = self.params["kernel"]
        self.patches, (n, ho, wo) = im2col(x, kernel.shape[:2], self.strides, self.padding)
        z = self.patches @ kernel.reshape(-1, kernel.shape[-1]) + self.params["bias"]
        self.z = z.reshape(n, ho, wo, -1)
        return _ACTIVATIONS[self.activation][0](self.z)

    def backward(self, dy):
        dz = dy * _ACTIVATIONS[self.activation][1](self.z)
        rows = dz.reshape(-1, dz.shape[-1])
        kernel = self.params["kernel"]
        self.grads = {"kernel": (self.patches.T @ rows).reshape(kernel.shape),
                      "bias": rows.sum(0)}
        self.observed = (self.patches, dz)
        return None


class EinsumDense:
    """An EinsumDense layer written as the equivalent Dense computation: the last
    ``contracted`` input axes flattened against the kernel viewed as
    ``(contracted axes, output axes)``."""

    kind = "dense"

    def __init__(self, name, kernel, bias, contracted, activation="linear"):
        self.name, self.contracted, self.activation = name, contracted, activation
        self.params = {"kernel": np.array(kernel, np.float64), "bias": np.array(bias, np.float64)}

    def _matrix(self):
        kernel = self.params["kernel"]
        return kernel.reshape(int(np.prod(kernel.shape[:self.contracted])), -1)

    def forward(self, x):
        self.input_shape = x.shape
        self.x = x.reshape(x.shape[:x.ndim - self.contracted] + (-1,))
        self.z = self.x @ self._matrix() + self.params["bias"].reshape(-1)
        out_shape = self.params["kernel"].shape[self.contracted:]
        return _ACTIVATIONS[self.activation][0](self.z).reshape(self.z.shape[:-1] + out_shape)

    def backward(self, dy):
        dz = dy.reshape(self.z.shape) * _ACTIVATIONS[self.activation][1](self.z)
        rows, x_rows = dz.reshape(-1, dz.shape[-1]), self.x.reshape(-1, self.x.shape[-1])
        self.grads = {"kernel": (x_rows.T @ rows).reshape(self.params["kernel"].shape),
                      "bias": rows.sum(0).reshape(self.params["bias"].shape)}
        self.observed = (self.x, dz)
        return (dz @ self._matrix().T).reshape(self.input_shape)


class DepthwiseConv2D:
    """A first layer, NHWC, 'valid' padding: channel c's ``multiplier`` outputs are its
    patches times ``kernel[:, :, c, :]``."""

    kind = "depthwise"

    def __init__(self, name, kernel, bias, strides, activation="linear"):
        self.name, self.strides, self.activation = name, strides, activation
        self.params = {"kernel": np.array(kernel, np.float64), "bias": np.array(bias, np.float64)}

    def forward(self, x):
        kh, kw, channels, multiplier = self.params["kernel"].shape
        patches, (n, ho, wo) = im2col(x, (kh, kw), self.strides, "valid")
        self.patches = patches.reshape(-1, kh * kw, channels)           # rows, kh*kw, C
        kernel = self.params["kernel"].reshape(kh * kw, channels, multiplier)
        z = np.einsum("rkc,kcm->rcm", self.patches, kernel).reshape(n * ho * wo, -1)
        self.z = (z + self.params["bias"]).reshape(n, ho, wo, -1)
        return _ACTIVATIONS[self.activation][0](self.z)

    def backward(self, dy):
        kh, kw, channels, multiplier = self.params["kernel"].shape
        dz = dy * _ACTIVATIONS[self.activation][1](self.z)
        rows = dz.reshape(-1, channels, multiplier)
        kernel_grad = np.einsum("rkc,rcm->kcm", self.patches, rows)
        self.grads = {"kernel": kernel_grad.reshape(self.params["kernel"].shape),
                      "bias": dz.reshape(-1, channels * multiplier).sum(0)}
        self.observed = (self.patches, rows)
        return None


class Embedding:
    """A first layer: integer ids ``[N, T]`` -> ``[N, T, dim]``."""

    kind = "embedding"

    def __init__(self, name, table):
        self.name = name
        self.params = {"embeddings": np.array(table, np.float64)}

    def forward(self, ids):
        self.ids = ids
        return self.params["embeddings"][ids]

    def backward(self, dy):
        grad = np.zeros_like(self.params["embeddings"])
        np.add.at(grad, self.ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))
        self.grads = {"embeddings": grad}
        self.observed = (self.ids, dy)
        return None


class LayerNorm:
    kind = "layer_norm"

    def __init__(self, name, gamma, beta, epsilon=1e-3):
        self.name, self.epsilon = name, epsilon
        self.params = {"gamma": np.array(gamma, np.float64), "beta": np.array(beta, np.float64)}

    def forward(self, x):
        mean = x.mean(-1, keepdims=True)
        self.inv = 1.0 / np.sqrt(x.var(-1, keepdims=True) + self.epsilon)
        self.xhat = (x - mean) * self.inv
        return self.xhat * self.params["gamma"] + self.params["beta"]

    def backward(self, dy):
        self.grads = {"gamma": (dy * self.xhat).sum(0), "beta": dy.sum(0)}
        dxhat = dy * self.params["gamma"]
        return self.inv * (dxhat - dxhat.mean(-1, keepdims=True)
                           - self.xhat * (dxhat * self.xhat).mean(-1, keepdims=True))


class Flatten:
    kind = None
    params = {}

    def forward(self, x):
        self.shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy):
        self.grads = {}
        return dy.reshape(self.shape)


class Network:
    """Layers in sequence with Keras' ``"mse"`` loss (mean over every output entry)."""

    def __init__(self, layers):
        self.layers = layers

    def gradients(self, x, targets):
        out = x
        for layer in self.layers:
            out = layer.forward(out)
        upstream = 2.0 * (out - targets) / out.size
        for layer in reversed(self.layers):
            upstream = layer.backward(upstream)
        return np.mean((out - targets) ** 2)

    def weights(self):
        """``{layer_name/param: array}``."""
        return {f"{layer.name}/{key}": value for layer in self.layers
                for key, value in layer.params.items()}


# ------------------------------------------------------------------------- optimizer


class ThorReference:
    """THOR's update (DESIGN §4.5) on a :class:`Network`, one step per :meth:`step`.

    ``learning_rate`` and ``damping`` are functions of the step; ``decay`` is a
    function of ``"layer/param"`` names.
    """

    def __init__(self, network, learning_rate, damping, momentum, weight_decay=0.0,
                 use_nesterov=False, enable_clip_grad=False, frequency=100, block_size=128,
                 decay=lambda name: True):
        self.network = network
        self.learning_rate, self.damping, self.momentum = learning_rate, damping, momentum
        self.weight_decay, self.use_nesterov = weight_decay, use_nesterov
        self.enable_clip_grad, self.frequency, self.block_size = (enable_clip_grad, frequency,
                                                                  block_size)
        self.decay = decay
        self.velocity = {name: np.zeros_like(w) for name, w in network.weights().items()}
        self.inverses = {}
        self.iterations = 0

    def factors(self, layer, batch):
        """``(A, G)`` of one layer from what its last backward pass observed."""
        inputs, dz = layer.observed
        delta = (dz * batch).reshape(-1, dz.shape[-1])
        g = delta.T @ delta / delta.shape[0]
        if layer.kind == "embedding":
            ids = inputs.reshape(-1)
            return np.bincount(ids, minlength=layer.params["embeddings"].shape[0]) / ids.size, g
        rows = inputs.reshape(-1, inputs.shape[-1])
        return rows.T @ rows / rows.shape[0], g

    def step(self, x, targets):
        step = self.iterations
        self.network.gradients(x, targets)
        batch = x.shape[0]
        root = math.sqrt(self.damping(step))
        if step % self.frequency == 0:
            for layer in self.network.layers:
                if layer.kind == "depthwise":
                    self.inverses[layer.name] = self.depthwise_inverses(layer, batch, root)
                elif layer.kind in ("dense", "conv", "embedding"):
                    a, g = self.factors(layer, batch)
                    a_inverse = (1.0 / (a + root) if layer.kind == "embedding"
                                 else block_inverse(a, root, self.block_size))
                    self.inverses[layer.name] = (a_inverse, block_inverse(g, root,
                                                                          self.block_size))
        for layer in self.network.layers:
            for key, weight in layer.params.items():
                name = f"{layer.name}/{key}"
                grad = layer.grads[key]
                if key == "kernel" and layer.kind == "depthwise":
                    grad = self.depthwise_precondition(grad, *self.inverses[layer.name])
                elif key in ("kernel", "embeddings"):
                    a_inverse, g_inverse = self.inverses[layer.name]
                    matrix = grad.reshape(len(a_inverse), -1)
                    matrix = (a_inverse[:, None] * matrix if layer.kind == "embedding"
                              else a_inverse @ matrix)
                    grad = (matrix @ g_inverse).reshape(grad.shape)
                elif layer.kind == "layer_norm":
                    grad = grad / (grad * grad / batch + root)
                if self.weight_decay and self.decay(name):
                    grad = grad + self.weight_decay * weight
                if self.enable_clip_grad:
                    grad = grad / max(np.linalg.norm(grad), 1.0)
                velocity = self.momentum * self.velocity[name] + grad
                self.velocity[name] = velocity
                lr = self.learning_rate(step)
                update = grad + self.momentum * velocity if self.use_nesterov else velocity
                layer.params[key] = weight - lr * update
        self.iterations += 1

    @staticmethod
    def depthwise_inverses(layer, batch, root):
        """Per channel c: ``inv(A_c + root I)``, ``inv(G_c + root I)`` (whole, no blocks)."""
        patches, rows = layer.observed
        inverses = []
        for c in range(patches.shape[2]):
            x, delta = patches[:, :, c], rows[:, c, :] * batch
            a, g = x.T @ x / x.shape[0], delta.T @ delta / delta.shape[0]
            inverses.append((np.linalg.inv(a + root * np.eye(len(a))),
                             np.linalg.inv(g + root * np.eye(len(g)))))
        return inverses

    @staticmethod
    def depthwise_precondition(grad, *inverses):
        kh, kw, channels, multiplier = grad.shape
        out = np.empty_like(grad)
        for c, (a_inverse, g_inverse) in enumerate(inverses):
            matrix = grad[:, :, c, :].reshape(kh * kw, multiplier)
            out[:, :, c, :] = (a_inverse @ matrix @ g_inverse).reshape(kh, kw, multiplier)
        return out
