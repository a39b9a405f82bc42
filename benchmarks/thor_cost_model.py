"""THOR's step on N data-parallel workers, predicted from its measured parts.

Each worker keeps its own batch (the global batch grows with N). A step of
``tf_msopt.thor(model)`` on one worker is the parts ``benchmarks/default_step.py`` measures
(``--parts-from``, its results file): the model's forward and backward pass with Adam's
update (``adam``), the statistics' capture (``statistics``), the rotation into the
eigenbases and back (``rotation``) and the refresh per step (``refresh``). Under N workers:

- every ``replica_division``: each worker runs ``adam`` and ``statistics`` on its batch and
  all-reduces the gradients and the statistics (a ring: ``2 (N-1)/N`` of their bytes sent
  and received per worker);
- ``None``: every worker also runs all of ``rotation`` and ``refresh``;
- ``"refresh"``: ``refresh / N``, plus an all-gather of the refreshed eigenvectors
  (``(N-1)/N`` of their bytes) on each refresh that decomposes, here every refresh (the
  filling phase's cost, an upper bound);
- ``"step"``: ``(rotation + refresh) / N``, plus that all-gather and, every step, one of
  the directions and rotated second moments of the factored kernels.

Bytes move at ``--bandwidth`` GB/s per worker (each value given is a column); latency and
overlap are left out. The bytes come from the model itself (built here, on no data); the
times are those of the results file's machine. Printed: per model and N, the step in ms and
the throughput (examples per second) against one worker's, for each division; the last
line is JSON.

    python benchmarks/thor_cost_model.py [--workers 2 8 64] [--bandwidth 1.25 12.5]
                                         [--out FILE]
"""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tf_msopt as mso  # noqa: E402
from thor_step import BUILDERS  # noqa: E402
from timing import emit  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
#: Per model: its results file of benchmarks/default_step.py, the key there, the builder's
#: arguments (thor_step's) and a title.
MODELS = {
    "resnet50": ("default_step_resnet50.json", "resnet50",
                 dict(batch=16, classes=10), "ResNet50, 64x64, 16 images a worker"),
    "transformer": ("default_step.json", "transformer2",
                    dict(batch=32, classes=10, vocab=1000, sequence=64),
                    "2-block transformer (width 128), 32 sequences a worker"),
}
DIVISIONS = ("none", "refresh", "step")


def model_bytes(name):
    """The bytes a step of ``tf_msopt.thor(model)`` moves, per kind, for model ``name``."""
    _, _, arguments, _ = MODELS[name]
    build, _, _ = BUILDERS[name](argparse.Namespace(**arguments), np.random.default_rng(0))
    model = build()
    optimizer = mso.thor(model)
    optimizer.build(model.trainable_variables)
    layers = list(optimizer.curvature.values())
    preconditioner = optimizer.preconditioner

    def size(shape):
        return int(np.prod(shape))
    return {
        "gradients": 4 * sum(size(v.shape) for v in model.trainable_variables),
        "statistics": 4 * sum(size(shape) for layer in layers
                              for shape in preconditioner.statistics_shapes(layer.block)),
        "refreshed": 4 * sum(size(v.shape) for layer in layers
                             for v in preconditioner.refreshed_state(layer)),
        "step": 4 * sum(layer.block.kernel_elements * (
            1 + len(preconditioner.stepped_state(layer))) for layer in layers),
        "frequency": optimizer.options.frequency,
    }


def predict(parts, moved, workers, bandwidth):
    """``{division: ms per step}`` on ``workers`` workers at ``bandwidth`` GB/s."""
    def seconds(bytes_, share):
        return 1e3 * share * bytes_ / (bandwidth * 1e9) if workers > 1 else 0.0

    reduce = seconds(moved["gradients"] + moved["statistics"], 2 * (workers - 1) / workers)
    refreshed = seconds(moved["refreshed"], (workers - 1) / workers) / moved["frequency"]
    base = parts["adam"] + parts["statistics"] + reduce
    return {
        "none": base + parts["rotation"] + parts["refresh"],
        "refresh": base + parts["rotation"] + parts["refresh"] / workers + refreshed,
        "step": base + (parts["rotation"] + parts["refresh"]) / workers + refreshed
        + seconds(moved["step"], (workers - 1) / workers),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--bandwidth", type=float, nargs="+", default=[1.25, 12.5],
                        help="GB/s per worker (1.25: 10 Gb/s Ethernet; 12.5: 100 Gb/s)")
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()
    results = {}
    for name, (parts_file, key, _, title) in MODELS.items():
        with open(os.path.join(HERE, "results", parts_file)) as f:
            measured = json.load(f)
        found = measured["models"][key]
        parts = {"adam": found["ms_per_step"]["adam"], **found["parts_ms"]}
        moved = model_bytes(name)
        one = parts["adam"] + parts["statistics"] + parts["rotation"] + parts["refresh"]
        rows = []
        for bandwidth in args.bandwidth:
            for workers in args.workers:
                ms = predict(parts, moved, workers, bandwidth)
                rows.append({"workers": workers, "bandwidth_gbps": bandwidth, "step_ms": ms,
                             "throughput_vs_one": {d: workers * one / ms[d] for d in ms}})
                print(f"{title}, {workers} workers at {bandwidth} GB/s: " + ", ".join(
                    f"{d} {ms[d]:.0f} ms ({workers * one / ms[d]:.1f}x)" for d in DIVISIONS))
        results[name] = {"title": title, "parts_ms": parts, "one_worker_ms": one,
                         "bytes": moved, "parts_machine": measured["machine"],
                         "parts_file": parts_file, "predictions": rows}
    emit({"benchmark": "thor_cost_model", "models": results}, args.out)


if __name__ == "__main__":
    main()
