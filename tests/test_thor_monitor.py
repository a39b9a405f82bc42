"""tf_msopt.thor.Monitor: THOR's health in fit's logs equals THOR's state after each step."""
import glob
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (benchmark_module, curvature_variables, regression_data, small_mlp,
                     two_cpu_mirrored_strategy)

import tf_msopt as mso
from tf_msopt.thor.monitor import thor_state

FREQUENCY, BATCHES, EPOCHS = 2, 5, 2
#: MindSpore's damping per step (a 1-D array: entry i at step i).
DAMPING = np.linspace(0.2, 0.02, BATCHES * EPOCHS).astype("float32")
CONFIGS = {
    # Kept bases: moving averages filled after 4 updates, a tolerance some factors meet.
    "default": lambda model: mso.thor(model, frequency=FREQUENCY, statistics_decay=0.5,
                                      eigenbasis_tolerance=0.05, kl_clip=1e-5),
    "mindspore": lambda model: mso.thor(model, 0.05, DAMPING, 0.9, frequency=FREQUENCY,
                                        kl_clip=1e-5, block_size=4),
    # Kept inverses: the layers the trace rule reuses or freezes.
    "trace_rule": lambda model: mso.thor(model, 0.05, DAMPING, 0.9, frequency=FREQUENCY,
                                         kl_clip=1e-5, trace_thresholds=(0.05, 0.01)),
}


def fit(callbacks=lambda thor: [], config="default", wrap=None, strategy=None):
    """The small MLP trained by ``fit`` (``EPOCHS`` epochs of ``BATCHES`` batches of 16)
    with THOR (inside ``wrap``) and ``callbacks(thor)``; returns the model, THOR and
    ``fit``'s history."""
    with (strategy or tf.distribute.get_strategy()).scope():
        model = small_mlp()
        thor = CONFIGS[config](model)
        model.compile(optimizer=wrap(thor) if wrap else thor, loss="mse")
    x, y = regression_data(n=16 * BATCHES)
    history = model.fit(x, y, batch_size=16, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=callbacks(thor))
    return model, thor, history.history


class Logs(keras.callbacks.Callback):
    """Keeps the THOR entries of each batch's logs."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append({k: v for k, v in logs.items() if k.startswith("thor_")})


class Reference(Logs):
    """Also reads THOR's state itself after each step: its variables, the refresh steps it
    counts and how many factors the step's refresh changed."""

    def __init__(self, thor):
        super().__init__()
        self.thor, self.wanted, self.refreshes, self.last_refresh = thor, [], 0, (0, 0)

    def _factors(self):
        return [v.numpy() for v in curvature_variables(
            self.thor, "a_eigenvectors", "g_eigenvectors", "a_inverse", "g_inverse")]

    def on_train_batch_begin(self, batch, logs=None):
        self.refreshing = int(self.thor.iterations.numpy()) % FREQUENCY == 0
        self.refreshes += self.refreshing
        self.before = self._factors()

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        thor = self.thor
        if self.refreshing:
            changed = sum(not np.array_equal(a, b) for a, b in zip(self.before, self._factors()))
            self.last_refresh = changed, len(self.before) - changed
        wanted = {"thor_kl_factor": float(thor.kl_factor.numpy()),
                  "thor_refreshes": self.refreshes,
                  "thor_bases_recomputed": self.last_refresh[0],
                  "thor_bases_kept": self.last_refresh[1],
                  "thor_damping_retries": int(thor.damping_retries.numpy()),
                  "thor_failed_inverses": int(thor.failed_inverses.numpy())}
        if thor.uses_damping:
            wanted["thor_damping"] = float(DAMPING[int(thor.iterations.numpy()) - 1])
        self.wanted.append(wanted)


def fit_with_reference(update_freq=1, **options):
    """:func:`fit` with the monitor and a :class:`Reference` after it."""
    references = []

    def callbacks(thor):
        references.append(Reference(thor))
        return [mso.thor.Monitor(update_freq=update_freq), references[0]]

    model, thor, history = fit(callbacks, **options)
    reference = references[0]
    assert len(reference.batches) == BATCHES * EPOCHS
    for name in reference.wanted[0]:                  # each epoch's values: its last batch's
        assert history[name] == [r[name] for r in reference.wanted[BATCHES - 1::BATCHES]]
    return model, reference, history


@pytest.mark.parametrize("config", CONFIGS)
def test_logged_values_equal_thors_state_after_each_step(config):
    model, reference, history = fit_with_reference(config=config)
    assert reference.batches == reference.wanted
    assert sorted(history) == sorted(["loss", *reference.wanted[0]])
    counts = {(r["thor_bases_recomputed"], r["thor_bases_kept"]) for r in reference.wanted}
    # The tolerance, or the trace rule, kept some factors; MindSpore's form recomputes all.
    assert (config == "mindspore") == (counts == {(4, 0)})
    assert any(r["thor_kl_factor"] < 1 for r in reference.wanted)
    plain, _, _ = fit(config=config)      # the same weights as without the monitor, to the bit
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(got, want)


def _scalars(log_dir, prefix):
    """``{tag: {step: value}}`` of the ``prefix`` scalars in the TensorBoard events."""
    scalars = {}
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag.startswith(prefix):
                    scalars.setdefault(value.tag[len(prefix):], {})[event.step] = float(
                        tf.make_ndarray(value.tensor))
    return scalars


def test_tensorboard_event_file_holds_the_values(tmp_path):
    pytest.importorskip("tensorboard", reason="keras.callbacks.TensorBoard needs tensorboard")
    # (Keras' TensorBoard writes the epoch's scalars where it writes its last batch's.)
    logs = Logs()
    _, _, history = fit(lambda thor: [mso.thor.Monitor(update_freq=1), logs,
                                      keras.callbacks.TensorBoard(str(tmp_path), update_freq=1)])
    train = str(tmp_path / "train")
    epochs = _scalars(train, "epoch_thor_")
    assert len(epochs) == 6     # no damping in the default configuration
    for name, values in epochs.items():
        assert list(values.values()) == [float(v) for v in history[f"thor_{name}"]], name
    batches = _scalars(train, "batch_thor_")
    assert sorted(batches["refreshes"]) == list(range(1, BATCHES * EPOCHS + 1))
    for step, entries in enumerate(logs.batches, 1):
        for name, value in entries.items():
            assert batches[name[len("thor_"):]][step] == pytest.approx(value, rel=1e-7), name


def test_refuses_a_model_whose_optimizer_is_not_thor():
    model = small_mlp()
    x, y = regression_data(n=16)
    for optimizer, named in ((keras.optimizers.SGD(), "'SGD'"),
                             (mso.LossScaleOptimizer(keras.optimizers.Adam()),
                              "'LossScaleOptimizer' around 'Adam'")):
        model.compile(optimizer=optimizer, loss="mse")
        with pytest.raises(ValueError, match=f"needs a model compiled with THOR .* is {named}"):
            model.fit(x, y, verbose=0, callbacks=[mso.thor.Monitor()])
    for bad in (0, "daily", 2.0, True):
        with pytest.raises(ValueError, match="'update_freq' must be"):
            mso.thor.Monitor(update_freq=bad)


def test_under_mirrored_strategy_with_the_refresh_divided():
    """Each replica refreshes one of the two layers: the counts add up over replicas."""
    _, reference, _ = fit_with_reference(strategy=two_cpu_mirrored_strategy())
    assert reference.batches == reference.wanted
    assert reference.wanted[0]["thor_bases_recomputed"] == 4


@pytest.mark.parametrize("wrap", [
    lambda thor: mso.LossScaleOptimizer(thor, 2.0 ** 8),
    lambda thor: keras.optimizers.LossScaleOptimizer(thor, initial_scale=2.0 ** 8),
], ids=["tf_msopt", "keras"])
def test_inside_a_loss_scale_optimizer(wrap):
    _, reference, _ = fit_with_reference(update_freq=2, wrap=wrap)
    assert reference.batches[1::2] == reference.wanted[1::2]
    assert not any(reference.batches[0::2])


def test_without_a_monitor_thor_counts_no_bases_and_a_later_monitor_retraces():
    """No count (and no op for it in the step) until a monitor asks: then ``fit``'s train
    function, traced by the first ``fit``, is traced again with the count."""
    model, thor, _ = fit()
    assert not thor.readings.counts_refreshed_bases
    assert [int(n) for n in thor.readings.refreshed_bases()] == [0, 0]
    x, y = regression_data(n=16 * BATCHES)
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                        callbacks=[mso.thor.Monitor(update_freq=1)]).history
    assert thor.readings.counts_refreshed_bases
    assert history["thor_bases_recomputed"][-1] + history["thor_bases_kept"][-1] == 4


def test_a_resume_keeps_the_refresh_count_and_the_counters(tmp_path):
    """The counts of the last refresh are not saved: they read 0 until the next refresh."""
    model, thor, _ = fit(lambda thor: [mso.thor.Monitor()])
    path = tf.train.Checkpoint(model=model, optimizer=thor).save(str(tmp_path / "ckpt"))
    restored = small_mlp()
    optimizer = CONFIGS["default"](restored)
    restored.compile(optimizer=optimizer, loss="mse")
    optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=optimizer).restore(path).assert_consumed()
    saved, loaded = thor_state(thor), thor_state(optimizer)
    assert saved.pop("thor_bases_kept") + saved.pop("thor_bases_recomputed") == 4
    assert loaded.pop("thor_bases_kept") == loaded.pop("thor_bases_recomputed") == 0
    assert loaded == saved
    assert loaded["thor_refreshes"] == EPOCHS * BATCHES // FREQUENCY


def test_benchmark_runs_with_tiny_settings(capsys):
    benchmark_module("thor_monitor").main(["--features", "4", "--hidden", "4", "--batch", "4",
                                           "--steps", "2", "--rounds", "1", "--update-freq", "1"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["ratios"]) == {"monitor_vs_without", "monitor_every_1_vs_without"}
