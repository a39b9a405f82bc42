"""Helpers for tests: fresh-process runs and tiny deterministic models/data."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv

import keras
import numpy as np
import tensorflow as tf

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def two_cpu_mirrored_strategy():
    """MirroredStrategy over two logical CPUs (2 replicas), with collective keys of its own.

    TensorFlow caches each collective instance (its shape) by group and instance
    key for the whole process, and every MirroredStrategy starts from the same
    keys, so without the bump a later strategy's all-reduce can be matched
    against a shape left by an earlier test ("Shape mismatch in the collective
    instance").
    """
    tf.distribute.MirroredStrategy._collective_key_base += 1000
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def use_backend(monkeypatch, backend, kernel, source):
    """Selects the compiled op ``kernel`` ("kernel", which must be loaded: ``source`` is the
    file in custom_ops/ that defines it) or the pure-TF path ("pure_tf")."""
    from tf_msopt.ops import _loader

    if backend == "pure_tf":
        monkeypatch.setenv(_loader.DISABLE_ENV, "1")
        return
    monkeypatch.delenv(_loader.DISABLE_ENV, raising=False)
    assert hasattr(_loader.load_custom_ops(), kernel), (
        f"{kernel} is not loaded ({_loader.custom_ops_status()}; a library built before "
        f"custom_ops/{source} existed lacks it: rebuild with setup.py)")


def benchmark_module(name):
    """``benchmarks/<name>.py`` imported as a module (the folder is not a package), with the
    folder on ``sys.path`` as when it runs as a script (benchmarks import ``timing``)."""
    folder = os.path.join(REPO_ROOT, "benchmarks")
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Code that makes a fresh process record, in ``converted``, the module of every function
#: whose source AutoGraph reads to convert it (it reads them through inspect.findsource).
#: A fresh process, because AutoGraph keeps its conversions for the process's life.
RECORD_AUTOGRAPH = """
import functools, inspect, json, sys
sys.path[:0] = ["tests", "tests/contract"]
import tensorflow as tf
converted, find_source = set(), inspect.findsource
def recording(entity):
    converted.add(getattr(entity, "__module__", "") or "")
    return find_source(entity)
inspect.findsource = recording
def package_code_converted(function, *args):
    \"\"\"The package's modules AutoGraph converts while it traces ``function(*args)`` (a
    function whose source it can read) in a tf.function, as a custom loop's.\"\"\"
    converted.clear()
    tf.function(functools.partial(function, *args))()
    return sorted(module for module in converted if module.startswith("tf_msopt"))
"""


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


def overflow_batches(steps=10, overflow_steps=(2, 6), batch=8, seed=0):
    """``steps`` regression batches; in each of ``overflow_steps`` the last target is inf,
    so that step's gradients overflow (under MirroredStrategy: on the last replica only)."""
    x, y = regression_data(n=steps * batch, seed=seed)
    y = y.copy()
    for step in overflow_steps:
        y[(step + 1) * batch - 1] = np.inf
    return [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(steps)]


def loss_scale_state(model):
    """The loss-scale state of a model compiled with a tf_msopt.LossScaleOptimizer, and its
    weights (JSON-ready)."""
    optimizer = model.optimizer
    return {
        "scale": float(optimizer.dynamic_scale.numpy()),
        "counter": int(optimizer.step_counter.numpy()),
        "skipped": int(optimizer.skipped_steps.numpy()),
        "last_skipped": int(optimizer.last_step_skipped.numpy()),
        "weights": [w.tolist() for w in model.get_weights()],
    }


def loss_scale_trace(model, batches):
    """Trains ``model`` one batch at a time (``train_on_batch``); returns
    :func:`loss_scale_state` after each step."""
    trace = []
    for x, y in batches:
        model.train_on_batch(x, y)
        trace.append(loss_scale_state(model))
    return trace


def _free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def run_workers(code, workers=2, timeout=240):
    """Runs ``code`` in ``workers`` fresh processes that form a MultiWorkerMirroredStrategy
    cluster on localhost (``TF_CONFIG`` set; each process sees one CPU device); returns the
    JSON that each one's last stdout line prints, in worker order."""
    cluster = {"worker": [f"localhost:{_free_port()}" for _ in range(workers)]}
    processes = []
    for index in range(workers):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO_ROOT, TF_CONFIG=tf_config)
        processes.append(subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT))
    results = []
    try:
        for index, process in enumerate(processes):
            stdout, stderr = process.communicate(timeout=timeout)
            if process.returncode != 0:
                raise AssertionError(f"worker {index} failed:\n{stdout}\n{stderr[-4000:]}")
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return results


def kernel_gradients(layer, shape, kernels, seed=0, call=None):
    """``(x, delta, gradients)``: a random input of ``shape``, and the gradients of a random
    linear function of ``layer``'s output (computed by ``call``, else the layer) with respect
    to that output and to the layer's variables named ``kernels``."""
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=shape), tf.float32)
    if not layer.built:
        layer.build(shape)
    with tf.GradientTape() as tape:
        y = (call or layer)(x)
        loss = tf.reduce_sum(y * rng.normal(size=y.shape).astype("float32"))
    delta, *gradients = tape.gradient(loss, [y] + [getattr(layer, name) for name in kernels])
    return x, delta, gradients


def curvature_variables(optimizer, *fields):
    """THOR's state variables ``fields`` (``LayerCurvature`` attributes), field by field, of
    every factored layer that has them, in layer order."""
    return [getattr(state, field) for field in fields for state in optimizer.curvature.values()
            if getattr(state, field) is not None]


def copy_checkout(dest):
    """The files a fresh clone has: no venv, no build outputs, no compiled library."""
    shutil.copytree(REPO_ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "site", "demo_output", "*.egg-info", "*.so",
        "__pycache__", ".pytest_cache"))


def venv_over_this_one(env_dir):
    """A fresh virtualenv at ``env_dir`` whose ``.pth`` file gives it this interpreter's
    site-packages (tensorflow, keras, numpy), so installing the package there fetches nothing.
    Returns its own site-packages."""
    venv.create(env_dir, with_pip=True)
    site = subprocess.run([os.path.join(env_dir, "bin", "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "_dev_site_packages.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return site
