"""Crash recovery: a training process killed with SIGKILL mid-epoch and started again resumes
from its last checkpoint with every optimizer state and ends with the weights of a run that was
never killed. `fit` uses keras.callbacks.BackupAndRestore (saved each epoch); the
custom loop is examples/multi_worker.py with its tf.train.CheckpointManager (every 5 steps)."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from helpers import REPO_ROOT

EPOCHS = 3          # of 32 batches each (512 samples, batch 16)
LOOP_STEPS = 20

DRIVER = """
import json, os, signal, sys
sys.path.insert(0, "examples")
import keras, tensorflow as tf
import multi_worker

mode, name, loss_scale, runs = json.loads(sys.argv[1])


def crash():
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no atexit: as if the machine died


steps_run = []  # the steps a run trained: a resumed run must not start over


class KillMidEpoch(keras.callbacks.Callback):
    def __init__(self, kill):
        super().__init__()
        self.kill = kill

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        steps_run.append(batch)
        if self.kill and self.epoch == 1 and batch == 10:
            crash()


def train(directory, kill):
    if mode == "fit":
        x, y = multi_worker.make_data()
        model = multi_worker.make_model()
        model.compile(optimizer=multi_worker.make_optimizer(name, model, loss_scale), loss="mse")
        callbacks = [KillMidEpoch(kill)]
        if directory:
            callbacks.insert(0, keras.callbacks.BackupAndRestore(directory))
        model.fit(x, y, batch_size=multi_worker.GLOBAL_BATCH, epochs=%(epochs)d, shuffle=False,
                  callbacks=callbacks, verbose=0)
        return model

    def after_step(step):
        steps_run.append(step)
        if kill and step == 13:
            crash()

    return multi_worker.train(
        tf.distribute.MultiWorkerMirroredStrategy(), name, loss_scale, steps=%(steps)d,
        checkpoint_dir=directory, save_every=5, after_step=after_step)


# Several runs in one process (each from a fresh model) save the start-up of one per run.
for directory, kill in runs:
    steps_run.clear()
    model = train(directory, kill)
    print(json.dumps({"steps_run": len(steps_run),
                      "weights": [w.tolist() for w in model.get_weights()]}))
    keras.backend.clear_session()
""" % {"epochs": EPOCHS, "steps": LOOP_STEPS}


def _run(mode, name, loss_scale, runs):
    """Runs ``[(checkpoint directory or None, kill)]`` in order in one fresh process; returns
    ``(steps trained, weights)`` per run (none when it is killed)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO_ROOT)
    env.pop("TF_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DRIVER), json.dumps([mode, name, loss_scale, runs])],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    if any(kill for _, kill in runs):
        assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
        return None
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(outputs) == len(runs), result.stdout[-3000:]
    return [(out["steps_run"], [np.asarray(w) for w in out["weights"]]) for out in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("mode, name, loss_scale", [
    ("fit", "thor", False), ("fit", "adam_offload", True),
    ("loop", "thor", True), ("loop", "adam_offload", False),
    ("fit", "addsign", True), ("loop", "lars", False),
])
def test_killed_run_resumes_to_the_uninterrupted_weights(mode, name, loss_scale, tmp_path):
    directory = str(tmp_path / "backup")
    _run(mode, name, loss_scale, [(directory, True)])
    assert os.listdir(directory), "the killed run left no checkpoint to resume from"
    # Resumed, then (same process, new model) never interrupted.
    (resumed_steps, resumed), (all_steps, uninterrupted) = _run(
        mode, name, loss_scale, [(directory, False), (None, False)])
    # fit resumes at the start of epoch 1 (saved at the end of epoch 0); the loop at step 10.
    assert (all_steps, resumed_steps) == ((96, 64) if mode == "fit" else (20, 10))
    for got, want in zip(resumed, uninterrupted):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
