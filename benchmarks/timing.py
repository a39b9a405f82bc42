"""Interleaved timing shared by the benchmarks: every case in one process, round after round."""
import json
import os
import platform
import socket
import statistics
import subprocess
import time
from unittest import mock


def traced_without_custom_ops(step):
    """``step`` (a ``tf.function``) traced with the custom ops switched off: the op is chosen
    when the step is traced, so its later calls run the pure-TensorFlow path."""
    from tf_msopt.ops import _loader

    with mock.patch.dict(os.environ, {_loader.DISABLE_ENV: "1"}):
        step.get_concrete_function()
    return step


def balanced_orders(count):
    """Orders of ``count`` cases in which each case runs right after every other one equally
    often (a Williams Latin square): ``count`` orders for an even count, twice that for an odd one.
    """
    first = [0]
    low, high = 1, count - 1
    for position in range(1, count):
        if position % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    orders = [[(case + shift) % count for case in first] for shift in range(count)]
    if count % 2:
        orders += [order[::-1] for order in orders]
    return orders


def time_cases(steps, rounds, calls_per_round, warmup=3, idle=0.0):
    """Median seconds per call of each zero-argument callable in ``steps``.

    With ``idle`` (seconds), the process sleeps that long before each call, outside
    the timed span: a step that follows other work, as an offloaded optimizer's host
    step follows the accelerator's forward and backward pass, instead of a step that
    finds the caches and thread pools hot from its own previous call.

    Cases run interleaved, one batch of ``calls_per_round`` each per round, so
    noise on a shared machine hits them alike. The order changes every round
    (:func:`balanced_orders`), so that no case always runs right after the same other
    one: a case that follows another library's OpenMP loop (whose workers spin on for a
    while after it returns) or any case that leaves the machine busy runs slower, by up to
    20 % on a 2-core machine. Rotating one fixed order would not do: each case would still
    follow the same neighbour.
    """
    for step in steps.values():  # trace and warm up
        for _ in range(warmup):
            step()
    samples = {name: [] for name in steps}
    names = list(steps)
    orders = balanced_orders(len(names))
    for round_index in range(rounds):
        for position in orders[round_index % len(orders)]:
            name = names[position]
            step = steps[name]
            seconds = 0.0
            if idle:
                for _ in range(calls_per_round):
                    time.sleep(idle)
                    start = time.perf_counter()
                    step()
                    seconds += time.perf_counter() - start
            else:
                start = time.perf_counter()
                for _ in range(calls_per_round):
                    step()
                seconds = time.perf_counter() - start
            samples[name].append(seconds / calls_per_round)
    return {name: statistics.median(times) for name, times in samples.items()}


def machine(cpuinfo="/proc/cpuinfo"):
    """The machine a result comes from: CPU model (with its widest vector extension), core
    count, the TensorFlow and Keras versions and whether TensorFlow ran oneDNN's kernels
    (its default leaves them off on an AVX2 CPU, which then runs Eigen's), as the results
    files name it."""
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break       # the first processor's fields end at its blank line
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    # A virtual machine's model name may say only "AMD EPYC"; its family and flags tell
    # the core: family 25 is Zen 3 or, with AVX-512, Zen 4; family 26 is Zen 5.
    if fields.get("vendor_id") == "AuthenticAMD" and "Zen" not in model:
        core = {"25": "Zen 4" if "avx512f" in flags else "Zen 3", "26": "Zen 5"}.get(
            fields.get("cpu family"))
        model = f"{model} ({core})" if core else model
    vector = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"))
                   if flag in flags), None)
    found = {"cpu": f"{model}, {vector}" if vector else model, "cpus": os.cpu_count()}
    for module in ("tensorflow", "keras"):
        try:
            found[module] = __import__(module).__version__
        except ImportError:
            pass
    if "tensorflow" in found:
        from tf_msopt import _keras_compat
        found["onednn"] = _keras_compat.onednn_enabled()
    return found


def emit(payload, out=None):
    """Prints ``payload`` as the last line of output (JSON); with ``out``, also writes it to
    that file, replacing it (benchmarks/render.py renders the docs' tables from such files)."""
    print(json.dumps(payload))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out + ".tmp", "w") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")
        os.replace(out + ".tmp", out)


def run_processes(command, envs):
    """Runs ``command`` once per environment of ``envs`` (all at once: workers that meet in
    collectives) and returns the JSON each prints last; a failure stops them all."""
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for env in envs]
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=3600)
            if process.returncode != 0:
                raise SystemExit(f"a process failed:\n{stderr[-4000:]}")
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:   # a failed worker leaves the others waiting in a collective
        for process in processes:
            if process.poll() is None:
                process.kill()
    return results


def worker_environments(workers):
    """This environment with the ``TF_CONFIG`` of each of ``workers`` workers on localhost
    (``MultiWorkerMirroredStrategy``), on free ports."""
    ports = []
    for _ in range(workers):
        with socket.socket() as sock:
            sock.bind(("localhost", 0))
            ports.append(sock.getsockname()[1])
    cluster = {"worker": [f"localhost:{port}" for port in ports]}
    return [dict(local_environment(), TF_CONFIG=json.dumps({
        "cluster": cluster, "task": {"type": "worker", "index": index}}))
        for index in range(workers)]


def local_environment():
    """This environment without a ``TF_CONFIG``: one process on its own."""
    return {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
