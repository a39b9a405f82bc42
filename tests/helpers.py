"""Helpers for tests: fresh-process runs and tiny deterministic models/data."""
import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fresh_python(code, timeout=240):
    """Runs ``code`` in a new Python process; returns the JSON its last stdout line prints."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise AssertionError(f"fresh process failed:\n{result.stdout}\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def regression_data(n=64, features=6, outputs=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, outputs)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(n, outputs))).astype("float32")
    return x, y


def small_mlp(features=6, outputs=2, seed=0):
    """A deterministic two-layer MLP (weights from ``seed``)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(8, activation="tanh", name="fc1"),
        keras.layers.Dense(outputs, name="head"),
    ])
