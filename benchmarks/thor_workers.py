"""THOR's step under several workers against one process: what dividing its work pays.

One process with one CPU thread trains ``--model`` on the global batch (``--batch``, random
data made here) with ``tf_msopt.thor(model, frequency=--frequency)`` in a custom loop;
then ``--workers`` ``MultiWorkerMirroredStrategy`` workers on localhost (one thread each) and
one process with ``MirroredStrategy`` over two logical CPUs (one thread each) train the same
model, each replica on its share of the batch, with every ``replica_division``: ``"step"``
(each factored layer's refresh and per-step preconditioning on one replica), ``"refresh"``
(only the refresh divided) and ``None`` (every replica does all of it), interleaved round
after round. A round is one refresh cycle (``--frequency`` steps); each case's median step
over the rounds while the statistics' moving averages fill (every refresh decomposes every
factor) and after (a basis decomposed only where it no longer holds) is reported with its
ratio to the one process's. The one process runs before and after the others; its figure
is the mean of the two. Also printed: the bytes a divided step gathers per replica and
THOR's curvature state on each replica (``optimizer.report().state_bytes``).

    python benchmarks/thor_workers.py [--workers 2] [--model mlp|resnet50|transformer]
                                      [--depth 8] [--hidden 512] [--batch 32]
                                      [--frequency 2] [--rounds 60] [--out FILE]

``mlp`` is ``--depth`` Dense(``--hidden``, tanh) layers and a Dense(10) head; ``resnet50``
and ``transformer`` are ``benchmarks/thor_step.py``'s. The last line printed is JSON.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from thor_step import (BUILDERS, scale_out_strategy, shared_batch,  # noqa: E402
                        thor_train_step)
from timing import (emit, local_environment, machine, run_processes,  # noqa: E402
                    worker_environments)

MODES = {"step": "step", "refresh": "refresh", "none": None}
PHASES = ("filling", "settled")


def build(args, rng):
    """``(build_model, global batch of inputs, title)``."""
    if args.model != "mlp":
        return BUILDERS[args.model](args, rng)

    def model():
        return keras.Sequential(
            [keras.Input((args.hidden,))]
            + [keras.layers.Dense(args.hidden, activation="tanh") for _ in range(args.depth)]
            + [keras.layers.Dense(args.classes)])
    x = rng.normal(size=(args.batch, args.hidden)).astype("float32")
    return model, x, f"{args.depth} Dense({args.hidden}, tanh) layers and a Dense(10) head"


def strategy_of(kind):
    """One thread per replica: no strategy, else ``benchmarks/thor_step.py``'s
    (``MultiWorkerMirroredStrategy`` under ``TF_CONFIG``, ``MirroredStrategy`` over two
    logical CPUs without)."""
    if kind != "one":
        return scale_out_strategy()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf.distribute.get_strategy()


def run_case_process(args):
    """This process's timings, as a dict: per case, the median step per phase."""
    strategy = strategy_of(args.kind)
    replicas = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    build_model, x, _ = build(args, rng)
    inputs = shared_batch(strategy, x, rng.integers(0, args.classes, size=args.batch))

    def make_case(mode):
        step, optimizer = thor_train_step(strategy, build_model, args.batch,
                                          frequency=args.frequency, replica_division=mode)
        step(inputs)   # traced, and the first refresh, outside the rounds
        return step, optimizer

    names = list(MODES) if replicas > 1 else ["one process"]
    cases = {name: make_case(MODES.get(name)) for name in names}
    samples = {name: {phase: [] for phase in PHASES} for name in cases}
    for round_index in range(args.rounds):
        for name in names if round_index % 2 else names[::-1]:
            step, optimizer = cases[name]
            layer = next(iter(optimizer.curvature.values()))
            phase = ("filling" if float(layer.count.numpy()) < optimizer.preconditioner.filled
                     else "settled")
            start = time.perf_counter()
            for _ in range(args.frequency):
                step(inputs)
            samples[name][phase].append((time.perf_counter() - start) / args.frequency)

    reports = {name: optimizer.report() for name, (_, optimizer) in cases.items()}
    optimizer, divided = cases[names[0]][1], reports[names[0]].state_divided
    # A divided step gathers each kernel's direction, and its rotated second moment where
    # every replica holds all the state.
    gathered = sum(layer.block.kernel_elements * (1 + (0 if divided else len(
        optimizer.preconditioner.stepped_state(layer))))
        for layer in optimizer.curvature.values())
    return {"replicas": replicas, "owners": optimizer.refresh_owners(max(replicas, 2)),
            "state_bytes": {name: list(report.state_bytes) for name, report in reports.items()},
            "step_gathered_bytes": 4 * gathered,
            "cases": {name: {phase: {"steps": args.frequency * len(times),
                                     "step_ms": 1e3 * float(np.median(times))}
                             for phase, times in by_phase.items() if times}
                      for name, by_phase in samples.items()}}


def run(args):
    """One process, the workers, MirroredStrategy, one process again: results by name."""
    command = [sys.executable, os.path.abspath(__file__), "--case-process"] + [
        f"--{key}={getattr(args, key)}" for key in (
            "model", "hidden", "depth", "batch", "frequency", "rounds", "classes")]

    def launch(kind, envs):
        return run_processes(command + [f"--kind={kind}"], envs)

    before = launch("one", [local_environment()])[0]
    workers = launch("workers", worker_environments(args.workers))
    mirrored = launch("mirrored", [local_environment()])[0]
    after = launch("one", [local_environment()])[0]
    runs = [run["cases"]["one process"] for run in (before, after)]
    one = {phase: {"step_ms": (runs[0][phase]["step_ms"] + runs[1][phase]["step_ms"]) / 2}
           for phase in PHASES if phase in runs[0] and phase in runs[1]}
    return {"one process": {**after, "cases": {"one process": one},
                            "runs_ms": [before["cases"], after["cases"]]},
            f"{args.workers} workers": workers[0],
            "MirroredStrategy, 2 logical CPUs": mirrored}


def report(results, title, args):
    one = results["one process"]["cases"]["one process"]
    print(f"{title}, global batch {args.batch}, thor(model, frequency={args.frequency}); "
          f"median ms per step over {args.rounds} rounds, and / one process with one thread")
    for where, result in results.items():
        for name, phases in result["cases"].items():
            print(f"{where + ', ' + str(name):44}" + "".join(
                f"{phase} {r['step_ms']:8.1f} ({r['step_ms'] / one[phase]['step_ms']:.2f}x)  "
                for phase, r in phases.items() if phase in one))
    for where, result in results.items():
        held = {name: "/".join(f"{count / 2 ** 20:.1f}" for count in counts)
                for name, counts in result["state_bytes"].items()}
        print(f"{where}: a divided step gathers {result['step_gathered_bytes'] / 2 ** 20:.1f} "
              f"MiB; THOR's curvature state per replica (MiB): {held}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="mlp", choices=["mlp", "resnet50", "transformer"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--frequency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--case-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="one", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()
    if args.case_process:
        print(json.dumps(run_case_process(args)))
        return
    title = build(args, np.random.default_rng(0))[2]
    results = run(args)
    report(results, title, args)
    emit({"benchmark": "thor_workers", "machine": machine(), "model": args.model,
          "title": title, **{key: getattr(args, key) for key in (
              "workers", "hidden", "depth", "batch", "frequency", "rounds")},
          "results": results}, args.out)


if __name__ == "__main__":
    main()
