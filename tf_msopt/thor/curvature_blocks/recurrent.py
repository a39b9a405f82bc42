"""Curvature blocks of recurrent layers: ``SimpleRNN``, ``GRU`` and ``LSTM`` (RNN K-FAC).

Each kernel of a recurrent layer is a Dense layer applied at every time step, with the
independence across time steps of Martens, Ba & Johnson (Kronecker-factored Curvature
Approximations for Recurrent Neural Networks, ICLR 2018): rows are the examples' time steps,
and both kernels get a Kronecker pair of their own,

    input kernel W:      A = E[x_t x_t^T],          G = E[delta_t delta_t^T]
    recurrent kernel U:  A = E[h_{t-1} h_{t-1}^T],  G = E[delta_t delta_t^T]

where ``delta_t`` is the gradient of step t's gate pre-activations ``x_t W + h_{t-1} U + b``.
In a GRU (``reset_after=True``) the candidate's recurrent term is ``r * (h_{t-1} U_h + b)``,
so ``U``'s ``delta`` is ``r * delta`` in the candidate's columns.

To observe ``delta``, the capture runs the layer's recurrence itself (Keras' arithmetic
without cuDNN): the input projection ``x W + b`` of every time step at once, which is the
observed tensor, then each step's recurrent part in a ``tf.scan``. A masked step (``Masking``,
``Embedding(mask_zero=True)``) keeps the states, as Keras' loop does, and is no row of the
statistics.
"""
import dataclasses
from typing import ClassVar

import keras
import tensorflow as tf

from tf_msopt.thor.curvature_base import KroneckerBlock, MaskedSteps, register

__all__ = ["RecurrentBlock"]


_CELLS = {keras.layers.SimpleRNN: keras.layers.SimpleRNNCell,
          keras.layers.GRU: keras.layers.GRUCell,
          keras.layers.LSTM: keras.layers.LSTMCell}


@register
@dataclasses.dataclass(frozen=True)
class RecurrentBlock(KroneckerBlock):
    """One kernel of a ``SimpleRNN``, ``GRU`` or ``LSTM`` layer (the layer has two blocks:
    its ``kernel`` and its ``recurrent_kernel``), statistics over time steps.

    Attributes:
        cell: the layer kind, ``"SimpleRNN"``, ``"GRU"`` or ``"LSTM"``.
    """

    cell: str = ""

    kind: ClassVar[str] = "recurrent"
    per_kernel: ClassVar[bool] = True
    layer_types: ClassVar[tuple] = tuple(_CELLS)
    rule: ClassVar[str] = ("Kronecker factors A (its input at each time step) and G (gate "
                           "gradient)")

    @classmethod
    def refusal(cls, layer, base):
        reason = super().refusal(layer, base)
        cell = layer.cell
        if reason is None and type(cell) is not _CELLS[base]:
            reason = f"custom cell {type(cell).__name__}"
        elif reason is None and (cell.dropout or cell.recurrent_dropout):
            reason = ("dropout inside the recurrence (dropout/recurrent_dropout): the "
                      "statistics would not see the dropped inputs; use a Dropout layer "
                      "before it")
        elif reason is None and base is keras.layers.GRU and not cell.reset_after:
            reason = ("reset_after=False: the candidate's recurrent kernel sees r * h, the "
                      "gates' h, so it has no one Kronecker factor")
        return reason

    @classmethod
    def blocks_of(cls, layer):
        cell, base = layer.cell, next(t for t in _CELLS if isinstance(layer, t))
        gates = cell.kernel.shape[-1]
        return tuple(cls(layer.name, (kernel.name,), kernel.shape[0], gates, base.__name__)
                     for kernel in (cell.kernel, cell.recurrent_kernel))

    @classmethod
    def variable_owner(cls, layer):
        return layer.cell

    @property
    def recurrent(self):
        """Whether this is the recurrent kernel's block (else the input kernel's)."""
        return self.variables[0] == "recurrent_kernel"

    def describe(self, block_size):
        side = "recurrent kernel" if self.recurrent else "input kernel"
        return f"{side}: {super().describe(block_size)}"

    def capture(self, layer, call, observe, inputs, *args, **kwargs):
        """Runs ``call`` with the layer's inner loop replaced by :func:`_observed_loop`."""
        def inner_loop(sequences, initial_state, mask, training=False):
            return _observed_loop(layer, observe, sequences, initial_state, mask)

        object.__setattr__(layer, "inner_loop", inner_loop)
        try:
            return call(inputs, *args, **kwargs)
        finally:
            object.__delattr__(layer, "inner_loop")


def _observed_loop(layer, observe, sequences, initial_state, mask):
    """Keras' ``inner_loop`` of ``layer`` (``(last_output, outputs, states)``, outputs in the
    order the steps run), with the input projection observed: its gradient is ``delta``,
    which both kernels' statistics read (``observe``'s pieces: the input kernel's rows ``x_t``,
    the recurrent kernel's ``h_{t-1}``). With a ``mask``, a masked step keeps the states and
    outputs the previous output (zeros with ``zero_output_for_mask``), as Keras' generic loop
    does; its projection then gets no gradient, and its rows are not counted."""
    cell = layer.cell
    states = list(initial_state) if isinstance(initial_state, (list, tuple)) else [
        initial_state]
    input_bias, recurrent_bias = _biases(cell)
    projection = keras.ops.matmul(sequences, cell.kernel)
    if input_bias is not None:
        projection = projection + input_bias
    masked = mask is not None
    if masked:
        mask = tf.cast(mask[0] if isinstance(mask, (list, tuple)) else mask, tf.bool)
    seen = {}

    def rows(values):
        return MaskedSteps(values, tf.cast(mask, tf.float32)) if masked else values

    projection = observe(projection, lambda d: [
        (rows(sequences), d),
        (rows(seen["previous"]), d if seen["scale"] is None else d * seen["scale"])])
    steps = tf.transpose(projection, [1, 0, 2])
    elements = (steps, tf.transpose(mask)) if masked else steps
    if layer.go_backwards:
        elements = tf.nest.map_structure(lambda t: tf.reverse(t, [0]), elements)
    kernel = keras.ops.convert_to_tensor(cell.recurrent_kernel)
    step = _STEPS[type(cell)]
    # Only a GRU scales its recurrent kernel's delta (by r): the others carry no scale.
    scaled = isinstance(cell, keras.layers.GRUCell)

    def scan_step(carry, element):
        projected, keep = element if masked else (element, None)
        new_states, scale = step(cell, projected, carry[0], kernel, recurrent_bias)
        extra = (scale,) if scaled else ()
        if masked:
            keep = keep[:, None]
            held = tf.zeros_like(carry[-1]) if layer.zero_output_for_mask else carry[-1]
            extra += (tf.where(keep, new_states[0], held),)
            new_states = tuple(tf.where(keep, new, old)
                               for new, old in zip(new_states, carry[0]))
        return (new_states, carry[0][0]) + extra

    initializer = ((tuple(states), states[0]) + ((tf.ones_like(steps[0]),) if scaled else ())
                   + ((tf.zeros_like(states[0]),) if masked else ()))
    new_states, previous, *extra = tf.scan(scan_step, elements, initializer=initializer)
    outputs = tf.transpose(extra[-1] if masked else new_states[0], [1, 0, 2])

    def batch_major(t):
        """``[steps, batch, ...]`` in the order the steps ran as ``[batch, steps, ...]`` in
        the sequence's order (the projection's, which the statistics pair them with)."""
        t = tf.reverse(t, [0]) if layer.go_backwards else t
        return tf.stop_gradient(tf.transpose(t, [1, 0, 2]))

    seen["previous"] = batch_major(previous)
    seen["scale"] = batch_major(extra[0]) if scaled else None
    return outputs[:, -1], outputs, [s[-1] for s in new_states]


def _biases(cell):
    """``(input bias, recurrent bias)`` of ``cell`` (None where it has none)."""
    if not cell.use_bias:
        return None, None
    if isinstance(cell, keras.layers.GRUCell):      # reset_after: (2, 3 units)
        return cell.bias[0], cell.bias[1]
    return cell.bias, None


def _simple_rnn_step(cell, projected, states, kernel, recurrent_bias):
    return (cell.activation(projected + tf.matmul(states[0], kernel)),), None


def _gru_step(cell, projected, states, kernel, recurrent_bias):
    """Keras' GRU cell (``reset_after=True``) after the input projection; the scale of
    ``delta`` for the recurrent kernel's rows: 1 for the gates, ``r`` for the candidate."""
    previous = states[0]
    inner = tf.matmul(previous, kernel)
    if recurrent_bias is not None:
        inner = inner + recurrent_bias
    x_z, x_r, x_h = tf.split(projected, 3, axis=-1)
    inner_z, inner_r, inner_h = tf.split(inner, 3, axis=-1)
    z = cell.recurrent_activation(x_z + inner_z)
    r = cell.recurrent_activation(x_r + inner_r)
    candidate = cell.activation(x_h + r * inner_h)
    h = z * previous + (1 - z) * candidate
    return (h,), tf.concat([tf.ones_like(z), tf.ones_like(r), r], -1)


def _lstm_step(cell, projected, states, kernel, recurrent_bias):
    previous, carry = states
    z = projected + tf.matmul(previous, kernel)
    z_i, z_f, z_c, z_o = tf.split(z, 4, axis=-1)
    i = cell.recurrent_activation(z_i)
    f = cell.recurrent_activation(z_f)
    carry = f * carry + i * cell.activation(z_c)
    o = cell.recurrent_activation(z_o)
    return (o * cell.activation(carry), carry), None


_STEPS = {keras.layers.SimpleRNNCell: _simple_rnn_step, keras.layers.GRUCell: _gru_step,
          keras.layers.LSTMCell: _lstm_step}
