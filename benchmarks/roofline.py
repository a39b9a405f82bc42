"""Every hot path against this machine's own limits: memory bandwidth and float32 matmul rate.

In one process, interleaved round after round (medians, so machine noise hits
all cases alike), the script measures:

- the memory bandwidth: a STREAM-style triad ``a = a - s*b`` with TensorFlow's
  fused, multi-threaded in-place kernel (``ResourceApplyGradientDescent``, 12
  bytes moved per float32 element), over two ``--stream-mib`` arrays and over
  ``--variables`` pairs shaped like the hot paths' variables; the better of the
  two is the limit. For reference, NumPy's two-pass triad (one thread; bytes
  actually moved) is printed too;
- the float32 matmul peak: ``tf.matmul`` of two ``--matmul`` square matrices;
- each hot path at the sizes of the other benchmarks: AddSign and PowerSign
  (the one-pass kernels), LARS around Keras SGD-momentum, AdamOffload's host
  update (variables on the host, one in-place pass; with float32, bfloat16 and int8
  moments: 28, 20 and about 16 bytes a parameter), THOR's stale-step
  preconditioning ``blockdiag(A_inv) g blockdiag(G_inv)`` and THOR's block
  inverse ``inv(M + damping*I)``.

For each path it prints the bytes it must move per step (the minimum for its
math: each array read or written once per pass the math needs) and the flops,
the achieved rate, and the fraction of the roofline limit,
``max(bytes / bandwidth, flops / peak) / time`` (1.0 = at the limit). The last
line printed is JSON (``--out FILE`` also writes it to FILE, replacing the file).

    python benchmarks/roofline.py [--params 10000000] [--variables 10] [--rounds 11]
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from tf_msopt.ops.adam import host_step_bytes  # noqa: E402

tf.get_logger().setLevel("ERROR")  # one traced step per case: retracing notes are expected
from tf_msopt.thor import block_diagonal as blocks  # noqa: E402
from timing import emit, machine, time_cases  # noqa: E402

F32 = 4  # bytes
#: AdamOffload's state_dtype -> the suffix of its path's name.
ADAM_OFFLOAD_STATES = {"float32": "", "bfloat16": "_bf16", "int8": "_int8"}


def triad_case(elements, count=1):
    """``a = a - s*b`` in place over ``count`` pairs of arrays: read a, b, write a (12 bytes
    per element), multi-threaded."""
    pairs = [(tf.Variable(tf.ones([elements])), tf.constant(np.full(elements, 1e-3, np.float32)))
             for _ in range(count)]

    @tf.function
    def step():
        for a, b in pairs:
            tf.raw_ops.ResourceApplyGradientDescent(var=a.handle, alpha=tf.constant(1e-3),
                                                    delta=b)

    return step, 3 * F32 * elements * count


def numpy_triad(elements, rounds):
    """NumPy's ``a = b + s*c`` (two passes: 20 bytes per element actually moved), one thread."""
    a, b, c = (np.full(elements, x, np.float32) for x in (0.0, 1.0, 2.0))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        np.multiply(c, np.float32(3.0), out=a)
        np.add(a, b, out=a)
        times.append(time.perf_counter() - start)
    return 5 * F32 * elements / statistics.median(times)


def matmul_case(n):
    x = tf.constant(np.random.default_rng(0).normal(size=(n, n)).astype(np.float32))
    y = tf.constant(np.random.default_rng(1).normal(size=(n, n)).astype(np.float32))

    @tf.function
    def step():
        return tf.matmul(x, y)

    return step, 2.0 * n ** 3


def keras_case(optimizer, values, grads):
    variables = [keras.Variable(v) for v in values]
    optimizer.build(variables)
    return tf.function(lambda: optimizer.apply(grads, variables))


def precondition_case(layers, block_size):
    """THOR's stale step on Dense kernels ``(a_dim, g_dim)``: ``blockdiag(A) g blockdiag(G)``."""
    rng = np.random.default_rng(2)
    work, flops, moved = [], 0.0, 0
    for a_dim, g_dim in layers:
        a_layout = blocks.BlockLayout.of(a_dim, block_size)
        g_layout = blocks.BlockLayout.of(g_dim, block_size)
        a_inv = tf.constant(rng.normal(size=a_layout.shape).astype(np.float32))
        g_inv = tf.constant(rng.normal(size=g_layout.shape).astype(np.float32))
        grad = tf.constant(rng.normal(size=(a_dim, g_dim)).astype(np.float32))
        work.append((a_inv, a_layout, grad, g_inv, g_layout))
        flops += 2.0 * a_layout.count * a_layout.size ** 2 * g_dim       # left product
        flops += 2.0 * g_layout.count * a_dim * g_layout.size ** 2       # right product
        moved += F32 * (2 * a_dim * g_dim + a_layout.count * a_layout.size ** 2
                        + g_layout.count * g_layout.size ** 2)

    @tf.function
    def step():
        return [blocks.right_multiply(blocks.left_multiply(a, al, g), gi, gl)
                for a, al, g, gi, gl in work]

    return step, flops, moved


def inverse_case(count, n):
    x = np.random.default_rng(0).normal(size=(count, n, 2 * n))
    matrices = tf.constant((x @ x.transpose(0, 2, 1) / (2 * n)).astype(np.float32))
    damping = tf.constant(0.1)
    step = tf.function(lambda: mso.ops.damped_inverse(matrices, damping))
    # Cholesky n^3/3, triangular inverse n^3/3, L^-T L^-1 n^3/3 (multiply-adds as 2 flops).
    return step, 2.0 * count * n ** 3, 2 * F32 * count * n * n


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--variables", type=int, default=10)
    parser.add_argument("--stream-mib", type=int, default=64, help="size of each triad array")
    parser.add_argument("--matmul", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=64, help="128x128 blocks to invert")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls-per-round", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()

    n = args.params
    size = n // args.variables
    rng = np.random.default_rng(0)
    values = [rng.normal(size=size).astype(np.float32) for _ in range(args.variables)]
    grads = [tf.constant((rng.normal(size=size) * 1e-2).astype(np.float32))
             for _ in range(args.variables)]
    sgd = lambda: keras.optimizers.SGD(0.01, momentum=0.9)  # noqa: E731

    triad, triad_bytes = triad_case(args.stream_mib * 2 ** 20 // F32)
    # The same triad over arrays shaped like the hot paths' variables (still far larger
    # than the caches in all): the limit is the better of the two.
    triad_vars, triad_vars_bytes = triad_case(size, args.variables)
    matmul, matmul_flops = matmul_case(args.matmul)
    precondition, precondition_flops, precondition_bytes = precondition_case(
        [(784, 512), (512, 512), (512, 10)], 128)
    inverse, inverse_flops, inverse_bytes = inverse_case(args.blocks, 128)
    # (bytes, flops) per step: the minimum traffic of each path's math.
    paths = {
        # read var, m, g; write var, m
        "addsign": (keras_case(mso.AddSign(0.01), values, grads), 5 * F32 * n, 7.0 * n),
        "powersign": (keras_case(mso.PowerSign(0.01), values, grads), 5 * F32 * n, 7.0 * n),
        # norms: read w, g; update: read w, g, m, write w, m
        "lars_sgd_momentum": (keras_case(mso.LARS(sgd()), values, grads), 7 * F32 * n,
                              10.0 * n),
        # Keras SGD-momentum for comparison: read w, g, m; write w, m
        "keras_sgd_momentum": (keras_case(sgd(), values, grads), 5 * F32 * n, 4.0 * n),
        # read w, g, m, v; write w, m, v (m and v in 4, 2 or 1 byte: state_dtype)
        **{f"adam_offload_host_update{suffix}": (
            keras_case(mso.AdamOffload(1e-3, state_dtype=state_dtype), values, grads),
            host_step_bytes(state_dtype, [size] * args.variables), 16.0 * n)
           for state_dtype, suffix in ADAM_OFFLOAD_STATES.items()},
        "thor_stale_precondition": (precondition, precondition_bytes, precondition_flops),
        "thor_inverse": (inverse, inverse_bytes, inverse_flops),
    }
    steps = {"stream_triad": triad, "stream_triad_variables": triad_vars, "matmul_peak": matmul}
    steps.update({name: step for name, (step, _, _) in paths.items()})
    medians = time_cases(steps, args.rounds, args.calls_per_round)
    bandwidth_large = triad_bytes / medians["stream_triad"]
    bandwidth_variables = triad_vars_bytes / medians["stream_triad_variables"]
    bandwidth = max(bandwidth_large, bandwidth_variables)
    peak = matmul_flops / medians["matmul_peak"]
    numpy_bandwidth = numpy_triad(args.stream_mib * 2 ** 20 // F32, args.rounds)

    print(f"{os.cpu_count()} CPUs, TF {tf.__version__}, {tf.config.threading.get_intra_op_parallelism_threads() or 'default'} intra-op threads; {mso.ops.custom_ops_status()}")
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s, the best of: TF in-place triad "
          f"{bandwidth_large / 1e9:.1f} GB/s ({args.stream_mib} MiB arrays), "
          f"{bandwidth_variables / 1e9:.1f} GB/s ({args.variables} x {size * F32 / 2 ** 20:.1f} "
          f"MiB arrays); NumPy two-pass triad, one thread: {numpy_bandwidth / 1e9:.1f} GB/s")
    print(f"float32 matmul peak ({args.matmul}^2): {peak / 1e9:.1f} GFLOP/s; "
          f"ridge point {peak / bandwidth:.1f} flop/byte")
    header = (f"{'path':<31}{'MB/step':>9}{'MFLOP/step':>12}{'ms/step':>9}{'GB/s':>8}"
              f"{'GFLOP/s':>9}{'bound':>8}{'of limit':>10}")
    print(header)
    results = {}
    adam_offload = {f"adam_offload_host_update{suffix}": state_dtype
                    for state_dtype, suffix in ADAM_OFFLOAD_STATES.items()}
    for name, (_, moved, flops) in paths.items():
        seconds = medians[name]
        at_limit = max(moved / bandwidth, flops / peak)
        bound = "memory" if moved / bandwidth >= flops / peak else "compute"
        fraction = at_limit / seconds
        results[name] = {"bytes": moved, "flops": flops, "ms": round(seconds * 1e3, 3),
                         "gb_per_s": round(moved / seconds / 1e9, 2),
                         "gflop_per_s": round(flops / seconds / 1e9, 2), "bound": bound,
                         "fraction_of_limit": round(fraction, 3)}
        if name in adam_offload:
            results[name]["bytes_per_param"] = round(moved / n, 3)
        print(f"{name:<31}{moved / 1e6:>9.1f}{flops / 1e6:>12.1f}{seconds * 1e3:>9.2f}"
              f"{moved / seconds / 1e9:>8.1f}{flops / seconds / 1e9:>9.1f}{bound:>8}"
              f"{fraction:>9.0%}")
    for name, state_dtype in adam_offload.items():
        fraction = results[name]["fraction_of_limit"]
        print(f"target {name} ({state_dtype} moments, {results[name]['bytes_per_param']:g} "
              f"bytes/param) >= 90% of the bandwidth limit: {fraction:.0%} "
              f"{'meets' if fraction >= 0.9 else 'MISSES'}")
    lars = results["lars_sgd_momentum"]["fraction_of_limit"]
    print(f"target lars_sgd_momentum >= 70% of the bandwidth limit: {lars:.0%} "
          f"{'meets' if lars >= 0.7 else 'MISSES'}")
    emit({
        "benchmark": "roofline", "params": n, "variables": args.variables,
        "machine": machine(),
        "custom_ops": mso.ops.custom_ops_available(),
        "bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
        "triad_gb_per_s": {"large": round(bandwidth_large / 1e9, 2),
                           "variables": round(bandwidth_variables / 1e9, 2)},
        "numpy_triad_gb_per_s": round(numpy_bandwidth / 1e9, 2),
        "matmul_gflop_per_s": round(peak / 1e9, 2), "paths": results,
    }, args.out)


if __name__ == "__main__":
    main()
