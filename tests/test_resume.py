"""Crash recovery: a training process killed with SIGKILL mid-epoch and started again resumes
from its last checkpoint with every optimizer state and ends with the weights of a run that was
never killed. `fit` uses keras.callbacks.BackupAndRestore (saved each epoch); the
custom loop is examples/multi_worker.py with its tf.train.CheckpointManager (every 5 steps).

The optimizers of each mode run as a chain of processes, one start-up per process (most of
this test's time): each process resumes the run its predecessor left killed, trains that
optimizer again never interrupted, then starts the next optimizer's run and dies in it."""
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

mode, runs = json.loads(sys.argv[1])


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


def train(name, loss_scale, directory, kill):
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


for name, loss_scale, directory, kill in runs:   # each from a fresh model
    steps_run.clear()
    model = train(name, loss_scale, directory, kill)
    # Flushed: the next run may kill the process.
    print(json.dumps({"steps_run": len(steps_run),
                      "weights": [w.tolist() for w in model.get_weights()]}), flush=True)
    keras.backend.clear_session()
""" % {"epochs": EPOCHS, "steps": LOOP_STEPS}


#: Per mode, the optimizers (name, loss scaling) that its chain of processes kills and resumes.
CHAINS = {"fit": [("thor", False), ("adam_offload", True), ("addsign", True)],
          "loop": [("thor", True), ("adam_offload", False), ("lars", False)]}


def _run(mode, runs):
    """Runs ``[(name, loss scaling, checkpoint directory or None, kill)]`` in order in one
    fresh process; returns ``(steps trained, weights)`` per run that was not killed (only
    the last run may kill the process)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO_ROOT)
    env.pop("TF_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DRIVER), json.dumps([mode, runs])],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    killed = runs[-1][-1]
    assert result.returncode == (-signal.SIGKILL if killed else 0), result.stderr[-3000:]
    outputs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(outputs) == len(runs) - killed, result.stdout[-3000:]
    return [(out["steps_run"], [np.asarray(w) for w in out["weights"]]) for out in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("mode", CHAINS)
def test_killed_runs_resume_to_the_uninterrupted_weights(mode, tmp_path):
    chain = CHAINS[mode]
    directories = [str(tmp_path / f"{name}-{loss_scale}") for name, loss_scale in chain]
    for i in range(len(chain) + 1):
        runs = [] if i == 0 else [(*chain[i - 1], directories[i - 1], False),  # resumed
                                  (*chain[i - 1], None, False)]               # never killed
        runs += [(*chain[i], directories[i], True)] if i < len(chain) else []
        outputs = _run(mode, runs)
        if i < len(chain):
            assert os.listdir(directories[i]), f"the killed {chain[i]} run left no checkpoint"
        if i == 0:
            continue
        (resumed_steps, resumed), (all_steps, uninterrupted) = outputs
        # fit resumes at the start of epoch 1 (saved at the end of epoch 0); the loop at
        # step 10.
        assert (all_steps, resumed_steps) == ((96, 64) if mode == "fit" else (20, 10)), \
            chain[i - 1]
        for got, want in zip(resumed, uninterrupted):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7,
                                       err_msg=str(chain[i - 1]))
