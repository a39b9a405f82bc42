"""The documentation builds without warnings, and its runnable code does run.

Convention in README.md and docs/*.md: a ```python block is a runnable example
(the blocks of one page run in order in one namespace, in a fresh process, in a
temporary directory); a ```py block is an excerpt (a signature or a fragment that
needs the reader's data) and is not run. Shell blocks follow the same rule (```bash
runs, ```sh is an excerpt); tests/test_readme_commands.py runs them.
"""
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


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)])
def test_runnable_code_blocks_run(page, tmp_path):
    code = "\n".join(python_blocks(page))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{page}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


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
