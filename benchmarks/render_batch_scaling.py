"""The batch-size table of docs/convergence.md (see benchmarks/render.py): steps and training
time to the target against the batch, each optimizer at its best grid point and the default
THOR, from benchmarks/batch_scaling.py's results."""
import math

from render_common import _x, load, machine_line, table

BATCH_SCALING_FILES = ["batch_scaling_teacher.json", "batch_scaling_mnist1d.json"]
COLUMNS = ("THOR", "Adam", "Muon", "LARS")


def _point(result, setting=None):
    if not math.isfinite(result["steps"]):
        return "miss"
    text = f"{result['steps']:g} / {result['seconds']:.1f} s"
    if setting:
        text += f" ({setting}{', edge' if result.get('edge') else ''})"
    return text


def render_batch_scaling(results):
    from batch_scaling import summary

    out = []
    for name in BATCH_SCALING_FILES:
        payload = load(name, results)
        info = summary(payload["results"], payload.get("retimed"))
        rows = []
        for batch, row in sorted(info["batches"].items(), key=lambda item: int(item[0])):
            ratios = row.get("ratios", {})
            rows.append([batch, _point(row["default THOR"])]
                        + [_point(row["best"][n], row["best"][n]["setting"])
                           if n in row["best"] else "" for n in COLUMNS]
                        + [f"{_x(ratios['steps'])} / {_x(ratios['seconds'])}"
                           if ratios and math.isfinite(ratios["steps"]) else "n/a"])
        critical = ", ".join(f"{n} {'>= ' if c['at_least'] else ''}{c['batch']}"
                             for n, c in info["critical"].items())
        task = payload["task"]
        timed = (f"the seconds of {payload['rounds']} more rounds of those settings, "
                 "interleaved" if payload.get("retimed") else "the seconds of the grid's runs")
        out.append(
            f"{task['title']}, target validation accuracy {payload['target']:g}, at most "
            f"{payload['max_steps']} steps, validated every {payload['eval_every']}; medians "
            f"over seeds {', '.join(map(str, payload['seeds']))}; steps / training seconds to "
            "the target, each optimizer at the best point of its learning-rate grid "
            f"(*edge*: the best is an end of the grid), {timed}:\n\n"
            + table(["batch", "default THOR", "THOR, best", "Adam, best", "Muon, best",
                     "LARS, best", "default THOR / best first-order: steps / time"], rows)
            + f"\nCritical batch sizes (steps to target cut by 1.6x per doubling): {critical}.\n"
            + machine_line(payload, files=[name]))
    return "\n".join(out)
