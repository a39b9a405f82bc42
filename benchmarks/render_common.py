"""What the renderers of benchmarks/render.py share: reading a results file, and writing a
table and the line that says where its figures come from."""
import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load(name, results=RESULTS):
    with open(os.path.join(results, name)) as f:
        return json.load(f)


def _machine_text(payload):
    m = payload.get("machine") or {}
    if not isinstance(m, dict):
        return str(m)
    # Files from before the CPU model was recorded name their machines in the note.
    cpu = (f"{m.get('cpus')}-core {m['cpu']}" if m.get("cpu")
           else payload.get("note", "machine not recorded"))
    return (f"{cpu}, TensorFlow {m.get('tensorflow')}"
            + (", oneDNN's kernels off" if m.get("onednn") is False else ""))


def machine_line(*payloads, files):
    """Where the figures come from: the files and the machine they name; with one payload
    per file from more than one machine, each machine after its files."""
    machines = [_machine_text(payload) for payload in payloads]
    distinct = list(dict.fromkeys(machines))

    def names(chosen):
        return ", ".join(f"`benchmarks/results/{f}`" for f in chosen)

    if len(distinct) > 1 and len(payloads) == len(files):
        return "\nFrom " + "; ".join(
            f"{names([f for f, m in zip(files, machines) if m == text])}: {text}"
            for text in distinct) + ".\n"
    return f"\nFrom {names(files)}; {'; '.join(distinct)}.\n"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _x(ratio):
    return f"{ratio:.2f}x"


def _ms(value):
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"
