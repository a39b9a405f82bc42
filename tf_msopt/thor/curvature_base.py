"""The base of THOR's curvature blocks: the per-layer classes and their registry.

A curvature block owns, for one layer: which of its variables it treats, how the
layer's statistics are read off its input and output gradient, the shapes of its
factors, how they are damped and inverted, and how a gradient is preconditioned.
The layer kinds are in :mod:`tf_msopt.thor.curvature_blocks`; adding one is one
new class decorated with :func:`register` (the registry maps Keras layer types to
blocks; the first registered class whose ``layer_types`` match wins).

Statistics are sums over rows (the estimator divides by the summed row count):
``a = sum(x x^T)`` over the rows of the kernel's input, ``g = sum(delta delta^T)``
over the rows of the pre-activation output gradient. The positions a Keras mask leaves out
(padding) are no rows.
"""
import dataclasses
import functools
from typing import ClassVar, NamedTuple

import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt.thor.block_diagonal import (BlockLayout, covariance_blocks, left_multiply,
                                          right_multiply, robust_inverses)

__all__ = ["CurvatureBlock", "FactorDamping", "KroneckerBlock", "MaskedSteps", "Preconditioning",
           "REGISTRY", "as_rows", "blocks_for", "from_config", "register"]

REGISTRY = {}


def register(cls):
    """Class decorator: makes ``cls`` the block of its ``layer_types`` (under ``cls.kind``)."""
    REGISTRY[cls.kind] = cls
    return cls


def blocks_for(layer):
    """``(blocks, reason, owner)``: the blocks of a layer THOR treats (reason None), or no
    blocks and why; ``owner`` is the layer that holds the variables they treat (a recurrent
    layer's cell)."""
    for cls in REGISTRY.values():
        base = next((t for t in cls.layer_types if isinstance(layer, t)), None)
        if base is None:
            continue
        reason = cls.refusal(layer, base)
        blocks = () if reason else cls.blocks_of(layer)
        return blocks, reason, cls.variable_owner(layer)
    return (), f"no THOR rule for {type(layer).__name__} layers", layer


def from_config(config):
    """The block a config describes; keys its class has no field for are ignored (configs
    written by other versions may carry them)."""
    config = dict(config)
    cls = REGISTRY[config.pop("kind")]
    fields = {field.name for field in dataclasses.fields(cls)}
    return cls(**{key: tuple(value) if isinstance(value, list) else value
                  for key, value in config.items() if key in fields})


@dataclasses.dataclass(frozen=True)
class FactorDamping:
    """What one layer's factors are damped by: ``A + a I`` and ``G + g I`` (scalars or
    tensors; ``sqrt(lambda)`` each, or shares of it, see
    :mod:`tf_msopt.thor.refresh`)."""

    a: object
    g: object


@dataclasses.dataclass(frozen=True)
class Preconditioning:
    """What a block may need to precondition a gradient (read once per variable).

    ``a_inverse`` and ``g_inverse`` are the matrices a kernel is multiplied by on its input
    and output side: the factors' inverses, or the rotations into and out of their
    eigenbases (``preconditioner="eigenbasis"``). ``a_inverse`` (``g_inverse``) is None where
    the input (output) side is left alone (``precondition_inputs=False``, a diagonal ``A`` in
    an eigenbasis, or a side wider than ``max_rotated_dim``). ``transpose_a`` (``transpose_g``)
    multiplies by the transpose of ``a_inverse`` (``g_inverse``) instead: the matrix product
    reads it transposed, with no transposed copy.
    ``root_damping`` is ``sqrt(lambda)``, what THOR's rules add (the LayerNorm rule's);
    ``batch`` the step's global batch size."""

    a_inverse: object = None
    g_inverse: object = None
    transpose_a: bool = False
    transpose_g: bool = False
    batch: object = None
    root_damping: object = None


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
    #: Whether a layer of this kind has several blocks, one per kernel.
    per_kernel: ClassVar[bool] = False

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

    @classmethod
    def blocks_of(cls, layer):
        """The layer's blocks: one, or one per kernel where a layer has several."""
        return (cls.from_layer(layer),)

    @classmethod
    def variable_owner(cls, layer):
        """The layer whose own variables the blocks of ``layer`` treat."""
        return layer

    @property
    def name(self):
        """The block's name among the optimizer's state: its layer's, followed by its
        kernel's where the layer has a block per kernel."""
        return f"{self.layer}_{self.variables[0]}" if self.per_kernel else self.layer

    def treated_variables(self, layer):
        return [v for v in compat.own_trainable_variables(self.variable_owner(layer))
                if v.name in self.variables]

    def get_config(self):
        config = dataclasses.asdict(self)
        config = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
        return dict(config, kind=self.kind)

    def describe(self, block_size):
        return self.rule

    def projects_positions(self, layer):
        """Whether the layer applies its kernel as a projection at each of several positions
        of an example (a Dense or EinsumDense layer over a sequence, as in a transformer);
        ``cautious="sequence"`` masks these kernels' steps."""
        return False

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
        statistics ``(a, g)``, ``damping`` (a :class:`FactorDamping`) and the ``previous`` inverses
        (for :func:`tf_msopt.thor.block_diagonal.robust_inverses`: several layers' factors are
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
        """``tr((A + damping.a I) kron (G + damping.g I))``, the trace of the damped curvature
        the inverses stand for."""
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


class MaskedSteps(NamedTuple):
    """A kernel's inputs at each position (``[batch, positions..., features]``) and which
    positions count (``[batch, positions...]``, 1 or 0): the rows a masked sequence gives
    the statistics."""

    values: tf.Tensor
    weights: tf.Tensor

    def weigh(self, tensor):
        """``tensor`` (laid out as ``values``) with the rows that do not count zeroed."""
        weights = tf.cast(self.weights, tensor.dtype)
        return tensor * weights[(...,) + (None,) * (tensor.shape.rank - weights.shape.rank)]


def as_rows(tensor, width):
    """``tensor`` as float32 ``[rows, width]``."""
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

    @property
    def kernel_elements(self):
        """How many entries the kernel has."""
        return self.a_dim * self.g_dim

    def describe(self, block_size):
        return (f"{self.rule}; A {self.a_dim}x{self.a_dim} in {self.a_layout(block_size).count} "
                f"block(s), G {self.g_dim}x{self.g_dim} in "
                f"{self.g_layout(block_size).count} block(s)")

    def capture(self, layer, call, observe, inputs, *args, **kwargs):
        weights = self.row_weights(layer, inputs)
        if weights is not None:
            observe = functools.partial(
                observe, pieces=lambda d: [(MaskedSteps(inputs, weights), d)])
        return _pre_activation_capture(layer, call, observe, inputs, *args, **kwargs)

    def row_weights(self, layer, inputs):
        """Which rows of ``inputs`` count (1 or 0, laid out as their positions), where a
        Keras mask says and the block's rows follow it; None: every row."""
        return None

    def input_rows(self, layer, inputs):
        """``[rows, a_dim]``: the kernel's input, one row per use of the kernel."""
        return as_rows(inputs, self.a_dim)

    def output_rows(self, layer, delta):
        """``[rows, g_dim]``: the output gradient, rows in any order."""
        return as_rows(delta, self.g_dim)

    def rows_per_example(self, inputs, delta, block_size):
        """How many rows of statistics one example gives (positions, time steps)."""
        examples = tf.maximum(tf.shape(delta)[0], 1)
        # The output side's whole width (a depthwise layer's: every channel's outputs).
        return tf.size(delta) // examples // self.g_layout(block_size).dim

    def statistics(self, layer, inputs, delta, block_size):
        """Over the rows that count where ``inputs`` is :class:`MaskedSteps` (the others
        zeroed and not counted)."""
        rows = None
        if isinstance(inputs, MaskedSteps):
            rows = tf.reduce_sum(tf.cast(inputs.weights, tf.float32))
            inputs, delta = inputs.weigh(inputs.values), inputs.weigh(delta)
        delta_rows = self.output_rows(layer, delta)
        a = self.input_statistics(self.input_rows(layer, inputs), block_size)
        g = covariance_blocks(delta_rows, self.g_layout(block_size))
        return a, g, tf.cast(tf.shape(delta_rows)[0], tf.float32) if rows is None else rows

    def input_statistics(self, rows, block_size):
        return covariance_blocks(rows, self.a_layout(block_size))

    def inversion_factors(self, a, g, damping, previous, block_size):
        return [(self.padded_a(a, block_size), damping.a, previous[0]),
                (self.g_layout(block_size).with_padding_identity(g), damping.g, previous[1])]

    def padded_a(self, a, block_size):
        return self.a_layout(block_size).with_padding_identity(a)

    def mean_eigenvalues(self, a, g, block_size):
        # Statistics are zero on padded positions (the 1s are added when inverting).
        return (_trace(a) / self.a_layout(block_size).dim,
                _trace(g) / self.g_layout(block_size).dim)

    def damped_trace(self, a, g, damping, block_size):
        a_dim, g_dim = self.a_layout(block_size).dim, self.g_layout(block_size).dim
        return (_trace(a) + damping.a * a_dim) * (_trace(g) + damping.g * g_dim)

    def kernel_matrix(self, gradient):
        return tf.reshape(gradient, [self.a_dim, self.g_dim])

    def kernel_from_matrix(self, matrix, gradient):
        return tf.reshape(matrix, tf.shape(gradient))

    def precondition(self, gradient, state, block_size):
        matrix = self.kernel_matrix(gradient)
        if state.a_inverse is not None:
            matrix = self.left_precondition(matrix, state.a_inverse, block_size,
                                            state.transpose_a)
        if state.g_inverse is not None:
            matrix = right_multiply(matrix, state.g_inverse, self.g_layout(block_size),
                                    state.transpose_g)
        return self.kernel_from_matrix(matrix, gradient)

    def left_precondition(self, matrix, a_inverse, block_size, transpose=False):
        return left_multiply(a_inverse, self.a_layout(block_size), matrix, transpose)
