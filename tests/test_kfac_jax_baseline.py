"""benchmarks/kfac_jax_baseline.py trains the same networks as convergence.py's Keras models.

Needs the ``benchmark`` extra (jax, kfac-jax); skipped where kfac-jax is not installed.
"""
import numpy as np
import pytest

from helpers import benchmark_module

pytest.importorskip("kfac_jax", reason="the kfac-jax baseline needs the benchmark extra")
jax = pytest.importorskip("jax")
convergence = benchmark_module("convergence")
baseline = benchmark_module("kfac_jax_baseline")


@pytest.mark.parametrize("kind", baseline.MODELS)
def test_jax_logits_match_the_keras_model(kind):
    x_train, x_val, y_train, _ = convergence.load_task(kind, 0)
    model = convergence.build_model(kind, x_train.shape[1:], int(y_train.max()) + 1)
    rng = np.random.default_rng(0)
    # Every array perturbed: zero biases, unit gammas and zero betas would hide a misplaced one.
    weights = [w + 0.3 * rng.standard_normal(w.shape).astype(np.float32)
               for w in model.get_weights()]
    model.set_weights(weights)
    x = np.asarray(x_val[:16], np.float32)
    params = baseline.params_from_keras(kind, weights)
    got = baseline.predictions(params, x, kind)
    # The autoencoder's eight float32 layers up to 1000 wide: each framework is 1-2e-4 from a
    # float64 forward pass; a misplaced activation moves its outputs by tenths.
    atol = 5e-4 if kind == "autoencoder" else 1e-5
    np.testing.assert_allclose(np.asarray(got), model.predict(x, verbose=0), atol=atol)


def test_wrong_number_of_weights_names_the_argument():
    data = convergence.load_task("transformer", 0)
    with pytest.raises(ValueError, match="initial_weights"):
        baseline.train_kfac_jax("transformer", data, [np.zeros(3)], epochs=1, batch_size=64,
                                seed=0, learning_rate=0.001, damping=0.001)


def test_adaptive_mode_trains_without_a_learning_rate_or_damping():
    x_train, x_val, y_train, y_val = convergence.load_task("mnist_mlp", 0)
    data = (x_train[:256], x_val[:256], y_train[:256], y_val[:256])
    model = convergence.build_model("mnist_mlp", x_train.shape[1:], 10)
    history = baseline.train_kfac_jax("mnist_mlp", data, model.get_weights(), epochs=1,
                                      batch_size=64, seed=0, adaptive=True)
    assert history["val_accuracy"][0] > 0.3                    # chance is 0.1
    with pytest.raises(ValueError, match="adaptive"):
        baseline.train_kfac_jax("mnist_mlp", data, model.get_weights(), epochs=1,
                                batch_size=64, seed=0)


def test_autoencoder_reports_keras_validation_loss():
    x_train, x_val, _, _ = convergence.load_task("autoencoder", 0)
    data = (x_train[:256], x_val[:256], x_train[:256], x_val[:256])
    model = convergence.build_model("autoencoder", x_train.shape[1:], None)
    model.compile(loss="binary_crossentropy")
    weights = model.get_weights()
    before = model.evaluate(data[1], data[3], verbose=0)
    params = baseline.params_from_keras("autoencoder", weights)
    np.testing.assert_allclose(
        float(baseline._validation(params, data[1], data[3], "autoencoder")), before,
        rtol=1e-5)
    history = baseline.train_kfac_jax("autoencoder", data, weights, epochs=1, batch_size=64,
                                      seed=0, adaptive=True)
    assert history["val_loss"][0] < 0.9 * before
