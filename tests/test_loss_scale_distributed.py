"""Loss scaling under MirroredStrategy (two logical CPUs) and MultiWorkerMirroredStrategy (two
local worker processes): one overflow verdict for all replicas.

Keras 3.15's own LossScaleOptimizer follows replica 0's verdict, so an inf on
replica 1 reaches the weights.
"""
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_msopt as mso
from helpers import loss_scale_state, overflow_batches, run_workers, small_mlp


def _local(strategy, variable):
    return [v.numpy() for v in strategy.experimental_local_results(variable.value)]


@pytest.mark.parametrize("bad_replica", [0, 1])
def test_inf_on_one_replica_skips_the_step_everywhere_and_lowers_scale_once(
        two_cpu_strategy, bad_replica):
    strategy = two_cpu_strategy
    with strategy.scope():
        w = keras.Variable([1.0, 1.0])
        optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                           mso.DynamicLossScaleUpdateCell(4.0, 2, 2))
        optimizer.build([w])

    @tf.function
    def step(inf_on):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            scale = tf.convert_to_tensor(optimizer.dynamic_scale)
            grad = tf.where(tf.equal(replica, inf_on), tf.constant([math.inf, 1.0]), 1.0) * scale
            optimizer.apply([grad], [w])
        strategy.run(replica_fn)

    step(tf.constant(bad_replica))
    for values in _local(strategy, w):
        np.testing.assert_array_equal(values, [1.0, 1.0])
    assert [float(s) for s in _local(strategy, optimizer.dynamic_scale)] == [2.0, 2.0]
    assert [int(s) for s in _local(strategy, optimizer.skipped_steps)] == [1, 1]
    assert [int(s) for s in _local(strategy, optimizer.last_step_skipped)] == [1, 1]
    assert int(optimizer.iterations.numpy()) == 0

    step(tf.constant(-1))   # clean: each replica's unscaled gradient 1 is summed to 2
    for values in _local(strategy, w):
        np.testing.assert_allclose(values, [0.8, 0.8], rtol=1e-7)
    assert [float(s) for s in _local(strategy, optimizer.dynamic_scale)] == [2.0, 2.0]
    assert [int(s) for s in _local(strategy, optimizer.last_step_skipped)] == [0, 0]
    assert [int(s) for s in _local(strategy, optimizer.step_counter)] == [1, 1]


class _Trace(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(loss_scale_state(self.model))


def _fit_trace(strategy, batches):
    """``fit`` over ``batches`` in order (under ``strategy``, each global batch is split in
    halves: the first to replica 0, the second to replica 1)."""
    with strategy.scope():
        model = small_mlp()
        model.compile(mso.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                             mso.DynamicLossScaleManager(2.0**10, 2, 3)), "mse")
    x, y = (np.concatenate(parts) for parts in zip(*batches))
    trace = _Trace()
    model.fit(x, y, batch_size=len(batches[0][0]), shuffle=False, verbose=0, callbacks=[trace])
    return trace.steps


@pytest.mark.equivalence
def test_fit_under_mirrored_strategy_matches_one_device(two_cpu_strategy):
    # the overflowing target of steps 2 and 6 is the batch's last sample: replica 1 only
    # (Keras' own LossScaleOptimizer writes it into the weights)
    batches = overflow_batches(steps=8)
    single = _fit_trace(tf.distribute.get_strategy(), batches)
    mirrored = _fit_trace(two_cpu_strategy, batches)
    assert [t["last_skipped"] for t in mirrored] == [0, 0, 1, 0, 0, 0, 1, 0]
    assert [t["scale"] for t in mirrored] == [1024, 1024, 512, 512, 512, 1024, 512, 512]
    for step, (got, want) in enumerate(zip(mirrored, single)):
        for key in ("scale", "counter", "skipped", "last_skipped"):
            assert got[key] == want[key], (step, key)
        for g, w in zip(got["weights"], want["weights"]):
            assert np.isfinite(g).all()
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")


@pytest.mark.slow
def test_multi_worker_inf_on_either_worker_skips_the_step_on_both():
    results = run_workers("""
        import json
        import keras, numpy as np, tensorflow as tf
        import tf_msopt as mso
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            w = keras.Variable([1.0, 1.0])
            optimizer = mso.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                               mso.DynamicLossScaleUpdateCell(4.0, 2, 2))
            optimizer.build([w])

        @tf.function
        def step(inf_on):
            def replica_fn():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                scale = tf.convert_to_tensor(optimizer.dynamic_scale)
                grad = tf.where(tf.equal(replica, inf_on), tf.constant([np.inf, 1.0]), 1.0)
                optimizer.apply([grad * scale], [w])
            strategy.run(replica_fn)

        rows = []
        for inf_on in [1, -1, 0, -1]:
            step(tf.constant(inf_on))
            rows.append([float(optimizer.dynamic_scale.numpy()), w.numpy().tolist(),
                         int(optimizer.skipped_steps.numpy())])
        print(json.dumps({"replicas": strategy.num_replicas_in_sync, "rows": rows}))
    """)
    for result in results:
        assert result["replicas"] == 2
        scales, weights, skipped = zip(*result["rows"])
        assert scales == (2.0, 2.0, 1.0, 1.0) and skipped == (1, 1, 2, 2)
        # clean steps apply the summed unscaled gradients (1 + 1) * 0.1
        np.testing.assert_allclose(weights, [[1.0, 1.0], [0.8, 0.8], [0.8, 0.8], [0.6, 0.6]],
                                   rtol=1e-6)
