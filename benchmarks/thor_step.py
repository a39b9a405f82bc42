"""THOR train-step time against Keras SGD with momentum, same model, same process.

Each case is a compiled train step (forward, loss, gradients, ``apply``) on the
same model and batch (random data made here; nothing is downloaded). A timing
round is a multiple of ``--frequency`` consecutive steps, so each THOR round
holds the same number of THOR steps (statistics, all-reduce, inverses) and
stale steps; cases run interleaved, round after round, and the median per-step
time of each is reported with its ratio to SGD with momentum. ``thor stale`` is
THOR with no refresh in the timed window: what every stale step costs
(preconditioning ``A_inv g G_inv`` and the momentum update).

Models (``--model``, ``all`` runs every one; the defaults are the targets'):

- ``mlp`` (default): 784-512-512-10, batch 512, frequency 100; average <= 1.25x.
- ``digits-mlp``: the ``tf-msopt compare`` MLP (64-64-64-10), batch 64; stale <= 1.1x.
- ``resnet50``: ``keras.applications.ResNet50(weights=None)``, 64x64x3, batch 16,
  frequency 10; average <= 1.1x.
- ``transformer``: tokens (64) -> Embedding 128 -> 2 x [MultiHeadAttention(4 heads,
  key_dim 32) + residual + LayerNorm + Dense 256 relu + Dense 128 + residual +
  LayerNorm] -> average pooling -> Dense, batch 32, frequency 10; every
  EinsumDense/Dense kernel must be preconditioned (checked); average <= 1.3x.

``--workers N`` times the refresh divided among replicas instead (no SGD):
``N`` worker processes on localhost (``MultiWorkerMirroredStrategy``, one CPU thread each)
and one process with ``MirroredStrategy`` over two logical CPUs train ``--model``
(``mlp``: ``--depth`` Dense layers of ``--hidden`` units; ``resnet50`` and ``transformer``
as above) with ``tf_msopt.thor(model, frequency=--frequency)`` in a
custom loop (global batch ``--batch``, each replica its share). Each prints, with the
refresh divided and with every replica refreshing everything
(``TF_MSOPT_THOR_UNDIVIDED_REFRESH=1``), interleaved: the median step between refreshes,
and for the refreshes while the statistics' averages fill (every factor decomposed) and
after (a basis decomposed only where it no longer holds): the median refresh step, its
difference to the step between (the refresh's cost on that worker) and the average step;
then the communication the division adds (the bytes a refresh that changes a basis
gathers, and the time of an all-gather of that size alone). ``--frequency 5 --rounds 16``
gives each phase seven or more refreshes.

``--split`` adds, per model, the split of one THOR step: the stale step, a THOR
step alone, the gradient pass with and without the statistics capture, and the
inversion of every layer's factors (the curvature blocks' ``invert`` and the bare
``damped_inverse_with_status`` op on the same block shapes). The last line
printed is JSON (``--out FILE`` also
writes it to FILE, replacing the file).

    python benchmarks/thor_step.py [--model mlp|digits-mlp|resnet50|transformer|all]
                                   [--batch B] [--frequency F] [--rounds R] [--split]
    python benchmarks/thor_step.py --workers 2 [--model mlp|resnet50|transformer]
                                   [--hidden 512] [--depth 8] [--batch 32]
                                   [--frequency 5 --rounds 16]
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

import tf_msopt as mso  # noqa: E402
from tf_msopt.thor.curvature_base import FactorDamping  # noqa: E402
from timing import (emit, local_environment, machine, run_processes, time_cases,  # noqa: E402
                    worker_environments)

# Per model: defaults, and the target (which case, at most how many times SGD-momentum).
MODELS = {
    "mlp": dict(batch=512, frequency=100, rounds=5, repeats=1,
                target=("average", 1.25)),
    "digits-mlp": dict(batch=64, frequency=10, rounds=7, repeats=20,
                       target=("stale", 1.1)),
    "resnet50": dict(batch=16, frequency=10, rounds=3, repeats=1,
                     target=("average", 1.1)),
    "transformer": dict(batch=32, frequency=10, rounds=3, repeats=2,
                        target=("average", 1.3)),
}


# --- models and data


def mlp(args, rng):
    def model():
        return keras.Sequential([
            keras.Input((args.features,)),
            keras.layers.Dense(args.hidden, activation="relu"),
            keras.layers.Dense(args.hidden, activation="relu"),
            keras.layers.Dense(args.classes),
        ])
    x = rng.normal(size=(args.batch, args.features)).astype("float32")
    return model, x, f"MLP {args.features}-{args.hidden}-{args.hidden}-{args.classes}"


def digits_mlp(args, rng):
    from tf_msopt.compare import make_model

    def model():
        return make_model("mlp", (64,), args.classes)
    x = rng.normal(size=(args.batch, 64)).astype("float32")
    return model, x, f"digits MLP 64-64-64-{args.classes} (tf-msopt compare), softmax output"


def resnet50(args, rng):
    def model():
        return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3),
                                           classes=args.classes, classifier_activation=None)
    x = rng.normal(size=(args.batch, 64, 64, 3)).astype("float32")
    return model, x, "keras.applications.ResNet50(weights=None), 64x64x3"


def transformer(args, rng):
    width, heads, sequence = 128, 4, args.sequence

    def model():
        tokens = keras.Input((sequence,), dtype="int32")
        h = keras.layers.Embedding(args.vocab, width)(tokens)
        for _ in range(2):
            attention = keras.layers.MultiHeadAttention(heads, width // heads)(h, h)
            h = keras.layers.LayerNormalization()(h + attention)
            feed = keras.layers.Dense(2 * width, activation="relu")(h)
            feed = keras.layers.Dense(width)(feed)
            h = keras.layers.LayerNormalization()(h + feed)
        h = keras.layers.GlobalAveragePooling1D()(h)
        return keras.Model(tokens, keras.layers.Dense(args.classes)(h))
    x = rng.integers(0, args.vocab, size=(args.batch, sequence)).astype("int32")
    return model, x, (f"transformer, 2 blocks, width {width}, {heads} heads, sequence "
                      f"{sequence}, vocabulary {args.vocab}")


BUILDERS = {"mlp": mlp, "digits-mlp": digits_mlp, "resnet50": resnet50,
            "transformer": transformer}


def check_all_kernels_preconditioned(optimizer):
    """Fails loudly unless every Dense/EinsumDense kernel has a THOR rule."""
    report = optimizer.report()
    kernels = [row for row in report.rows if row.layer_type in ("Dense", "EinsumDense")
               and row.variable.endswith("kernel")]
    missing = [f"{row.variable}: {row.reason}" for row in kernels if row.rule == "first order"]
    if missing or len(kernels) != 2 * 4 + 2 * 2 + 1:
        raise SystemExit(f"transformer: expected 13 Dense/EinsumDense kernels, all "
                         f"preconditioned; got {len(kernels)}, first order: {missing}\n{report}")
    return len(kernels)


# --- steps


class Case:
    """One model with one optimizer; compiled steps on the same batch."""

    def __init__(self, make_model, make_optimizer, x, y):
        keras.utils.set_random_seed(0)
        self.model = make_model()
        self.optimizer = make_optimizer(self.model)
        self.optimizer.build(self.model.trainable_variables)
        self.x, self.y = tf.constant(x), tf.constant(y)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=self.model.layers[-1].activation is not keras.activations.softmax)

    def _gradients(self):
        with tf.GradientTape() as tape:
            loss = self.loss_fn(self.y, self.model(self.x, training=True))
        return tape.gradient(loss, self.model.trainable_variables)

    def step(self, thor_step=None, jit_compile=False):
        """The train step; ``thor_step`` True/False forces the kind of THOR step (it sets
        the optimizer's step counter first); ``jit_compile`` compiles it with XLA."""
        variables = self.model.trainable_variables

        @tf.function(jit_compile=jit_compile)
        def step():
            if thor_step is not None:
                self.optimizer.iterations.assign(0 if thor_step else 1)
            self.optimizer.apply(self._gradients(), variables)
        return step

    def gradients(self, capture):
        """Forward and backward pass only, with THOR's statistics capture on or off."""
        @tf.function
        def gradients():
            self.optimizer.iterations.assign(0 if capture else 1)
            return self._gradients()
        return gradients

    def inversion(self, bare):
        """Every layer's new inverses from its captured statistics: the blocks' ``invert``
        (damping, padding, retry guard), or (``bare``) only the inverse op on the same
        blocks."""
        from tf_msopt.ops.inverse import damped_inverse_with_status

        optimizer = self.optimizer
        blocks = [block for block in optimizer._model_link.blocks if block.has_factors]
        statistics = optimizer._model_link.connection.statistics
        previous = [(state.a_inverse, state.g_inverse)
                    for state in optimizer.curvature.values()]
        damping = tf.sqrt(0.03)

        @tf.function
        def invert():
            results = []
            for block, stats, (a_old, g_old) in zip(blocks, statistics, previous):
                rows = tf.maximum(tf.convert_to_tensor(stats.rows), 1.0)
                a, g = stats.a / rows, stats.g / rows
                if bare:
                    results += [damped_inverse_with_status(m, damping)[0]
                                for m in (a, g) if m.shape.rank == 3]
                else:
                    results.append(block.invert(a, g, FactorDamping(damping, damping),
                                                (a_old, g_old), optimizer.options.block_size)[0])
            return results
        return invert


def run_model(name, args):
    spec = MODELS[name]
    args = argparse.Namespace(**vars(args))
    for key in ("batch", "frequency", "rounds", "repeats"):
        if getattr(args, key) is None:
            setattr(args, key, spec[key])
    rng = np.random.default_rng(0)
    make_model, x, title = BUILDERS[name](args, rng)
    y = rng.integers(0, args.classes, size=args.batch).astype("int32")

    def sgd(model):
        return keras.optimizers.SGD(0.01, momentum=0.9)

    def thor(frequency):
        return lambda model: mso.thor(model, 0.01, 0.03, 0.9, frequency=frequency,
                                      block_size=args.block_size)

    cases = {"sgd momentum": Case(make_model, sgd, x, y),
             f"thor F={args.frequency}": Case(make_model, thor(args.frequency), x, y),
             "thor stale": Case(make_model, thor(10**9), x, y)}  # one THOR step, in warm-up
    report = cases["thor stale"].optimizer.report()
    kernels = check_all_kernels_preconditioned(cases["thor stale"].optimizer) \
        if name == "transformer" else None
    steps = {key: case.step() for key, case in cases.items()}
    if args.split:
        split_case = Case(make_model, thor(args.frequency), x, y)
        steps.update({
            "thor step alone": split_case.step(thor_step=True),
            "grads, capture off": split_case.gradients(capture=False),
            "grads, capture on": split_case.gradients(capture=True),
        })
        split_case.gradients(capture=True)()       # statistics for the inversions
        steps["inversion (blocks)"] = split_case.inversion(bare=False)
        steps["inverse op alone"] = split_case.inversion(bare=True)
        steps["empty tf.function"] = tf.function(lambda: tf.constant(0.0))

    print(f"\n== {name}: {title}, batch {args.batch}, frequency {args.frequency}, blocks of "
          f"{args.block_size}, inverse back-end {mso.ops.inverse.inverse_backend()}")
    print(f"   {len(report.preconditioned)} variable(s) with a THOR rule, "
          f"{len(report.first_order)} first order"
          + (f"; all {kernels} Dense/EinsumDense kernels preconditioned" if kernels else ""))
    calls = args.frequency * args.repeats
    # A warm-up of `frequency` steps keeps each timed round aligned on the THOR steps.
    times = time_cases(steps, args.rounds, calls, warmup=args.frequency)
    baseline = times["sgd momentum"]
    print(f"{'case':>22} {'ms/step':>9} {'vs SGD':>7}")
    for key, seconds in times.items():
        print(f"{key:>22} {1e3 * seconds:9.3f} {seconds / baseline:7.3f}x")
    which, limit = spec["target"]
    target_case = f"thor F={args.frequency}" if which == "average" else "thor stale"
    ratio = times[target_case] / baseline
    print(f"target: {target_case} <= {limit}x SGD momentum: {ratio:.3f}x, "
          f"{'met' if ratio <= limit else 'MISSED'}")
    result = {"args": {k: v for k, v in vars(args).items() if k != "model"},
              "ms_per_step": {k: 1e3 * v for k, v in times.items()},
              "ratio_vs_sgd": {k: v / baseline for k, v in times.items()},
              "target": {"case": target_case, "ratio_vs_sgd": limit, "met": ratio <= limit}}
    if args.split:
        result["split_ms"] = print_split(times, args.frequency)
    return result


def print_split(times, frequency):
    """The THOR step's extra cost over a stale step, by part (ms)."""
    ms = {k: 1e3 * v for k, v in times.items()}
    capture = ms["grads, capture on"] - ms["grads, capture off"]
    extra = ms["thor step alone"] - ms["thor stale"]
    call = ms["empty tf.function"]       # the call overhead in the inversions timed alone
    inversion, inverse_op = ms["inversion (blocks)"] - call, ms["inverse op alone"] - call
    split = {
        "sgd momentum step": ms["sgd momentum"],
        "stale step": ms["thor stale"],
        "preconditioning (stale - sgd)": ms["thor stale"] - ms["sgd momentum"],
        "thor step": ms["thor step alone"],
        "thor step extra (thor - stale)": extra,
        "capture (grads on - off)": capture,
        "all-reduce": 0.0,
        "inversion (blocks' invert, less a call)": inversion,
        "of which the inverse op": inverse_op,
        "rest (extra - capture - inversion)": extra - capture - inversion,
        f"THOR step amortised over F={frequency}": extra / frequency,
    }
    print("split of a THOR step (ms; one device, so the all-reduce is the identity):")
    for key, value in split.items():
        print(f"{key:>40} {value:9.3f}")
    return split


# --- the refresh divided among workers (--workers)

UNDIVIDED = "TF_MSOPT_THOR_UNDIVIDED_REFRESH"


def scale_out_strategy():
    """``MultiWorkerMirroredStrategy`` under ``TF_CONFIG`` (one CPU thread), else
    ``MirroredStrategy`` over two logical CPUs (one thread each)."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    if "TF_CONFIG" in os.environ:
        tf.config.threading.set_inter_op_parallelism_threads(1)
        return tf.distribute.MultiWorkerMirroredStrategy()
    tf.config.threading.set_inter_op_parallelism_threads(2)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def scale_out_model(args, rng):
    """``(build_model, global batch of inputs, title)`` of ``--model`` under ``--workers``:
    ``mlp`` is ``--depth`` Dense layers of ``--hidden`` units."""
    if args.model != "mlp":
        return BUILDERS[args.model](args, rng)

    def model():
        return keras.Sequential(
            [keras.Input((args.hidden,))]
            + [keras.layers.Dense(args.hidden, activation="relu") for _ in range(args.depth - 1)]
            + [keras.layers.Dense(args.classes)])
    x = rng.normal(size=(args.batch, args.hidden)).astype("float32")
    return model, x, f"{args.depth} Dense layers of {args.hidden}"


def shared_batch(strategy, x, y):
    """The global batch ``(x, y)`` (integer labels ``y``) as equal shares, one a replica."""
    share = len(x) // strategy.num_replicas_in_sync
    y = y.astype("int32")
    return strategy.experimental_distribute_values_from_function(lambda context: (
        tf.constant(x[share * context.replica_id_in_sync_group:][:share]),
        tf.constant(y[share * context.replica_id_in_sync_group:][:share])))


def thor_train_step(strategy, build_model, global_batch, **options):
    """``(step, optimizer)``: a model of ``build_model`` and ``tf_msopt.thor(model,
    **options)`` made under ``strategy``, and its compiled custom-loop step on a
    :func:`shared_batch` (the loss averaged over ``global_batch``)."""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = build_model()
        optimizer = mso.thor(model, **options)
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(batch):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    keras.losses.sparse_categorical_crossentropy(
                        y, model(x, training=True), from_logits=True),
                    global_batch_size=global_batch)
            optimizer.apply(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables)
        strategy.run(replica_step, args=batch)
    return step, optimizer


def scale_out_worker(args):
    """This worker's timings (see the module's docstring), as a dict."""
    strategy = scale_out_strategy()
    replicas = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    build_model, x, _ = scale_out_model(args, rng)
    inputs = shared_batch(strategy, x, rng.integers(0, args.classes, size=args.batch))

    def make_case(undivided):
        # (the refresh alone divided: benchmarks/thor_workers.py times the divided step)
        step, optimizer = thor_train_step(strategy, build_model, args.batch,
                                          frequency=args.frequency,
                                          replica_division="refresh")
        os.environ[UNDIVIDED] = "1" if undivided else "0"   # read while the step is traced
        for _ in range(args.frequency):
            step(inputs)
        return step, optimizer

    cases = {"divided": make_case(False), "undivided": make_case(True)}
    samples = {name: {"filling": [], "settled": [], "between": []} for name in cases}
    # Two untimed rounds first: the first refresh after switching to the other case's
    # function once costs a second or more.
    for round_index in range(-2, args.rounds):
        for name in (list(cases) if round_index % 2 else list(cases)[::-1]):
            step, optimizer = cases[name]
            layer = next(iter(optimizer.curvature.values()))
            for _ in range(args.frequency):
                refresh = int(optimizer.iterations.numpy()) % args.frequency == 0
                start = time.perf_counter()
                step(inputs)
                elapsed = time.perf_counter() - start
                # While the averages fill, every refresh decomposes every factor; after,
                # only those whose basis no longer holds.
                phase = ("between" if not refresh else "filling"
                         if float(layer.count.numpy()) < optimizer.preconditioner.filled
                         else "settled")
                if round_index >= 0:
                    samples[name][phase].append(elapsed)

    # The communication a divided refresh adds: one all-gather of the refreshed state (each
    # replica's share; timed with equal shares).
    optimizer = cases["divided"][1]
    elements = sum(variable.shape.num_elements() for layer in optimizer.curvature.values()
                   for variable in optimizer.preconditioner.refreshed_state(layer))

    @tf.function
    def all_gather():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_gather(
            tf.zeros([elements // replicas]), axis=0))

    all_gather()
    gather_times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        all_gather()
        gather_times.append(time.perf_counter() - start)

    result = {"replicas": replicas, "owners": optimizer.refresh_owners(replicas),
              "gathered_bytes": 4 * elements,
              "all_gather_ms": 1e3 * float(np.median(gather_times))}
    for name, times in samples.items():
        median = {phase: 1e3 * float(np.median(values)) for phase, values in times.items()}
        between = median["between"]
        result[name] = {"between_ms": between, **{phase: {
            "refreshes": len(times[phase]), "refresh_step_ms": median[phase],
            "refresh_ms": median[phase] - between,
            "average_step_ms": (median[phase] + (args.frequency - 1) * between)
            / args.frequency} for phase in ("filling", "settled")}}
    return result


def run_scale_out(args, title):
    """``args.workers`` MultiWorkerMirroredStrategy workers on localhost, then one
    MirroredStrategy process over two logical CPUs; returns their results by name."""
    command = [sys.executable, os.path.abspath(__file__), "--scale-out-worker",
               "--model", args.model, "--hidden", str(args.hidden), "--depth", str(args.depth),
               "--batch", str(args.batch), "--frequency", str(args.frequency), "--rounds",
               str(args.rounds), "--classes", str(args.classes)]
    workers = run_processes(command, worker_environments(args.workers))
    mirrored = run_processes(command, [local_environment()])
    results = {f"worker {index}": result for index, result in enumerate(workers)}
    results["MirroredStrategy, 2 logical CPUs"] = mirrored[0]
    print(f"{title}, global batch {args.batch}, "
          f"thor(model, frequency={args.frequency}); ms per step, medians of {args.rounds} rounds")
    print(f"{'':44}{'refresh step':>13}{'between':>9}{'refresh':>9}{'average':>9}")
    for where, result in results.items():
        for phase in ("filling", "settled"):
            for name in ("undivided", "divided"):
                r = result[name][phase]
                print(f"{where + ', ' + phase + ', ' + name:44}{r['refresh_step_ms']:>13.1f}"
                      f"{result[name]['between_ms']:>9.1f}{r['refresh_ms']:>9.1f}"
                      f"{r['average_step_ms']:>9.1f}")
            divided, undivided = result["divided"][phase], result["undivided"][phase]
            print(f"{'':4}{phase}, divided/undivided: refresh "
                  f"{divided['refresh_ms'] / undivided['refresh_ms']:.2f}x, average step "
                  f"{divided['average_step_ms'] / undivided['average_step_ms']:.2f}x")
        print(f"{'':4}all-gather of {result['gathered_bytes'] / 2 ** 20:.1f} MiB (a refresh "
              f"that changes a basis): {result['all_gather_ms']:.1f} ms")
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=[*MODELS, "all"])
    parser.add_argument("--features", type=int, default=784, help="mlp only")
    parser.add_argument("--hidden", type=int, default=512, help="mlp only")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=1000, help="transformer only")
    parser.add_argument("--sequence", type=int, default=64, help="transformer only")
    parser.add_argument("--batch", type=int, help="default: the model's (see above)")
    parser.add_argument("--frequency", type=int, help="default: the model's")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, help="default: the model's")
    parser.add_argument("--repeats", type=int,
                        help="frequency-long runs per round (default: the model's)")
    parser.add_argument("--split", action="store_true",
                        help="also time the parts of a THOR step")
    parser.add_argument("--workers", type=int,
                        help="time the refresh divided among this many workers instead")
    parser.add_argument("--depth", type=int, default=8, help="--workers only: Dense layers")
    parser.add_argument("--scale-out-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the JSON line to this file (replacing it)")
    args = parser.parse_args()
    if args.scale_out_worker or args.workers:
        args.batch = args.batch or 32
        args.frequency = args.frequency or 10
        args.rounds = args.rounds or 10
        if args.model == "all":
            parser.error("--workers times one --model")
        if args.scale_out_worker:
            print(json.dumps(scale_out_worker(args)))
            return
        title = scale_out_model(args, np.random.default_rng(0))[2]
        emit({"benchmark": "thor_step_workers", "machine": machine(), "model": args.model,
              "title": title, "hidden": args.hidden, "depth": args.depth, "batch": args.batch,
              "frequency": args.frequency, "rounds": args.rounds,
              "results": run_scale_out(args, title)}, args.out)
        return

    names = list(MODELS) if args.model == "all" else [args.model]
    results = {name: run_model(name, args) for name in names}
    emit({
        "benchmark": "thor_step", "machine": machine(),
        "inverse_backend": mso.ops.inverse.inverse_backend(), "models": results,
    }, args.out)


if __name__ == "__main__":
    main()
