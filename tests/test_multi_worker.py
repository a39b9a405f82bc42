"""Every optimizer under MultiWorkerMirroredStrategy: two worker processes on localhost train
with the custom loop of examples/multi_worker.py and end with the weights of single-process
training on the global batch. The same processes train THOR on the mixed model of
tests/test_thor_distributed.py (Conv2D, Embedding, attention, LayerNorm), each worker feeding
its half of every global batch, in MindSpore's form and in the default configuration (whose
refresh the workers divide)."""
import numpy as np
import pytest

from helpers import run_fresh_python, run_workers

CONFIGS = [(name, loss_scale) for name in ("addsign", "powersign", "lars", "adam_offload", "thor")
           for loss_scale in (False, True)]
STEPS = 8

TRAIN_ALL = f"""
    import json, sys
    sys.path.insert(0, "examples")
    sys.path.insert(0, "tests")
    import keras
    import tensorflow as tf
    import multi_worker
    from test_thor_distributed import custom_loop_weights
    from test_thor_training import mixed_model

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    weights = {{}}
    for name, loss_scale in {CONFIGS!r}:
        model = multi_worker.train(strategy, name, loss_scale, steps={STEPS})
        weights[f"{{name}} loss_scale={{loss_scale}}"] = [w.tolist() for w in model.get_weights()]
    initial = [w.tolist() for w in multi_worker.make_model().get_weights()]
    shard = strategy.cluster_resolver.task_id if strategy.num_replicas_in_sync > 1 else None
    keras.backend.clear_session()
    mixed = [w.tolist() for w in custom_loop_weights(strategy, shard=shard)]
    keras.backend.clear_session()
    default = [w.tolist() for w in custom_loop_weights(strategy, shard=shard, default=True)]
    mixed_initial = [w.tolist() for w in mixed_model().get_weights()]
    print(json.dumps({{"replicas": strategy.num_replicas_in_sync, "weights": weights,
                      "initial": initial, "thor_mixed": mixed, "thor_default": default,
                      "thor_mixed_initial": mixed_initial}}))
"""


@pytest.mark.slow
def test_two_workers_equal_one_process_for_every_optimizer():
    single = run_fresh_python(TRAIN_ALL, timeout=600)
    workers = run_workers(TRAIN_ALL, timeout=600)
    assert single["replicas"] == 1
    initial = single["initial"]
    for result in workers:
        assert result["replicas"] == 2
        assert set(result["weights"]) == set(single["weights"]) and len(single["weights"]) == 10
        for config, expected in single["weights"].items():
            for got, want, start in zip(result["weights"][config], expected, initial):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=config)
                # and training moved the weights, so the comparison means something
                assert np.abs(np.asarray(want) - np.asarray(start)).max() > 1e-4, config
        for got, want, start in zip(result["thor_mixed"], single["thor_mixed"],
                                    single["thor_mixed_initial"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg="thor mixed")
        assert max(np.abs(np.asarray(w) - np.asarray(s)).max() for w, s in zip(
            single["thor_mixed"], single["thor_mixed_initial"])) > 1e-4
        # The default configuration, its refresh divided between the workers: both hold the
        # same bits, and one process's weights up to the rounding its eigenbasis steps
        # amplify (tests/test_thor_distributed.py).
        for got, want in zip(result["thor_default"], single["thor_default"]):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg="thor default")
    for got, other in zip(workers[0]["thor_default"], workers[1]["thor_default"]):
        np.testing.assert_array_equal(got, other)
