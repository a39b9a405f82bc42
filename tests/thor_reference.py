"""A NumPy (float64) reference of THOR as docs/thor.md defines it, for the tests.

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


def adam_step(moments, name, grad, step, beta2=0.999, epsilon=1e-7, exponent=0.5):
    """Adam's step without its first moment at ``step`` (0 for the first), updating the
    second moment ``moments[name]`` (zero before the first step); with an ``exponent`` other
    than 1/2, ``grad / (v_hat + 1e-2 mean(v_hat))^exponent``."""
    moment = beta2 * moments.get(name, 0.0) + (1 - beta2) * grad ** 2
    moments[name] = moment
    estimate = moment / (1 - beta2 ** (step + 1))
    if exponent != 0.5:
        return grad / (estimate + 1e-2 * estimate.mean()) ** exponent
    return grad / (np.sqrt(estimate) + epsilon)


def eigenvectors(matrix):
    """The eigenvectors of a symmetric matrix (or of each of a stack), eigenvalues descending,
    zero where the eigenvalue is at most ``n * eps32 * max`` (float32's rounding level)."""
    values, vectors = np.linalg.eigh(matrix)
    rounding = matrix.shape[-1] * np.finfo(np.float32).eps * values.max(axis=-1, keepdims=True)
    return (vectors * (values > rounding)[..., None, :])[..., ::-1]


def basis_drifts(matrix, basis, block_size):
    """Per diagonal block of ``block_size``: the share of the block's squared Frobenius mass
    off the diagonal of ``Q_b^T P_b Q_b``."""
    n = matrix.shape[0]
    size = n if block_size is None else min(n, block_size)
    drifts = []
    for start in range(0, n, size):
        block, q = (m[start:start + size, start:start + size] for m in (matrix, basis))
        rotated = q.T @ block @ q
        drifts.append(1.0 - np.sum(np.diag(rotated) ** 2) / np.sum(block ** 2))
    return np.array(drifts)


def block_eigenvectors(matrix, block_size):
    """``blockdiag(eigenvectors of M_b)`` (eigenvalues descending) over diagonal blocks of
    ``block_size`` (None: full)."""
    n = matrix.shape[0]
    size = n if block_size is None else min(n, block_size)
    result = np.zeros_like(matrix)
    for start in range(0, n, size):
        end = min(start + size, n)
        result[start:end, start:end] = eigenvectors(matrix[start:end, start:end])
    return result


# ---------------------------------------------------------------------------- network

_ACTIVATIONS = {
    "linear": (lambda z: z, lambda z: np.ones_like(z)),
    "tanh": (np.tanh, lambda z: 1.0 - np.tanh(z) ** 2),
}


class Dense:
    kind = block_kind = "dense"

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


def projects_positions(layer):
    """Whether ``layer`` applies its kernel at each of several positions of an example:
    a Dense-type kernel whose (flattened) input keeps axes besides the batch."""
    return layer.kind == "dense" and layer.x.ndim > 2


class Conv2D:
    """A first layer (no input gradient), NHWC."""

    kind = block_kind = "conv"

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


class Conv2DTranspose:
    """A first layer, NHWC, of output size ``output_size``: the adjoint of the convolution over
    its output (same kernel, strides, padding), so each input position adds
    ``x @ kernel[i, j]^T`` at its strided place of the padded output, which is then cropped.
    The kernel ``(kh, kw, filters, cin)`` is the matrix ``(cin, kh*kw*filters)``."""

    kind = block_kind = "conv_transpose"

    def __init__(self, name, kernel, bias, strides, padding, output_size, activation="linear"):
        self.name, self.strides, self.padding, self.activation = name, strides, padding, activation
        self.output_size = output_size
        self.params = {"kernel": np.array(kernel, np.float64), "bias": np.array(bias, np.float64)}

    def forward(self, x):
        kh, kw, filters, _ = self.params["kernel"].shape
        (n, h, w, _), (ho, wo) = x.shape, self.output_size
        pads = [same_padding(size, k, s)[1:] if self.padding == "same" else (0, 0)
                for size, k, s in zip((ho, wo), (kh, kw), self.strides)]
        padded = np.zeros((n, ho + sum(pads[0]), wo + sum(pads[1]), filters))
        for i in range(kh):
            for j in range(kw):
                rows = i + self.strides[0] * np.arange(h)
                cols = j + self.strides[1] * np.arange(w)
                padded[:, rows[:, None], cols[None, :]] += x @ self.params["kernel"][i, j].T
        self.x = x
        (top, _), (left, _) = pads
        self.z = padded[:, top:top + ho, left:left + wo] + self.params["bias"]
        return _ACTIVATIONS[self.activation][0](self.z)

    def backward(self, dy):
        dz = dy * _ACTIVATIONS[self.activation][1](self.z)
        kernel = self.params["kernel"]
        self.patches, _ = im2col(dz, kernel.shape[:2], self.strides, self.padding)
        x_rows = self.x.reshape(-1, self.x.shape[-1])
        self.grads = {"kernel": (x_rows.T @ self.patches).T.reshape(kernel.shape),
                      "bias": dz.reshape(-1, dz.shape[-1]).sum(0)}
        self.observed = (self.x, dz)
        return None


class EinsumDense:
    """An EinsumDense layer written as the equivalent Dense computation: the last
    ``contracted`` input axes flattened against the kernel viewed as
    ``(contracted axes, output axes)``."""

    kind, block_kind = "dense", "einsum_dense"

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

    kind, block_kind = "depthwise", "depthwise_conv"

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

    kind = block_kind = "embedding"

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
    """THOR's update on a :class:`Network`, one step per :meth:`step`.

    ``learning_rate`` and ``damping`` are functions of the step; ``decay`` is a
    function of ``"layer/param"`` names. The opt-in options follow the THOR class
    docstring: ``damping_mode="pi"`` (factored Tikhonov damping), ``statistics_decay``
    / ``statistics_frequency`` (bias-corrected moving averages of A and G),
    ``kl_clip`` (the KL factor ``nu``) and ``trace_thresholds`` (the trace rule).
    With none of them the computations are those of the plain THOR update.

    After each step: ``kl_factors`` lists every step's ``nu`` (with ``kl_clip``),
    ``traces[layer]`` the last damped trace, ``decisions[layer]`` the counts
    (refreshed, reused, frozen), ``deltas[layer]`` every relative change and
    ``kept_fractions`` each variable's share of entries the ``cautious`` mask keeps.

    In an eigenbasis, with ``compared_bases`` set to a function of a layer giving other
    eigenvectors of its factors (float32's, say), ``basis_deviations["layer/param"]`` bounds,
    to first order, how far the weights have moved from the reference's because every step
    took those bases: each step's move (see :meth:`eigenbasis_step`) carried through the
    step's linear parts (the graft's and the KL clip's scaling, momentum, the learning rate).
    """

    def __init__(self, network, learning_rate, damping, momentum, weight_decay=0.0,
                 use_nesterov=False, enable_clip_grad=False, frequency=100, block_size=128,
                 decay=lambda name: True, damping_mode="sqrt", statistics_decay=None,
                 statistics_frequency=None, kl_clip=None, trace_thresholds=None, graft=None,
                 precondition_inputs=True, preconditioner="inverse", eigenbasis_exponent=None,
                 eigenbasis_tolerance=None, max_rotated_dim=None, statistics_rows=None,
                 cautious=False, replica_division=None):
        del replica_division  # which replica computes what: the same numbers
        self.network = network
        self.learning_rate, self.damping, self.momentum = learning_rate, damping, momentum
        self.weight_decay, self.use_nesterov = weight_decay, use_nesterov
        self.enable_clip_grad, self.frequency, self.block_size = (enable_clip_grad, frequency,
                                                                  block_size)
        self.decay = decay
        self.damping_mode, self.statistics_decay = damping_mode, statistics_decay
        if statistics_frequency is None:
            statistics_frequency = frequency if statistics_decay is None else 1
        self.statistics_frequency = statistics_frequency
        self.kl_clip, self.trace_thresholds = kl_clip, trace_thresholds
        self.graft, self.precondition_inputs = graft, precondition_inputs
        self.preconditioner = preconditioner
        self.eigenbasis_exponent = eigenbasis_exponent
        self.eigenbasis_tolerance, self.max_rotated_dim = eigenbasis_tolerance, max_rotated_dim
        self.statistics_rows = statistics_rows
        # Per refresh of a factor with a tolerance: (kept the previous basis, the largest
        # block's distance from the tolerance).
        self.basis_decisions = []
        self.cautious, self.kept_fractions = cautious, []
        self.rotated_moments, self.second_moments = {}, {}
        self.velocity = {name: np.zeros_like(w) for name, w in network.weights().items()}
        self.inverses, self.bases = {}, {}
        self.compared_bases, self.other_bases = None, {}
        self.basis_effects, self.basis_deviations = {}, {}
        self.velocity_moves = dict.fromkeys(self.velocity, 0.0)
        self.averages, self.counts = {}, {}
        self.traces, self.decisions, self.deltas, self.frozen = {}, {}, {}, set()
        self.kl_factors = []
        self.iterations = 0

    def factors(self, layer, batch):
        """``(A, G)`` of one layer from what its last backward pass observed."""
        inputs, dz = layer.observed
        if self.statistics_rows is not None:     # every stride-th example
            # (A transposed convolution's rows are its input positions.)
            counted = inputs if layer.kind == "conv_transpose" else dz
            rows_per_example = counted.size // counted.shape[0] // counted.shape[-1]
            stride = max(1, dz.shape[0] * rows_per_example // self.statistics_rows)
            if layer.kind == "conv":     # patches: rows example after example
                inputs = inputs.reshape(dz.shape[0], -1, inputs.shape[-1])[::stride].reshape(
                    -1, inputs.shape[-1])
            else:
                inputs = inputs[::stride]
            dz = dz[::stride]
        if layer.kind == "conv_transpose":       # the output gradient's patches
            delta, _ = im2col(dz * batch, layer.params["kernel"].shape[:2], layer.strides,
                              layer.padding)
        else:
            delta = (dz * batch).reshape(-1, dz.shape[-1])
        g = delta.T @ delta / delta.shape[0]
        if layer.kind == "embedding":
            ids = inputs.reshape(-1)
            return np.bincount(ids, minlength=layer.params["embeddings"].shape[0]) / ids.size, g
        rows = inputs.reshape(-1, inputs.shape[-1])
        return rows.T @ rows / rows.shape[0], g

    @staticmethod
    def depthwise_factors(layer, batch):
        """Per channel c, stacked: ``A_c`` ``[C, kh*kw, kh*kw]``, ``G_c`` ``[C, m, m]``."""
        patches, rows = layer.observed
        a_factors, g_factors = [], []
        for c in range(patches.shape[2]):
            x, delta = patches[:, :, c], rows[:, c, :] * batch
            a_factors.append(x.T @ x / x.shape[0])
            g_factors.append(delta.T @ delta / delta.shape[0])
        return np.stack(a_factors), np.stack(g_factors)

    def layer_factors(self, layer, batch):
        if layer.kind == "depthwise":
            return self.depthwise_factors(layer, batch)
        return self.factors(layer, batch)

    @staticmethod
    def traces_and_dims(layer, a, g):
        """``(tr A, dim A, tr G, dim G)`` over real dimensions (depthwise: all channels)."""
        if layer.kind == "embedding":
            a_trace = a.sum()
        else:
            a_trace = np.trace(a, axis1=-2, axis2=-1).sum()
        channels = a.shape[0] if layer.kind == "depthwise" else 1
        g_trace = np.trace(g, axis1=-2, axis2=-1).sum()
        return a_trace, channels * a.shape[-1], g_trace, channels * g.shape[-1]

    def layer_damping(self, layer, a, g, root):
        """``(d_A, d_G)``: ``sqrt(lambda)`` on both, ``pi*sqrt(lambda)`` and ``sqrt(lambda)/pi``,
        or ``sqrt(lambda)`` times each factor's mean eigenvalue ("relative")."""
        if self.damping_mode == "sqrt":
            return root, root
        a_trace, a_dim, g_trace, g_dim = self.traces_and_dims(layer, a, g)
        if self.damping_mode == "relative":
            return (root * (a_trace / a_dim if a_trace > 0 else 1.0),
                    root * (g_trace / g_dim if g_trace > 0 else 1.0))
        if a_trace == 0.0 or g_trace == 0.0:
            pi = 1.0
        else:
            pi = math.sqrt((a_trace / a_dim) / (g_trace / g_dim))
        return root * pi, root / pi

    @staticmethod
    def damped_trace(layer, a, g, a_damping, g_damping):
        """``tr((A + d_A I) kron (G + d_G I))``; depthwise: the sum over channels."""
        if layer.kind == "depthwise":
            a_traces = np.trace(a, axis1=1, axis2=2) + a_damping * a.shape[-1]
            g_traces = np.trace(g, axis1=1, axis2=2) + g_damping * g.shape[-1]
            return float(np.sum(a_traces * g_traces))
        a_trace = a.sum() if layer.kind == "embedding" else np.trace(a)
        return float((a_trace + a_damping * a.shape[-1]) * (np.trace(g) + g_damping * len(g)))

    def trace_rule(self, layer, trace):
        """Whether to invert: the first time, or when ``Delta > omega1``; counts it."""
        omega1, omega2 = self.trace_thresholds
        counts = self.decisions.setdefault(layer.name, [0, 0, 0])
        if layer.name in self.frozen:
            counts[2] += 1
            return False
        previous = self.traces.get(layer.name, 0.0)
        self.traces[layer.name] = trace
        if previous == 0.0:
            counts[0] += 1
            return True
        change = abs(trace - previous) / previous
        self.deltas.setdefault(layer.name, []).append(change)
        for omega in (omega1, omega2):    # float32 and float64 must not disagree
            if abs(change - omega) < 1e-4:
                raise AssertionError(f"{layer.name}: Delta={change} is too close to {omega}")
        if change > omega1:
            counts[0] += 1
            return True
        if change > omega2:
            counts[1] += 1
        else:
            counts[2] += 1
            self.frozen.add(layer.name)
        return False

    def inverses_of(self, layer, a, g, a_damping, g_damping):
        if layer.kind == "depthwise":
            return [(np.linalg.inv(a_c + a_damping * np.eye(len(a_c))),
                     np.linalg.inv(g_c + g_damping * np.eye(len(g_c))))
                    for a_c, g_c in zip(a, g)]
        a_inverse = (1.0 / (a + a_damping) if layer.kind == "embedding"
                     else block_inverse(a, a_damping, self.block_size))
        return a_inverse, block_inverse(g, g_damping, self.block_size)

    def factored_layers(self):
        return [layer for layer in self.network.layers
                if layer.kind in ("dense", "conv", "conv_transpose", "embedding", "depthwise")]

    def update_averages(self, batch):
        beta = self.statistics_decay
        for layer in self.factored_layers():
            stats = self.layer_factors(layer, batch)
            averages = self.averages.get(layer.name, tuple(np.zeros_like(s) for s in stats))
            self.averages[layer.name] = tuple(beta * m + (1.0 - beta) * s
                                              for m, s in zip(averages, stats))
            self.counts[layer.name] = self.counts.get(layer.name, 0) + 1

    def refresh_inverses(self, batch, root):
        for layer in self.factored_layers():
            if self.statistics_decay is None:
                a, g = self.layer_factors(layer, batch)
            else:
                correction = 1.0 - self.statistics_decay ** self.counts[layer.name]
                a, g = (m / correction for m in self.averages[layer.name])
            a_damping, g_damping = self.layer_damping(layer, a, g, root)
            if self.trace_thresholds is not None and not self.trace_rule(
                    layer, self.damped_trace(layer, a, g, a_damping, g_damping)):
                continue
            if self.preconditioner == "eigenbasis":
                self.bases[layer.name] = self.kept_bases(
                    layer, (a, g), self.eigenvectors_of(layer, a, g))
                if self.compared_bases is not None:
                    self.other_bases[layer.name] = self.compared_bases(layer)
            else:
                self.inverses[layer.name] = self.inverses_of(layer, a, g, a_damping, g_damping)

    def eigenvectors_of(self, layer, a, g):
        """``(Q_A, Q_G)`` (per channel for depthwise); ``Q_A`` None where ``A`` is diagonal or
        the input side is not preconditioned, either None where its factor is wider than
        ``max_rotated_dim`` and than the other."""
        inputs = self.precondition_inputs and layer.kind != "embedding"
        if layer.kind == "depthwise":
            return [(eigenvectors(a_c) if inputs else None, eigenvectors(g_c))
                    for a_c, g_c in zip(a, g)]
        rotated = [inputs, True]
        dims = len(a), len(g)
        if self.max_rotated_dim is not None and layer.kind != "embedding":
            rotated = [side and not (dim == max(dims) > self.max_rotated_dim
                                     and min(dims) < dim) for side, dim in zip(rotated, dims)]
        return tuple(block_eigenvectors(factor, self.block_size) if side else None
                     for factor, side in zip((a, g), rotated))

    def kept_bases(self, layer, factors, bases):
        """``bases``, but with ``eigenbasis_tolerance`` each side's previous basis where its
        drift (:func:`basis_drifts`) is at most that in every block, once the moving averages
        have had two time constants of updates (the first previous basis is the identity)."""
        filling = (self.statistics_decay is not None
                   and self.counts[layer.name] < 2 / (1 - self.statistics_decay))
        if self.eigenbasis_tolerance is None or layer.kind == "depthwise" or filling:
            return bases
        previous = self.bases.get(layer.name, (None, None))
        kept = []
        for side, factor, basis, old in zip("ag", factors, bases, previous):
            if basis is None:
                kept.append(None)
                continue
            old = np.eye(len(factor)) if old is None else old
            margins = basis_drifts(factor, old, self.block_size) - self.eigenbasis_tolerance
            keep = bool(np.all(margins <= 0))
            self.basis_decisions.append((keep, np.max(margins), f"{layer.name}.{side}"))
            kept.append(old if keep else basis)
        return tuple(kept)

    def exponent_of(self, kind):
        """The eigenbasis exponent of a layer of the library's block ``kind``."""
        exponent = self.eigenbasis_exponent
        if isinstance(exponent, dict):
            return exponent.get(kind, 0.5)
        return 0.5 if exponent is None else exponent

    def eigenbasis_step(self, layer, grad, step):
        """Adam's step (no first moment) on the gradient in the factors' eigenbases. With
        ``compared_bases`` (a function of the layer giving other eigenvectors, in the layout
        of ``bases``), records in ``basis_effects`` how far the step moves in those bases."""
        exponent = self.exponent_of(layer.block_kind)
        moments = dict(self.rotated_moments)
        step_in_bases = self.rotated_adam_step(layer, self.bases[layer.name], grad,
                                               self.rotated_moments, step, exponent)
        if layer.name in self.other_bases:
            self.basis_effects[layer.name] = np.linalg.norm(step_in_bases - self.rotated_adam_step(
                layer, self.other_bases[layer.name], grad, moments, step, exponent))
        return step_in_bases

    def rotated_adam_step(self, layer, bases, grad, moments, step, exponent):
        depthwise = layer.kind == "depthwise"
        pairs = bases if depthwise else [bases]

        def rotate(matrix, into):
            factors = [(None if a is None else a.T if into else a,
                        None if g is None else g if into else g.T) for a, g in pairs]
            return (self.depthwise_precondition(matrix, factors) if depthwise
                    else self.kernel_precondition(matrix, factors[0],
                                                  layer.kind == "conv_transpose"))

        rotated = rotate(grad, into=True)
        return rotate(adam_step(moments, layer.name, rotated, step, exponent=exponent),
                      into=False)

    @staticmethod
    def kernel_precondition(grad, factors, transposed=False):
        """``L g R`` on the kernel as a matrix (``L`` None: left alone; a vector: diagonal);
        ``transposed``: a transposed convolution's, ``(cin, kh*kw*filters)``."""
        left, right = factors
        shape = grad.shape
        if transposed:
            grad = grad.reshape(-1, shape[-1]).T
        matrix = grad.reshape(-1, len(right)) if right is not None else grad.reshape(len(left), -1)
        if left is not None:
            matrix = left[:, None] * matrix if left.ndim == 1 else left @ matrix
        matrix = matrix if right is None else matrix @ right
        return (matrix.T if transposed else matrix).reshape(shape)

    def preconditioned(self, layer, key, grad, batch, root):
        if self.preconditioner == "eigenbasis" and key in ("kernel", "embeddings"):
            return self.eigenbasis_step(layer, grad, self.iterations)
        if key == "kernel" and layer.kind == "depthwise":
            return self.depthwise_precondition(grad, self.inverses[layer.name],
                                               self.precondition_inputs)
        if key in ("kernel", "embeddings"):
            a_inverse, g_inverse = self.inverses[layer.name]
            return self.kernel_precondition(
                grad, (a_inverse if self.precondition_inputs else None, g_inverse),
                layer.kind == "conv_transpose")
        if layer.kind == "layer_norm":
            return grad / (grad * grad / batch + root)
        return grad

    def step(self, x, targets):
        step = self.iterations
        self.network.gradients(x, targets)
        batch = x.shape[0]
        root = math.sqrt(self.damping(step))
        lr = self.learning_rate(step)
        if self.statistics_decay is not None and step % self.statistics_frequency == 0:
            self.update_averages(batch)
        if step % self.frequency == 0:
            self.refresh_inverses(batch, root)
        factored = self.factored_layers()
        # How far each step moves in the compared bases (see eigenbasis_step), carried
        # through the step's linear parts: scaling, momentum and the learning rate.
        grads, moves = {}, {}
        for layer in self.network.layers:
            for key in layer.params:
                grads[layer.name, key] = self.preconditioned(layer, key, layer.grads[key], batch,
                                                             root)
                moves[layer.name, key] = (self.basis_effects.pop(layer.name, 0.0)
                                          if key in ("kernel", "embeddings") else 0.0)
        if self.graft == "adam":
            self.graft_steps(grads, moves, factored, step)
        if self.kl_clip is not None:
            size = lr ** 2 * abs(sum(np.sum(layer.grads[key] * grads[layer.name, key])
                                     for layer in factored for key in layer.params
                                     if key in ("kernel", "embeddings")))
            nu = min(1.0, math.sqrt(self.kl_clip / size)) if size > 0 else 1.0
            self.kl_factors.append(nu)
            for layer in factored:
                for key in layer.params:
                    if key in ("kernel", "embeddings"):
                        grads[layer.name, key] = nu * grads[layer.name, key]
                        moves[layer.name, key] *= nu
        for layer in self.network.layers:
            for key, weight in layer.params.items():
                name = f"{layer.name}/{key}"
                grad, move = grads[layer.name, key], moves[layer.name, key]
                if self.weight_decay and self.decay(name):
                    grad = grad + self.weight_decay * weight
                if self.enable_clip_grad:
                    clip = max(np.linalg.norm(grad), 1.0)
                    grad, move = grad / clip, move / clip
                if self.graft:
                    grad, move = (1.0 - self.momentum) * grad, (1.0 - self.momentum) * move
                velocity = self.momentum * self.velocity[name] + grad
                self.velocity[name] = velocity
                self.velocity_moves[name] = self.momentum * self.velocity_moves[name] + move
                update = grad + self.momentum * velocity if self.use_nesterov else velocity
                move = (move + self.momentum * self.velocity_moves[name] if self.use_nesterov
                        else self.velocity_moves[name])
                if self.cautious is True or (self.cautious == "sequence" and key == "kernel"
                                             and projects_positions(layer)):
                    agree = (update * grad > 0).astype(np.float64)
                    self.kept_fractions.append(agree.mean())
                    update = update * agree / max(agree.mean(), 1e-3)
                    move /= max(agree.mean(), 1e-3)
                layer.params[key] = weight - lr * update
                self.basis_deviations[name] = self.basis_deviations.get(name, 0.0) + lr * move
        self.iterations += 1

    def graft_steps(self, grads, moves, factored, step):
        """Adam's step length on every direction: factored kernels keep their direction (its
        move in ``moves`` scales with it), every other variable takes Adam's step."""
        for layer in self.network.layers:
            for key in layer.params:
                adam = adam_step(self.second_moments, f"{layer.name}/{key}", layer.grads[key],
                                 step)
                if layer in factored and key in ("kernel", "embeddings"):
                    direction = grads[layer.name, key]
                    norm = np.linalg.norm(direction)
                    scale = np.linalg.norm(adam) / norm if norm > 0 else 0.0
                    grads[layer.name, key] = scale * direction
                    moves[layer.name, key] *= scale
                else:
                    grads[layer.name, key] = adam

    @staticmethod
    def depthwise_precondition(grad, inverses, inputs=True):
        kh, kw, channels, multiplier = grad.shape
        out = np.empty_like(grad)
        for c, (a_inverse, g_inverse) in enumerate(inverses):
            matrix = grad[:, :, c, :].reshape(kh * kw, multiplier)
            if inputs and a_inverse is not None:
                matrix = a_inverse @ matrix
            out[:, :, c, :] = (matrix @ g_inverse).reshape(kh, kw, multiplier)
        return out
