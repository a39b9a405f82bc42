"""THOR's refresh inside and outside XLA on a CPU: the factorisations alone, and the default's
train step.

With ``jit_compile=True`` (``model.compile(jit_compile=True)`` or a custom step in
``tf.function(jit_compile=True)``) THOR's refresh is compiled with the rest of the step, and
XLA factorises with its own kernels instead of TensorFlow's: an eigendecomposition by its
Jacobi iteration (the default's refresh), a Cholesky factorisation for the inverses of
MindSpore's form. This benchmark times, in one process:

- ``tf.linalg.eigh`` and THOR's damped inverse (:func:`tf_msopt.ops.inverse.damped_inverse`)
  on batches of random symmetric positive definite factors of each width in ``--widths``
  (as many as the character language model refreshes: 22 of 128, 4 of 512), in a
  ``tf.function`` with and without ``jit_compile``; milliseconds per factor;
- the compiled train step of ``benchmarks/default_step.py``'s character language model (2
  pre-LN blocks, width 128, batch 32 x 64) with ``keras.optimizers.Adam()`` and
  ``tf_msopt.thor(model)``, each with and without ``jit_compile``, interleaved
  (``timing.time_cases``) after 50 untimed steps; milliseconds per step (``--no-step``
  skips it).

The last line printed is JSON (``--out FILE`` also writes it to FILE, replacing it).

    python benchmarks/xla_refresh.py [--widths 128,512] [--rounds 3] [--no-step] [--out FILE]
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from tf_msopt.ops.inverse import damped_inverse  # noqa: E402
from default_step import MODELS  # noqa: E402
from thor_step import Case  # noqa: E402
from timing import emit, machine, time_cases  # noqa: E402

FACTORS = {128: 22, 512: 4}   # per width: how many the character language model refreshes
DAMPING = 0.03


def _label(name, xla):
    """A case's name in the results: `` (XLA)`` marks the one compiled with XLA."""
    return f"{name} (XLA)" if xla else name


def spd_factors(width, count, rng):
    rows = rng.standard_normal((count, 4 * width, width)).astype("float32")
    return tf.constant(np.einsum("kri,krj->kij", rows, rows) / width)


def time_factorisations(widths, rounds):
    """``{name: {width: ms per factor}}`` of eigh and the damped inverse, in and out of XLA."""
    rng = np.random.default_rng(0)
    kinds = {"eigh": lambda p: tf.linalg.eigh(p)[1],
             "inverse": lambda p: damped_inverse(p, DAMPING)}
    result = {}
    for width in widths:
        factors = spd_factors(width, FACTORS.get(width, 1), rng)
        for kind, fn in kinds.items():
            for xla in (False, True):
                name = _label(kind, xla)
                compiled = tf.function(fn, jit_compile=xla)
                compiled(factors)     # trace and compile, untimed
                times = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    compiled(factors).numpy()
                    times.append(time.perf_counter() - start)
                ms = 1e3 * float(np.median(times)) / factors.shape[0]
                result.setdefault(name, {})[str(width)] = ms
                print(f"{name:>16} width {width:5d}: {ms:10.3f} ms per factor")
    return result


def time_steps(rounds):
    """``{case: ms per step}``: the language model's train step with Adam and the default THOR,
    each with and without XLA."""
    make, _ = MODELS["charlm"]
    make_model, x, classes, title = make()
    y = np.random.default_rng(1).integers(0, classes, size=x.shape).astype("int32")
    optimizers = {"adam": lambda model: keras.optimizers.Adam(),
                  "thor default": lambda model: mso.thor(model)}
    steps = {}
    for xla in (False, True):
        for name, factory in optimizers.items():
            case = Case(make_model, factory, x, y)
            steps[_label(name, xla)] = case.step(jit_compile=xla)
    frequency = mso.thor.DEFAULTS["frequency"]
    times = time_cases(steps, rounds, 2 * frequency, warmup=5 * frequency)
    ms = {case: 1e3 * seconds for case, seconds in times.items()}
    for case, value in ms.items():
        print(f"{case:>20} {value:9.2f} ms/step {value / ms['adam']:6.2f}x Adam")
    return title, ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="128,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-step", action="store_true", help="only the factorisations")
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()
    payload = {"benchmark": "xla_refresh", "machine": machine(),
               "ms_per_factor": time_factorisations(
                   [int(w) for w in args.widths.split(",")], args.rounds)}
    if not args.no_step:
        payload["model"], payload["ms_per_step"] = time_steps(args.rounds)
    emit(payload, args.out)


if __name__ == "__main__":
    main()
