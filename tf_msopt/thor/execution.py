"""How THOR's work runs in the graph: on some steps only, traced once, across replicas.

- :func:`when`: ``fn()`` under a condition, with no conditional where it always holds;
- :class:`TracedOnce`: one ``tf.function`` reused by every trace of a train step;
- :func:`global_batch`, :func:`sum_over_replicas`, :func:`on_each_device` and
  :func:`buckets`: the global batch size, the all-reduce of the statistics (bucketed
  as MindSpore's ``split_indices`` say) and the per-device updates of mirrored state;
- :func:`balanced_owners`, :func:`replica_ids` and :func:`gather_device_values`: a
  refresh divided among the replicas, each part computed on one and gathered by all.
"""
import tensorflow as tf

__all__ = ["TracedOnce", "balanced_owners", "buckets", "device_of", "gather_device_values",
           "global_batch", "on_each_device", "replica_ids", "replicas_in_sync",
           "sum_over_replicas", "when"]


def when(condition, fn):
    """``fn()`` where ``condition`` holds: a ``tf.cond``, or a plain call when ``condition`` is
    the Python ``True`` (a kind of step that every step is, such as statistics every step),
    so that no conditional is built that would always be taken."""
    if condition is True:
        return fn()
    return tf.cond(condition, fn, lambda: tf.constant(False))


class TracedOnce:
    """Calls ``fn`` through one ``tf.function`` while a graph is traced, plainly when eager.

    A step whose first trace builds the optimizer (a custom loop's first ``apply``) is
    traced twice; the statistics and inverses do not depend on the batch, so the second
    trace reuses their graph. Not itself a ``tf.function``, so a SavedModel export does not
    try to save it.
    """

    def __init__(self, fn):
        self._fn = fn
        self._traced = tf.function(fn, autograph=False)

    def __call__(self, *args):
        return self._fn(*args) if tf.executing_eagerly() else self._traced(*args)

    def forget_traces(self):
        """Has the next call in a graph trace ``fn`` anew (what it traces has changed)."""
        self._traced = tf.function(self._fn, autograph=False)


def replicas_in_sync():
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def global_batch(tensor):
    """The first axis of ``tensor`` summed over replicas (replicas get equal shares)."""
    return tf.cast(tf.shape(tensor)[0] * replicas_in_sync(), tf.float32)


def buckets(count, split_indices):
    """Layer indices per all-reduce bucket: MindSpore's ``split_indices`` close buckets."""
    bounds = [i + 1 for i in (split_indices or []) if i + 1 < count] + [count]
    starts = [0] + bounds[:-1]
    return [list(range(start, end)) for start, end in zip(starts, bounds) if end > start]


def sum_over_replicas(distribution, values, destination):
    """All-reduces ``values`` as one batch, onto the devices of the mirrored variable
    ``destination``; unchanged without a strategy."""
    if not tf.distribute.in_cross_replica_context():
        return values
    return distribution.extended.batch_reduce_to(
        tf.distribute.ReduceOp.SUM, [(value, destination.value) for value in values])


def on_each_device(distribution, variable, fn, args):
    """``fn(variable_component, *args)`` on each device of a (mirrored) optimizer variable."""
    if not tf.distribute.in_cross_replica_context():
        return fn(variable.value, *args)
    return distribution.extended.update(variable.value, fn, args=args, group=False)


def balanced_owners(costs, replicas):
    """The replica that computes each of the parts whose ``costs`` are given: the costliest
    part first, each to the replica with the least cost so far (the lowest index among
    equals). Depends only on ``costs`` and ``replicas``, so every worker, restarted or not,
    computes the same assignment."""
    load, owners = [0] * replicas, [0] * len(costs)
    for part in sorted(range(len(costs)), key=lambda index: (-costs[index], index)):
        owner = min(range(replicas), key=lambda replica: (load[replica], replica))
        owners[part] = owner
        load[owner] += costs[part]
    return owners


def replica_ids(distribution):
    """``{device: replica id in the sync group}`` for this worker's devices."""
    ids = distribution.experimental_local_results(
        distribution.experimental_distribute_values_from_function(
            lambda context: context.replica_id_in_sync_group))
    return {_canonical(device): replica
            for device, replica in zip(distribution.extended.worker_devices, ids)}


def gather_device_values(distribution, values):
    """``values`` (``{replica id: vector}`` for this worker's replicas, each on its device)
    of every replica, concatenated in replica order: one all-gather through the strategy's
    collectives."""
    return distribution.gather(_per_replica(distribution, values), axis=0)


def sum_device_values(distribution, values):
    """The sum over every replica of ``values`` (``{replica id: tensor}`` for this worker's
    replicas, each on its device): one all-reduce through the strategy's collectives."""
    return distribution.reduce(tf.distribute.ReduceOp.SUM, _per_replica(distribution, values),
                               axis=None)


def _per_replica(distribution, values):
    """A distributed value from ``{replica id: tensor}``."""
    return distribution.experimental_distribute_values_from_function(
        lambda context: values[context.replica_id_in_sync_group])


def device_of(variable_component):
    """The canonical name of the device a per-device function runs on."""
    return _canonical(variable_component.device)


def _canonical(device):
    return tf.DeviceSpec.from_string(device).to_string()
