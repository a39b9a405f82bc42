"""The batch-size table and plot of docs/convergence.md (see benchmarks/render.py): steps and
training time to the target against the batch, each optimizer at its best grid point and the
default THOR, from benchmarks/batch_scaling.py's results."""
import hashlib
import json
import math
import os

from render_common import _x, load, machine_line, table

BATCH_SCALING_FILES = ["batch_scaling_teacher.json", "batch_scaling_mnist1d.json"]
# The plot, relative to docs/; its SVG metadata names the digest of the results it shows.
PLOT = "images/batch_scaling.svg"
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def _point(result, setting=None):
    if not math.isfinite(result["steps"]):
        return "miss"
    text = f"{result['steps']:g} / {result['seconds']:.1f} s"
    if setting:
        text += f" ({setting}{', edge' if result.get('edge') else ''})"
    return text


def render_batch_scaling(results):
    from batch_scaling import OPTIMIZERS, shown, summary

    out = []
    for name in BATCH_SCALING_FILES:
        payload = load(name, results)
        info = summary(payload["results"], payload.get("retimed"))
        rows = []
        for batch, row in sorted(info["batches"].items(), key=lambda item: int(item[0])):
            ratios = row.get("ratios", {})
            rows.append([batch, _point(row["default THOR"])]
                        + [_point(row["best"][n], row["best"][n]["setting"])
                           if n in row["best"] else "" for n in OPTIMIZERS]
                        + [f"{_x(ratios['steps'])} / {_x(ratios['seconds'])}"
                           if ratios and math.isfinite(ratios["steps"]) else "n/a"])
        critical = ", ".join(f"{shown(n)} {'>= ' if c['at_least'] else ''}{c['batch']}"
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
            + table(["batch", "default THOR", *(f"{shown(n)}, best" for n in OPTIMIZERS),
                     "default THOR / best first-order: steps / time"], rows)
            + f"\nCritical batch sizes (steps to target cut by 1.6x per doubling): {critical}.\n"
            + machine_line(payload, files=[name]))
    out.append(f"![Steps and training seconds to the target against the batch size, "
               f"log-log, a row per task]({PLOT})\n")
    return "\n".join(out)


def _plotted(results):
    """The payloads the plot shows and their digest."""
    payloads = [load(name, results) for name in BATCH_SCALING_FILES]
    digest = hashlib.sha256(json.dumps(payloads, sort_keys=True).encode()).hexdigest()
    return payloads, f"results sha256 {digest}"


def draw_batch_scaling_plot(results, docs=DOCS):
    from batch_scaling import plot

    payloads, description = _plotted(results)
    os.makedirs(os.path.dirname(os.path.join(docs, PLOT)), exist_ok=True)
    plot(payloads, os.path.join(docs, PLOT), description=description)


def batch_scaling_plot_is_current(results, docs=DOCS):
    """Whether the plot exists and names the digest of the current results files."""
    path = os.path.join(docs, PLOT)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return _plotted(results)[1] in f.read()
