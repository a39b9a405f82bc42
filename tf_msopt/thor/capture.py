"""How the curvature statistics of the layers THOR treats are captured.

:func:`install` patches the ``call`` of each treated layer (an instance
attribute; the class is untouched): the block passes the output it observes
through an identity whose gradient function records, on THOR steps only, the
block's statistics of that call (sums over rows) and the row count.

Everything is recorded in the backward pass, and a stale step costs one ``tf.cond`` per
layer. Where no gradient tape is recording (``predict``, ``evaluate``, the functions
``model.export`` and ``tf.saved_model.save`` trace) the patched call is the layer's
own computation alone: inference graphs hold nothing of THOR's. With the sampled
Fisher (:mod:`tf_msopt.thor.sampled_fisher`) the layers only hand their inputs and
outputs to the model-level capture, which records after the forward pass.

A layer called more than once in one call of the model (shared weights) adds the rows of
its later calls to those of its first, as if they were more examples of one call. A layer
that several models share, each connected to its own THOR, feeds the THOR of the model
being called.
"""
import contextlib
import functools
import threading
import weakref

import keras
import tensorflow as tf

from tf_msopt import _keras_compat as compat
from tf_msopt.thor.execution import global_batch, replicas_in_sync, when

__all__ = ["LayerStatistics", "assign", "connect_when_built", "install", "install_model",
           "watch_compile"]

_ORIGINAL = "_tf_msopt_thor_original_{}"
#: The call of a connected model being traced or run (per thread: replicas trace in
#: threads): ``model``, and ``records``, each layer's latest record; None outside one.
_model_call = threading.local()


class LayerStatistics:
    """The buffers one layer's capture writes (per replica) and the optimizer reads.

    They are transient (rewritten on every THOR step), so they are not optimizer
    state and are not saved.
    """

    def __init__(self, block, block_size, weight_sharing="mean", rows=None, shapes=None,
                 steps_per_update=1):
        self.block, self.block_size, self.weight_sharing = block, block_size, weight_sharing
        self.rows_wanted, self.steps_per_update = rows, steps_per_update

        def buffer(shape, name):
            return keras.Variable(initializer="zeros", shape=shape, dtype="float32",
                                  trainable=False, autocast=False, name=f"{block.name}_{name}")

        # A factor no step reads has shape (0,): its statistics are not computed.
        a_shape, g_shape = shapes or block.factor_shapes(block_size)
        self.a = buffer(a_shape, "a_statistics")
        self.g = buffer(g_shape, "g_statistics")
        self.rows = buffer((), "rows")

    def measure(self, layer, inputs, delta):
        """The block's ``(A, G, rows)`` sums over the rows of one call (``delta``'s first axis
        holds its examples). With ``weight_sharing="expand"``, ``G`` is summed over each
        example's positions (its rows per example) instead of averaged with the examples.
        With ``rows`` wanted, every ``s``-th example only, ``s`` the most that leaves at least
        that many rows of the global batch."""
        if self.rows_wanted is not None:
            inputs, delta = self._subsample(inputs, delta)
        a, g, rows = self.block.statistics(layer, inputs, delta, self.block_size)
        # Where a factor is not read its buffer is empty; the computation of its statistics
        # then has no consumer and the traced function drops it.
        a, g = (tf.zeros(buffer.shape) if buffer.shape == (0,) else value
                for buffer, value in ((self.a, a), (self.g, g)))
        if self.weight_sharing == "expand":
            g = g * (rows / tf.cast(tf.shape(delta)[0], tf.float32))
        return a, g, rows

    def _subsample(self, inputs, delta):
        """Every ``s``-th example of ``inputs`` and ``delta``. The stride follows the global
        batch of an update (every replica's share, and with gradient accumulation every
        step's), so that shares it divides keep together the examples one device would
        keep from the whole batch."""
        examples = tf.shape(delta)[0]
        rows_per_example = self.block.rows_per_example(inputs, delta, self.block_size)
        stride = tf.maximum(examples * replicas_in_sync() * self.steps_per_update
                            * rows_per_example // self.rows_wanted, 1)
        # A gather keeps the other axes' static sizes, which a slice with a tensor stride
        # loses (the convolution patches need them).
        kept = tf.range(0, examples, stride)
        # (A recurrent block's masked inputs are a pair of tensors.)
        return (tf.nest.map_structure(lambda t: tf.gather(t, kept), inputs),
                tf.gather(delta, kept))

    def write(self, a, g, rows, after=None):
        """Assigns the three buffers; returns a tensor that depends on the assignments.
        ``after``: what an earlier write of the same call of the model returned (a shared
        layer's earlier call), which this one adds to, after it."""
        update = assign if after is None else assign_add
        with tf.control_dependencies(_after(after)):
            updates = [update(self.a, a), update(self.g, g), update(self.rows, rows)]
        with tf.control_dependencies(updates):
            return tf.constant(True)


def assign(variable, value):
    """``variable.assign(value)`` as an op a control dependency can wait on: Keras' ``assign``
    returns ``value``, so where nothing orders stateful ops (the backward function of a
    ``tf.function`` differentiated from outside it) its assignment would be pruned.
    ``variable`` is a ``keras.Variable`` made with ``autocast=False``: its ``value`` is then
    the ``tf.Variable`` itself, even inside a mixed-precision layer call."""
    return variable.value.assign(value, read_value=False)


def assign_add(variable, value):
    """``variable.assign_add(value)``, as :func:`assign`."""
    return variable.value.assign_add(value, read_value=False)


@contextlib.contextmanager
def model_call(model):
    """One call of ``model`` (a nested one joins the outer): its layers feed the THOR
    connected through it, and the records of a layer's later calls within it add to its
    first's."""
    outer = getattr(_model_call, "records", None)
    if outer is None:
        _model_call.model, _model_call.records = model, {}
    try:
        yield
    finally:
        if outer is None:
            _model_call.model = _model_call.records = None


def _after(token):
    """A control dependency on ``token`` (an earlier write) where one can be taken: in the
    graph being built, which need not order stateful ops itself (a backward function)."""
    if token is None or tf.executing_eagerly() or (
            token.graph is not tf.compat.v1.get_default_graph()):
        return []
    return [token]


def _observe(output, record):
    """``output`` unchanged; in the backward pass ``record(d_output)`` runs beside the
    gradient.

    Where every stateful op runs anyway (eagerly, or traced under ``tf.function``'s
    automatic control dependencies, which also order the write before the optimizer reads
    the buffers), the gradient flows on without waiting for the record, and the layers
    below do not queue behind it (docs/performance.md). Elsewhere (the backward function
    of a ``tf.function`` differentiated from outside it) the gradient waits for it, or the
    record would be pruned.
    """
    @tf.custom_gradient
    def identity(value):
        def grad(upstream):
            written = record(upstream)
            if compat.runs_every_stateful_op():
                return upstream
            with tf.control_dependencies([written]):
                return tf.identity(upstream)
        return tf.identity(value), grad
    return identity(output)


class _Capture:
    """One layer's call as one connection captures it: its first block runs the call and
    observes the output whose gradient every block of the layer reads."""

    def __init__(self, layer, blocks, original, statistics, batch, is_statistics_step,
                 in_use, sampled):
        self.layer, self.blocks, self.original = layer, blocks, original
        self.statistics, self.batch = statistics, batch
        self.is_statistics_step, self.in_use, self.sampled = is_statistics_step, in_use, sampled

    def __call__(self, inputs, *args, **kwargs):
        if not (compat.gradient_may_be_recorded() and self.in_use()):
            # No gradient can be taken (predict, evaluate, serving functions), or the model
            # trains with another optimizer: nothing to record, and the graph holds nothing
            # of THOR's.
            return self.original(inputs, *args, **kwargs)
        if self.statistics is None:       # no factors: only the global batch is needed
            def observe(outputs, pieces=None):
                return _observe(outputs, lambda d: assign(self.batch, global_batch(d)))
        else:
            # Outside a call of the model (a layer called directly) this call stands alone.
            records = getattr(_model_call, "records", None)
            records = {} if records is None else records

            def observe(outputs, pieces=None):
                """``pieces(d)``: each block's ``(inputs, delta)`` from the gradient ``d`` of
                ``outputs``; by default the call's inputs and ``d``."""
                pieces = pieces or (lambda d: [(inputs, d)])
                if self.sampled is not None:
                    return self.sampled.observe(self.layer, self.statistics, pieces, outputs)
                return _observe(outputs, lambda d: self._record(pieces(d), records))
        return self.blocks[0].capture(self.layer, self.original, observe, inputs, *args,
                                      **kwargs)

    def _record(self, pieces, records):
        """Writes the statistics of one call; where this layer already recorded in the same
        call of the model, adds to them, after that record."""
        earlier = records.get(self)

        def write():
            return tf.reduce_all([statistics.write(*statistics.measure(
                self.layer, inputs, tf.cast(delta, tf.float32) * global_batch(delta)),
                after=earlier)
                for statistics, (inputs, delta) in zip(self.statistics, pieces)])

        # (Inside a conditional the earlier record is outside its graph: order the whole.)
        with tf.control_dependencies(_after(earlier)):
            records[self] = when(self.is_statistics_step(), write)
        return records[self]


def _patch(target, name, make):
    """Replaces ``target.<name>`` by ``make(original)`` (an instance attribute; the class is
    untouched; an earlier patch is undone first)."""
    key = _ORIGINAL.format(name)
    original = target.__dict__.get(key, getattr(target, name))
    object.__setattr__(target, key, original)
    object.__setattr__(target, name, make(original))


class _Captures:
    """The patched ``call`` of a layer: in a call of a connected model, the layer's capture
    for that model (one per model, its latest connection's; none where that model's THOR
    does not treat the layer); called outside one, the latest capture installed."""

    def __init__(self, original):
        self.original = original
        self.by_model = weakref.WeakKeyDictionary()
        self.latest = None

    def __call__(self, *args, **kwargs):
        model = getattr(_model_call, "model", None)
        capture = self.latest if model is None else self.by_model.get(model)
        return (capture or self.original)(*args, **kwargs)


def install(layer, model, blocks, statistics, batch, is_statistics_step, in_use,
            sampled=None):
    """Patches ``layer.call`` to capture, in calls of ``model``, the statistics of its
    ``blocks`` into their ``statistics`` buffers (None for blocks without factors) while
    ``in_use()``, replacing an earlier patch for ``model``; with ``sampled`` (a
    :class:`~tf_msopt.thor.sampled_fisher.SampledFisher`) the layer hands its statistics'
    inputs to it instead of recording them itself."""
    captures = layer.__dict__.get("call")
    if not isinstance(captures, _Captures):
        captures = _Captures(layer.call)
        object.__setattr__(layer, "call", captures)
    captures.latest = captures.by_model[model] = _Capture(
        layer, blocks, captures.original, statistics, batch, is_statistics_step, in_use, sampled)


def connect_when_built(model, building):
    """Patches ``model``'s build before tracing as :func:`install_model` does, with
    ``building()`` (a context manager) entered around it: Keras builds the layers there, then
    the optimizer, whose build connects THOR to them."""
    def make(original):
        def build(iterator=None, data_batch=None):
            with building():
                return compat.symbolic_build(model, original, iterator, data_batch)
        return build
    _patch(model, compat.SYMBOLIC_BUILD, make)


def install_model(model, sampled, in_use):
    """Patches ``model.call`` to mark one call of the model (:func:`model_call`) and, for the
    sampled Fisher, to record its statistics while ``in_use()``, and the model's build
    before tracing (:func:`tf_msopt._keras_compat.symbolic_build`), so that ``fit`` traces
    its train step once."""
    def make(original):
        recording = original if sampled is None else sampled.wrap(original)

        @functools.wraps(original)
        def one_model_call(*args, **kwargs):
            with model_call(model):
                return (recording if in_use() else original)(*args, **kwargs)
        return one_model_call
    _patch(model, "call", make)
    _patch(model, compat.SYMBOLIC_BUILD, lambda original: functools.partial(
        compat.symbolic_build, model, original))


def watch_compile(model, compiled_with):
    """Patches ``model.compile`` to call ``compiled_with(model, optimizer)`` once it has
    compiled the model with an ``optimizer`` given (Keras' default, given none, changes
    nothing: a custom training loop compiles for its loss and metrics alone)."""
    def make(original):
        @functools.wraps(original)
        def compile(*args, **kwargs):
            compiled = original(*args, **kwargs)
            optimizer = args[0] if args else kwargs.get("optimizer")
            if optimizer is not None:
                compiled_with(model, optimizer)
            return compiled
        return compile
    _patch(model, "compile", make)
