"""The documentation builds without warnings, and its runnable code does run.

Convention in README.md and docs/*.md: a ```python block is a runnable example
(the blocks of one page run in order in a namespace and a temporary directory of
their own; all pages in one fresh process); a ```py block is an excerpt (a
signature or a fragment that needs the reader's data) and is not run. Shell blocks follow the same rule (```bash
runs, ```sh is an excerpt); tests/test_readme_commands.py runs them.
"""
import json
import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO_ROOT, "docs")
PAGES = ["README.md"] + sorted(os.path.join("docs", p) for p in os.listdir(DOCS)
                               if p.endswith(".md"))
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(page):
    with open(os.path.join(REPO_ROOT, page)) as f:
        return FENCE.findall(f.read())


@pytest.mark.slow
@pytest.mark.once
def test_mkdocs_build_is_strict_and_warning_free(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "WARNING -" not in log, log   # mkdocs' own format (TensorFlow's start-up lines differ)
    # The API reference really was generated from the docstrings.
    with open(os.path.join(tmp_path, "api", "index.html")) as f:
        api = f.read()
    for name in ("THOR", "AdamOffload", "LossScaleOptimizer", "damped_inverse", "thor_lr"):
        assert name in api, name
    assert "trust" in api  # from the LARS docstring's formula


def test_every_page_is_in_the_navigation():
    with open(os.path.join(REPO_ROOT, "mkdocs.yml")) as f:
        nav = f.read()
    for page in PAGES[1:]:
        assert os.path.basename(page) in nav, page


# Runs each page's blocks in a namespace, a temporary directory and Keras state of its
# own, all pages in one process (one TensorFlow start); prints each failing page's traceback.
RUN_PAGES = """
import json, os, sys, tempfile, traceback
import keras
pages = json.loads(sys.argv[1])
failed = []
for page, code in pages.items():
    keras.backend.clear_session()
    with tempfile.TemporaryDirectory() as directory:
        os.chdir(directory)
        try:
            exec(compile(code, page, "exec"), {"__name__": "__main__"})
        except BaseException:
            failed.append(page)
            print(f"--- {page}:\\n{traceback.format_exc()}", file=sys.stderr)
        os.chdir("/")
print(json.dumps(failed))
"""


@pytest.mark.slow
def test_runnable_code_blocks_run():
    pages = {page: "\n".join(python_blocks(page)) for page in PAGES if python_blocks(page)}
    assert "README.md" in pages and len(pages) >= 5, sorted(pages)
    # A page that sets up devices needs a process whose TensorFlow has not started yet.
    own = [[page] for page, code in pages.items() if "set_logical_device_configuration" in code]
    groups = own + [[page for page in pages if [page] not in own]]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO_ROOT)
    failures = {}
    for group in groups:
        result = subprocess.run(
            [sys.executable, "-c", RUN_PAGES, json.dumps({page: pages[page] for page in group})],
            env=env, capture_output=True, text=True, timeout=900)
        failed = (json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0
                  else group)
        failures.update({page: result.stderr[-4000:] for page in failed})
    assert not failures, "\n".join(f"{page}:\n{log}" for page, log in failures.items())


IMPORT = re.compile(r"^\s*(from [\w.]+ import [\w, ]+|import [\w.]+(?: as \w+)?)\s*$", re.MULTILINE)
DOTTED = re.compile(r"\b(?:tf_msopt|mso)(?:\.[A-Za-z_]\w*)+")


def doc_texts():
    for page in PAGES:
        with open(os.path.join(REPO_ROOT, page)) as f:
            yield page, f.read()


def test_every_import_and_name_the_docs_show_exists():
    """Each import statement in any code block, and each dotted ``tf_msopt.``/``mso.`` name
    in the text (``mso.thor.connect``, ``tf_msopt.thor.ThorReport``, ...), resolves."""
    import importlib

    import tf_msopt

    statements, names = set(), set()
    for page, text in doc_texts():
        statements.update((page, s) for s in IMPORT.findall(text) if "tf_msopt" in s)
        names.update((page, n) for n in DOTTED.findall(text))
    assert any("from tf_msopt.thor import ThorReport" in s for _, s in statements) or any(
        n.endswith("thor.ThorReport") for _, n in names)
    for page, statement in sorted(statements):
        exec(statement, {})                                    # noqa: S102
    for page, name in sorted(names):
        target, path = tf_msopt, "tf_msopt"
        for part in name.split(".")[1:]:
            path += "." + part
            if not hasattr(target, part):
                importlib.import_module(path)        # a submodule not imported by its parent
            target = getattr(target, part)
