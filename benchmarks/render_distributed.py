"""The tables of docs/distributed.md (see benchmarks/render.py): THOR's refresh and step
divided among workers, measured, and the cost model's predictions for more workers."""
from render_common import _x, load, machine_line, table

WORKERS_FILES = ["thor_step_workers.json", "thor_step_workers_1024.json",
                 "thor_step_workers_resnet50.json", "thor_step_workers_transformer.json"]


def render_thor_step_workers(results):
    payloads = [load(name, results) for name in WORKERS_FILES]
    rows = []
    for r in payloads:
        model = {"mlp": f"{r['depth']} Dense x {r['hidden']}", "resnet50": "ResNet50, 64x64",
                 "transformer": "2-block transformer, width 128"}[r["model"]]
        model += f", batch {r['batch']}, {r['rounds']} rounds"
        for where, result in r["results"].items():
            divided, undivided = result["divided"], result["undivided"]
            rows += [[model, where, phase]
                     + [f"{undivided[phase][key]:.0f} / {divided[phase][key]:.0f}"
                        for key in ("refresh_ms", "average_step_ms")]
                     + [_x(divided[phase]["refresh_ms"] / undivided[phase]["refresh_ms"]),
                        _x(divided[phase]["average_step_ms"]
                           / undivided[phase]["average_step_ms"]),
                        f"{result['gathered_bytes'] / 2 ** 20:.1f} MiB, "
                        f"{result['all_gather_ms']:.0f} ms" if phase == "filling"
                        else "none while every basis holds"]
                     for phase in ("filling", "settled")]
    frequencies = {r["frequency"] for r in payloads}
    return (f"`tf_msopt.thor(model, frequency={'/'.join(map(str, sorted(frequencies)))}, "
            "replica_division=\"refresh\")`, "
            "medians over the rounds; ms, every replica refreshing everything / the refresh "
            "divided; *filling*: the refreshes while the statistics' averages fill (every "
            "factor decomposed), *settled*: those after (bases kept while they hold):\n\n"
            + table(["model", "where", "refreshes", "refresh", "average step",
                     "refresh, divided / not", "average step, divided / not",
                     "all-gather a refresh adds"], rows)
            + machine_line(*payloads, files=WORKERS_FILES))


WORKER_STEP_FILES = ["thor_workers.json", "thor_workers_transformer.json"]
DIVISIONS = {"step": '`"step"`', "refresh": '`"refresh"`', "none": "`None`"}


def render_thor_workers(results):
    payloads = [load(name, results) for name in WORKER_STEP_FILES]
    rows = []
    for r in payloads:
        one = r["results"]["one process"]["cases"]["one process"]
        for where, result in r["results"].items():
            if where == "one process":
                continue
            for name, phases in result["cases"].items():
                rows.append([r["title"] + f", batch {r['batch']}", where, DIVISIONS[name]] + [
                    f"{phases[p]['step_ms']:.1f} ({_x(phases[p]['step_ms'] / one[p]['step_ms'])})"
                    if p in phases and p in one else "not reached" for p in ("filling", "settled")]
                    + [_held(result["state_bytes"][name])])
        rows.append([r["title"] + f", batch {r['batch']}", "one process, one thread", "",
                     *(f"{one[p]['step_ms']:.1f}" for p in ("filling", "settled")),
                     _held(r["results"]["one process"]["state_bytes"]["one process"])])
    frequencies = "/".join(sorted({str(r["frequency"]) for r in payloads}))
    return (f"`tf_msopt.thor(model, frequency={frequencies}, replica_division=...)`, ms per "
            "step (a round's refresh cycle averaged), medians over the rounds, and against "
            "one process with one thread on the global batch; *filling*: while the "
            "statistics' averages fill (every refresh decomposes every factor), *settled*: "
            "after; THOR's curvature state (MiB) on each replica:\n\n"
            + table(["model", "where", "`replica_division`", "filling", "settled",
                     "state per replica"], rows)
            + machine_line(*payloads, files=WORKER_STEP_FILES))


def _held(counts):
    """Bytes per replica, in MiB: ``21.0 / 21.0``."""
    return " / ".join(f"{count / 2 ** 20:.1f}" for count in counts)


COST_MODEL_FILES = ["thor_cost_model.json"]


def render_thor_cost_model(results):
    r = load("thor_cost_model.json", results)
    rows = []
    for model in r["models"].values():
        for row in model["predictions"]:
            ms, speed = row["step_ms"], row["throughput_vs_one"]
            rows.append([model["title"], row["workers"], f"{row['bandwidth_gbps']:g}"]
                        + [f"{ms[d]:.0f} ({speed[d]:.1f}x)" for d in DIVISIONS])
    parts = "; ".join(
        f"{m['title'].split(',')[0]}: " + ", ".join(
            f"{name} {ms:.0f} ms" for name, ms in m["parts_ms"].items())
        + f"; bytes a step: gradients {m['bytes']['gradients'] / 2 ** 20:.0f} MiB, statistics "
        f"{m['bytes']['statistics'] / 2 ** 20:.0f} MiB, divided step "
        f"{m['bytes']['step'] / 2 ** 20:.0f} MiB, refreshed eigenvectors "
        f"{m['bytes']['refreshed'] / 2 ** 20:.0f} MiB every {m['bytes']['frequency']} steps"
        for m in r["models"].values())
    files = sorted({m["parts_file"] for m in r["models"].values()})
    machine = next(iter(r["models"].values()))["parts_machine"]
    return ("Predicted ms per step and throughput against one worker (examples per second), "
            "by `replica_division`:\n\n"
            + table(["model", "workers", "GB/s a worker"] + list(DIVISIONS.values()), rows)
            + f"\nMeasured parts, one worker ({parts}).\n"
            + machine_line({"machine": machine}, files=COST_MODEL_FILES + files))


DISTRIBUTED_TABLES = {  # name: (renderer, the results files it reads)
    "thor_step_workers": (render_thor_step_workers, WORKERS_FILES),
    "thor_workers": (render_thor_workers, WORKER_STEP_FILES),
    "thor_cost_model": (render_thor_cost_model, COST_MODEL_FILES + [
        "default_step.json", "default_step_resnet50.json"]),
}
