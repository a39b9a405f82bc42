"""SavedModel, for every optimizer of the contract suite and its LossScaleOptimizer form.

- Inference: ``model.export`` and ``tf.saved_model.save(model)`` of a model trained with the
  optimizer serve ``predict``'s outputs in a fresh process that never imports tf_msopt, and
  the served functions capture the model's weights alone (THOR's statistics capture stays out
  of inference graphs). THOR also after ``fit`` under MirroredStrategy, with the sampled
  Fisher, and through ``keras.export.ExportArchive``.
- Training: a ``tf.Module`` holding the model, the optimizer and a traced train step saves,
  loads in a fresh process after ``import tf_msopt`` alone, and trains on as the in-memory
  object does; THOR with the sampled Fisher too.

Each form runs every case in one fresh process (one TensorFlow start). Both op paths run the
training forms (marked ``ops_path``); an inference graph holds no optimizer op.
"""
import cases as C
import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import run_fresh_python

import tf_msopt as mso

pytestmark = [pytest.mark.slow]

BATCH = 8
BEFORE, AFTER = 4, 3    # THOR (frequency 3): saved at a stale step; THOR step 6 runs loaded


def _classifier():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3, activation="softmax")])


def _class_labels(y):
    return (y[:, 0] > 0).astype("int32") + (y[:, 1] > 0).astype("int32")


def _trained_models(strategy):
    """``{name: model}``: every case trained with ``train_on_batch``, and THOR's own forms."""
    models = {}
    for name in C.CASES:
        model = C.compiled(name)
        for x, y in C.batches(BEFORE):
            model.train_on_batch(x, y)
        models[name] = model
    x, y = C.data(4 * BATCH)
    with strategy.scope():
        model = C.mlp()
        model.compile(optimizer=C.make("thor", model), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    models["thor_mirrored_fit"] = model
    model = _classifier()
    model.compile(optimizer=mso.thor(model, 0.05, 0.03, 0.9, frequency=3, fisher="sampled",
                                     seed=3), loss="sparse_categorical_crossentropy")
    model.fit(x, _class_labels(y), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    models["thor_sampled"] = model
    return models


SERVE_CODE = """
import json, sys
import numpy as np, tensorflow as tf
x = np.load({probe!r})
results = {{}}
for name, path in {paths!r}.items():
    loaded = tf.saved_model.load(path)
    served = loaded.signatures["serving_default"]
    (argument,) = served.structured_input_signature[1]
    (output,) = served(**{{argument: tf.constant(x)}}).values()
    results[name] = {{"output": output.numpy().tolist(), "captures": len(served.variables)}}
print(json.dumps({{"tf_msopt_imported": any(m.startswith("tf_msopt") for m in sys.modules),
                  "results": results}}))
"""


def test_inference_exports_serve_predict_without_tf_msopt(tmp_path, two_cpu_strategy):
    probe = C.data(16, seed=7)[0]
    np.save(tmp_path / "probe.npy", probe)
    paths, want = {}, {}
    for name, model in _trained_models(two_cpu_strategy).items():
        paths[f"{name}/export"] = str(tmp_path / name / "export")
        model.export(paths[f"{name}/export"], verbose=False)
        paths[f"{name}/saved_model"] = str(tmp_path / name / "saved_model")
        tf.saved_model.save(model, paths[f"{name}/saved_model"])
        want[name] = (model.predict(probe, verbose=0), len(model.weights))
    archive = keras.export.ExportArchive()
    archive.track(model)   # the sampled-Fisher THOR's model
    archive.add_endpoint("serving_default", lambda x: model(x, training=False),
                         input_signature=[tf.TensorSpec((None, 6), tf.float32)])
    paths["thor_sampled/export_archive"] = str(tmp_path / "archive")
    archive.write_out(paths["thor_sampled/export_archive"], verbose=False)

    served = run_fresh_python(SERVE_CODE.format(probe=str(tmp_path / "probe.npy"), paths=paths),
                              timeout=600)
    assert served["tf_msopt_imported"] is False
    for key, got in served["results"].items():
        output, weight_count = want[key.split("/")[0]]
        np.testing.assert_allclose(got["output"], output, rtol=1e-6, atol=1e-6, err_msg=key)
        # The model's weights and nothing of the optimizer's.
        assert got["captures"] == weight_count, key


def _training_module(model, optimizer, step, target_spec):
    """A ``tf.Module`` holding ``model``, ``optimizer``, the model's weights and
    ``step(x, y)`` traced for batches of BATCH (targets as ``target_spec``)."""
    module = tf.Module()
    module.model, module.optimizer, module.weights = model, optimizer, list(model.weights)
    module.step = tf.function(step, input_signature=[tf.TensorSpec((BATCH, 6), tf.float32),
                                                     target_spec])
    return module


def _loop_step(model, optimizer):
    def step(x, y):
        C.loop_step(model, optimizer, x, y)
    return step


TRAIN_CODE = """
import json
import numpy as np, tensorflow as tf
import tf_msopt  # registers the ops the saved steps use
results = {{}}
for name, (path, data) in {paths!r}.items():
    loaded, data = tf.saved_model.load(path), np.load(data)
    for x, y in zip(data["x"], data["y"]):
        loaded.step(tf.constant(x), tf.constant(y))
    results[name] = [w.numpy().tolist() for w in loaded.weights]
print(json.dumps(results))
"""


def _sampled_fisher_module(directory):
    """THOR with the sampled Fisher, saved at a stale step: its loaded step must draw the
    labels the in-memory one draws (their key is the step and the seed, both restored).
    Returns ``(saved path, data path of the steps after it, weights after them)``."""
    x, y = C.data(BATCH * (BEFORE + AFTER))
    labels = _class_labels(y)
    loss = keras.losses.SparseCategoricalCrossentropy()
    model = _classifier()
    optimizer = mso.thor(model, 0.05, 0.03, 0.9, frequency=3, fisher="sampled", seed=3)
    optimizer.set_fisher_loss(loss)

    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        optimizer.apply(tape.gradient(value, model.trainable_variables),
                        model.trainable_variables)

    module = _training_module(model, optimizer, step, tf.TensorSpec((BATCH,), tf.int32))
    chunks = [(x[i:i + BATCH], labels[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    for xb, yb in chunks[:BEFORE]:
        module.step(xb, yb)
    tf.saved_model.save(module, str(directory / "sampled"))
    for xb, yb in chunks[BEFORE:]:
        module.step(xb, yb)
    np.savez(directory / "sampled.npz", x=np.stack([c[0] for c in chunks[BEFORE:]]),
             y=np.stack([c[1] for c in chunks[BEFORE:]]))
    return str(directory / "sampled"), str(directory / "sampled.npz"), C.weights(model)


@pytest.mark.ops_path
def test_training_savedmodel_trains_on_after_import_tf_msopt(tmp_path):
    batches = C.batches(BEFORE + AFTER)
    after = batches[BEFORE:]
    data = str(tmp_path / "data.npz")
    np.savez(data, x=np.stack([x for x, _ in after]), y=np.stack([y for _, y in after]))
    paths, want = {}, {}
    for name in C.CASES:
        model = C.mlp()
        optimizer = C.make(name, model)
        module = _training_module(model, optimizer, _loop_step(model, optimizer),
                                  tf.TensorSpec((BATCH, 2), tf.float32))
        for x, y in batches[:BEFORE]:
            module.step(x, y)
        paths[name] = (str(tmp_path / name), data)
        tf.saved_model.save(module, paths[name][0])
        for x, y in after:
            module.step(x, y)
        want[name] = C.weights(model)
    path, sampled_data, want["thor_sampled"] = _sampled_fisher_module(tmp_path)
    paths["thor_sampled"] = (path, sampled_data)

    got = run_fresh_python(TRAIN_CODE.format(paths=paths), timeout=600)
    for name, weights in want.items():
        for g, w in zip(got[name], weights):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=name)
