"""Time of one optimizer update over N float32 parameters, every case in one process.

Each case is a ``tf.function`` that applies one update to all variables. Cases
run interleaved, round after round, so machine noise hits them alike; the
median per-step time of each is reported, with ratios against the baselines
(Keras ``SGD(momentum=0.9)`` and TensorFlow's fused ``ResourceApplyMomentum``).
The last line printed is JSON (``--out FILE`` also writes it to FILE, replacing the file).

    python benchmarks/update_step.py [--params 10000000] [--variables 10] [--rounds 15]
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from timing import emit, machine, time_cases, traced_without_custom_ops  # noqa: E402


def make_problem(params, variables):
    size = params // variables
    rng = np.random.default_rng(0)
    values = [rng.normal(size=size).astype(np.float32) for _ in range(variables)]
    grads = [tf.constant(rng.normal(size=size).astype(np.float32)) for _ in range(variables)]
    return values, grads


def keras_case(make_optimizer, values, grads):
    variables = [keras.Variable(v) for v in values]
    optimizer = make_optimizer()
    optimizer.build(variables)
    return tf.function(lambda: optimizer.apply(grads, variables))


def raw_momentum_case(values, grads):
    variables = [tf.Variable(v) for v in values]
    accumulators = [tf.Variable(tf.zeros_like(v)) for v in values]

    def step():
        for var, accum, grad in zip(variables, accumulators, grads):
            tf.raw_ops.ResourceApplyMomentum(var=var.handle, accum=accum.handle, lr=0.01, grad=grad,
                                             momentum=0.9)

    return tf.function(step)


def pure_tf_case(make_optimizer, values, grads):
    """A case traced with the custom ops switched off (the op is chosen at tracing)."""
    return traced_without_custom_ops(keras_case(make_optimizer, values, grads))


def tf_kernel(optimizer):
    """Forces TensorFlow's fused kernel instead of the package's one-pass op."""
    optimizer._fused = True
    return optimizer


def cases(values, grads):
    sgd = lambda: keras.optimizers.SGD(0.01, momentum=0.9)  # noqa: E731
    return {
        "keras_sgd_momentum": keras_case(sgd, values, grads),
        "raw_apply_momentum": raw_momentum_case(values, grads),
        "keras_adam": keras_case(lambda: keras.optimizers.Adam(1e-3), values, grads),
        "addsign": keras_case(lambda: mso.AddSign(0.01, jit_compile=False), values, grads),
        "addsign_tf_kernel": keras_case(lambda: tf_kernel(mso.AddSign(0.01, jit_compile=False)),
                                        values, grads),
        "addsign_jit": keras_case(lambda: mso.AddSign(0.01, jit_compile=True), values, grads),
        "powersign": keras_case(lambda: mso.PowerSign(0.01, jit_compile=False), values, grads),
        "powersign_jit": keras_case(lambda: mso.PowerSign(0.01, jit_compile=True), values, grads),
        "lars_sgd_momentum": keras_case(lambda: mso.LARS(sgd()), values, grads),
        "lars_sgd_momentum_pure_tf": pure_tf_case(lambda: mso.LARS(sgd()), values, grads),
        "lars_sgd_momentum_jit": keras_case(lambda: mso.LARS(sgd(), jit_compile=True), values,
                                            grads),
        "lars_adam": keras_case(lambda: mso.LARS(keras.optimizers.Adam(1e-3)), values, grads),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--variables", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls-per-round", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()

    values, grads = make_problem(args.params, args.variables)
    medians = time_cases(cases(values, grads), args.rounds, args.calls_per_round)
    sgd, raw = medians["keras_sgd_momentum"], medians["raw_apply_momentum"]

    print(f"{args.params:,} float32 params in {args.variables} variables, "
          f"{os.cpu_count()} CPUs, TF {tf.__version__}, Keras {keras.__version__}")
    print(f"back-end: {mso.ops.custom_ops_status()}")
    print(f"{'case':<26}{'ms/step':>10}{'vs Keras SGD-m':>16}{'vs raw momentum':>17}")
    for name, seconds in medians.items():
        print(f"{name:<26}{seconds * 1e3:>10.2f}{seconds / sgd:>15.2f}x{seconds / raw:>16.2f}x")
    targets = {"addsign_vs_keras_sgd_momentum": (medians["addsign"] / sgd, 0.7),
               "addsign_vs_raw_apply_momentum": (medians["addsign"] / raw, 1.1),
               "lars_sgd_momentum_vs_keras_sgd_momentum": (medians["lars_sgd_momentum"] / sgd, 1.15),
               "lars_adam_vs_keras_adam": (medians["lars_adam"] / medians["keras_adam"], 1.15)}
    for name, (ratio, target) in targets.items():
        verdict = "meets" if ratio <= target else "MISSES"
        print(f"target {name}: {ratio:.2f}x (target <= {target}x) {verdict}")
    emit({
        "benchmark": "update_step", "params": args.params, "variables": args.variables,
        "machine": machine(),
        "custom_ops": mso.ops.custom_ops_available(),
        "ms_per_step": {k: round(s * 1e3, 3) for k, s in medians.items()},
        "ratios": {k: round(r, 3) for k, (r, _) in targets.items()},
    }, args.out)


if __name__ == "__main__":
    main()
