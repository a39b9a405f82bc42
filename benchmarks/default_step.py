"""The default THOR's train-step time against Keras' Adam, what each of its parts costs, and
the cost model that predicts it.

Every model of ``benchmarks/convergence.py`` (``mlp``, ``cnn``, ``mnist1d``, ``transformer``,
``mnist_mlp``, ``charlm``, at their batch sizes there) and the 2-block transformer of
``benchmarks/thor_step.py`` (``transformer2``); ``keras.applications.ResNet50`` at 64 x 64
pixels with batch 16 (``resnet50``) runs only when named (``--model resnet50`` or ``all``):
its five cases in one process took 18 GB and more than 15 minutes on 2 cores. Each case is the compiled train step of
``thor_step.py`` on the same model and random batch (nothing is downloaded); the cases run
interleaved, round after round, each round a multiple of the default's ``frequency``
consecutive steps after 50 untimed ones (the default keeps no basis before its moving
averages have filled, 40 steps), and the median per-step time of each is reported:

- ``adam``: ``keras.optimizers.Adam()``;
- ``thor default``: ``tf_msopt.thor(model)``;
- ``every factor``: the default with every factor decomposed at every refresh
  (``eigenbasis_tolerance=None``): on a batch that repeats, the factors stop moving and the
  default keeps its bases, so this is the refresh's cost where every basis moves;
- ``no refresh``: the default with no refresh in the timed window;
- ``rotation only``: neither statistics nor refresh: the gradient rotated into the
  eigenbases, Adam's second moment there, rotated back, grafted and averaged.

The measured parts follow by difference: the rotation (``rotation only - adam``), the
statistics (``no refresh - rotation only``) and the refresh (``every factor - no refresh``,
spread over its ``frequency`` steps).

The cost model (the package's, ``tf_msopt.thor.cost``, which ``optimizer.report()`` prints
for any model) counts floating-point operations (a multiply-add is two) per step, from the
model and the optimizer's curvature state after the warm-up: the model's forward and backward
pass (three times the forward pass that TensorFlow's profiler counts), and per factored layer
the statistics (``2 r n b`` for a factor of dimension ``n`` kept in blocks of ``b`` from
``r`` rows), the rotation (into and out of each eigenbasis: ``4 n b m`` for the other side's
dimension ``m``) and the refresh of every factor (``9 b^3`` per block for the
eigendecomposition, LAPACK's count with eigenvectors, and ``2 b^3`` for the check of the
previous basis), divided by ``frequency``. The last line printed is JSON (``--out FILE``
also writes it to FILE, replacing it).

``--variant ARGS`` (repeatable; ``ARGS`` is THOR's keyword arguments, ``NAME=VALUE`` separated by
commas, e.g. ``block_size=128``) times the levers instead of the parts: Adam, the default and
the default with each ``ARGS``, interleaved alike, each with the cost model's FLOPs.

    python benchmarks/default_step.py [--model NAME[,NAME...]|all] [--rounds R]
        [--variant ARGS ...] [--out FILE]
"""
import argparse
import ast
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_msopt as mso  # noqa: E402
from convergence import build_model  # noqa: E402
from thor_step import BUILDERS, Case  # noqa: E402
from timing import emit, machine, time_cases  # noqa: E402

NEVER = 10**9     # a frequency no timed step reaches (step 0, in the warm-up, refreshes)
WARMUP_REFRESHES = 5   # refresh intervals before timing: 50 steps, the averages filled (40)


def _thor_step_model(name):
    def make():
        args = argparse.Namespace(batch=16 if name == "resnet50" else 32, classes=10,
                                  sequence=64, vocab=1000)
        model, x, title = BUILDERS[name](args, np.random.default_rng(0))
        return model, x, 10, title
    return make


def _task_model(task, input_shape, classes, batch, title, tokens=False):
    def make():
        rng = np.random.default_rng(0)
        if tokens:
            x = rng.integers(0, classes, size=(batch, *input_shape)).astype("int32")
        else:
            x = rng.random((batch, *input_shape), dtype=np.float32)
        return (lambda: build_model(task, input_shape, classes)), x, classes, title
    return make


# Per model: what makes (model factory, batch, classes, title), and whether every position
# has a label (the language model's targets have the inputs' shape).
MODELS = {
    "mlp": (_task_model("mlp", (64,), 10, 64, "digits MLP 64-64-64-10, batch 64"), False),
    "cnn": (_task_model("cnn", (8, 8, 1), 10, 64, "digits CNN (2 Conv2D, Dense 64), batch 64"),
            False),
    "mnist1d": (_task_model("mnist1d", (40, 1), 10, 64, "MNIST-1D Conv1D, batch 64"), False),
    "transformer": (_task_model("transformer", (40, 1), 10, 64,
                                "MNIST-1D transformer (1 block, width 32), batch 64"), False),
    "mnist_mlp": (_task_model("mnist_mlp", (784,), 10, 64,
                              "MNIST MLP 784-256-128-10, batch 64"), False),
    "charlm": (_task_model("charlm", (64,), 96, 32, "character LM (2 pre-LN blocks, width "
                           "128, MLP 512), batch 32 x 64", tokens=True), True),
    "resnet50": (_thor_step_model("resnet50"), False),
    "transformer2": (_thor_step_model("transformer"), False),
}
#: Each part's field of tf_msopt.thor.cost.LayerCost.
COST_FIELDS = {"rotation": "preconditioning", "statistics": "statistics", "refresh": "refresh"}
PARTS = {"rotation": ("rotation only", "adam"),
         "statistics": ("no refresh", "rotation only"),
         "refresh": ("every factor", "no refresh")}


def _thor(**kwargs):
    return lambda model: mso.thor(model, **kwargs)


def cases():
    """The cases' optimizer factories."""
    return {"adam": lambda model: keras.optimizers.Adam(),
            "thor default": _thor(),
            "every factor": _thor(eigenbasis_tolerance=None),
            "no refresh": _thor(frequency=NEVER),
            "rotation only": _thor(frequency=NEVER, statistics_frequency=NEVER)}


def variant_cases(variants):
    """Adam's, the default's and each variant's factory (``{label: THOR kwargs}``)."""
    return {"adam": lambda model: keras.optimizers.Adam(), "thor default": _thor(),
            **{label: _thor(**kwargs) for label, kwargs in variants.items()}}


def parse_variant(text):
    """``"block_size=128,max_rotated_dim=512"`` -> ``(label, {name: value})``."""
    kwargs = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            kwargs[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not NAME=VALUE with a Python literal") from None
    return "thor " + ", ".join(f"{name}={value!r}" for name, value in kwargs.items()), kwargs


def forward_flops(model, x):
    """The forward pass's floating-point operations, as TensorFlow's profiler counts them."""
    spec = tf.TensorSpec(x.shape, tf.as_dtype(x.dtype))
    graph = tf.function(lambda inputs: model(inputs, training=True)).get_concrete_function(
        spec).graph
    options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    return tf.compat.v1.profiler.profile(graph=graph, options=options).total_float_ops


def thor_flops(optimizer):
    """``{part: flops per step}`` of THOR's statistics, rotation and refresh (amortised): the
    package's cost model (``optimizer.step_costs()``) summed over the layers."""
    costs = optimizer.step_costs()
    return {part: sum(getattr(cost, field) or 0.0 for cost in costs)
            for part, field in COST_FIELDS.items()}


def _time_model(name, factories, rounds, repeats):
    """``(built cases, record)`` of ``factories`` on model ``name``: the record holds the
    model's title, batch and operations a step, and each case's ms per step."""
    make, per_position = MODELS[name]
    make_model, x, classes, title = make()
    rng = np.random.default_rng(1)
    y = rng.integers(0, classes, size=x.shape if per_position else x.shape[:1]).astype("int32")
    built = {case: Case(make_model, factory, x, y) for case, factory in factories.items()}
    steps = {case: value.step() for case, value in built.items()}
    frequency = mso.thor.DEFAULTS["frequency"]
    # Past the moving averages' filling, before which the default decomposes every factor.
    times = time_cases(steps, rounds, frequency * repeats, warmup=WARMUP_REFRESHES * frequency)
    ms = {case: 1e3 * seconds for case, seconds in times.items()}
    return built, {"title": title, "batch": int(x.shape[0]), "rounds": rounds,
                   "ms_per_step": ms, "ratio_vs_adam": {c: v / ms["adam"] for c, v in ms.items()},
                   "model_gflop": 3.0 * forward_flops(built["adam"].model, x) / 1e9}


def run_variants(name, rounds, repeats, variants):
    """Adam, the default and ``variants`` on model ``name``: ms per step and THOR's FLOPs."""
    built, record = _time_model(name, variant_cases(variants), rounds, repeats)
    ms = record["ms_per_step"]
    gflop = {case: {part: value / 1e9 for part, value in thor_flops(value.optimizer).items()}
             for case, value in built.items() if case != "adam"}
    print(f"\n== {name}: {record['title']}, {rounds} rounds; model "
          f"{record['model_gflop']:.4f} GFLOP/step")
    print(f"{'case':>40} {'ms/step':>9} {'x Adam':>7}   GFLOP/step " + ", ".join(PARTS))
    for case, value in ms.items():
        parts = ", ".join(f"{v:.4g}" for v in gflop[case].values()) if case in gflop else ""
        print(f"{case:>40} {value:9.2f} {value / ms['adam']:7.2f}   {parts}")
    return {**record, "parts_gflop": gflop}


def run_model(name, rounds, repeats):
    built, record = _time_model(name, cases(), rounds, repeats)
    ms, model_flops = record["ms_per_step"], record["model_gflop"] * 1e9
    frequency = mso.thor.DEFAULTS["frequency"]
    measured = {part: ms[minuend] - ms[subtrahend]
                for part, (minuend, subtrahend) in PARTS.items()}
    flops = thor_flops(built["thor default"].optimizer)
    print(f"\n== {name}: {record['title']}, default frequency {frequency}, {rounds} rounds")
    for case, value in ms.items():
        print(f"{case:>14} {value:9.2f} ms/step {value / ms['adam']:6.2f}x Adam")
    print(f"{'part':>14} {'GFLOP/step':>11} {'x model':>8} {'ms/step':>9}")
    print(f"{'model':>14} {model_flops / 1e9:11.4f} {1.0:8.2f} {'':>9}")
    for part, value in flops.items():
        print(f"{part:>14} {value / 1e9:11.4f} {value / model_flops:8.2f} "
              f"{measured[part]:9.2f}")
    added = sum(flops.values()) / model_flops
    print(f"{'THOR adds':>14} {sum(flops.values()) / 1e9:11.4f} {added:8.2f}")
    return {**record, "frequency": frequency, "parts_ms": measured,
            "parts_gflop": {part: value / 1e9 for part, value in flops.items()},
            "flops_added_vs_model": added}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=",".join(m for m in MODELS if m != "resnet50"),
                        help=f"comma-separated names of {', '.join(MODELS)}, or all")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2,
                        help="frequency-long runs per case and round")
    parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                        metavar="ARGS", help="time the default with these THOR arguments "
                        "(NAME=VALUE,...) beside Adam and the default, instead of the parts")
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()
    names = list(MODELS) if args.model == "all" else args.model.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        sys.exit(f"--model: unknown {unknown}; choose from {', '.join(MODELS)} or all")
    variants = dict(args.variant)
    run = ((lambda name: run_variants(name, args.rounds, args.repeats, variants)) if variants
           else (lambda name: run_model(name, args.rounds, args.repeats)))
    emit({"benchmark": "default_step", "machine": machine(), "defaults": mso.thor.DEFAULTS,
          "models": {name: run(name) for name in names}}, args.out)


if __name__ == "__main__":
    main()
