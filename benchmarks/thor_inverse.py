"""THOR's block inverse: the MsOptDampedInverse op against the best tf.linalg routes, one process.

Each case inverts a batch of damped SPD blocks ``X X^T / (2n) + 0.1 I`` in a
``tf.function``: the op (as ``mso.ops.damped_inverse_with_status`` calls it),
``tf.linalg.inv``, and ``tf.linalg.cholesky`` + ``cholesky_solve``. Cases run
interleaved, round after round (medians), and the op is reported as the speed-up
over the best TF route (target >= 1.5x). The last line printed is JSON (``--out FILE`` also writes it to FILE, replacing the file).

    python benchmarks/thor_inverse.py [--batches 16 64] [--size 128] [--dtype float32]
        [--library path/to/_msopt_ops.so]
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_msopt.ops import _loader  # noqa: E402
from tf_msopt.ops.inverse import damped_inverse_with_status, inverse_backend  # noqa: E402
from timing import emit, machine, time_cases  # noqa: E402

DAMPING = 0.1
TARGET = 1.5


def spd_blocks(batch, n, dtype):
    x = np.random.default_rng(0).normal(size=(batch, n, 2 * n))
    return tf.constant(x @ x.transpose(0, 2, 1) / (2 * n), dtype)


def cases(matrices):
    damping = tf.constant(DAMPING, matrices.dtype)
    shape = tf.shape(matrices)
    identity = tf.eye(shape[-1], batch_shape=shape[:-2], dtype=matrices.dtype)

    def damped():
        return matrices + damping * identity

    return {
        "op": tf.function(lambda: damped_inverse_with_status(matrices, damping)),
        "tf_inv": tf.function(lambda: tf.linalg.inv(damped())),
        "tf_cholesky_solve": tf.function(
            lambda: tf.linalg.cholesky_solve(tf.linalg.cholesky(damped()), identity)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls-per-round", type=int, default=5)
    parser.add_argument("--library", help="op library to load instead of the package's")
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()
    if args.library:
        _loader.LIBRARY_PATH = os.path.abspath(args.library)
    backend = inverse_backend()
    if not backend.startswith("custom op"):
        raise SystemExit(f"the op is not available ({backend}; {_loader.custom_ops_status()}); "
                         "build it or pass --library")

    print(f"{args.size}x{args.size} {args.dtype} blocks, {os.cpu_count()} CPUs, "
          f"TF {tf.__version__}, back-end: {backend}")
    print(f"{'blocks':>7}{'case':>20}{'ms':>10}{'op speed-up':>13}")
    results = {}
    for batch in args.batches:
        medians = time_cases(cases(spd_blocks(batch, args.size, args.dtype)), args.rounds,
                             args.calls_per_round)
        best_tf = min(medians["tf_inv"], medians["tf_cholesky_solve"])
        for name, seconds in medians.items():
            print(f"{batch:>7}{name:>20}{seconds * 1e3:>10.3f}{seconds / medians['op']:>12.2f}x")
        speedup = best_tf / medians["op"]
        verdict = "meets" if speedup >= TARGET else "MISSES"
        print(f"target op vs best tf.linalg, {batch} blocks: {speedup:.2f}x (>= {TARGET}x) "
              f"{verdict}")
        results[str(batch)] = {"ms": {k: round(s * 1e3, 3) for k, s in medians.items()},
                               "speedup_vs_best_tf": round(speedup, 3)}
    emit({
        "benchmark": "thor_inverse", "size": args.size, "dtype": args.dtype, "backend": backend,
        "machine": machine(),
        "batches": results,
    }, args.out)


if __name__ == "__main__":
    main()
