"""The code and the docs stay within a reader's span: no module of the package over 450
lines, no class over 250 (its docstring included), no page of the docs over 450."""
import ast
import pathlib

import pytest

from helpers import REPO_ROOT

ROOT = pathlib.Path(REPO_ROOT)
MODULES = sorted((ROOT / "tf_msopt").rglob("*.py"))
PAGES = sorted((ROOT / "docs").glob("*.md"))


def _lines(path):
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("module", MODULES, ids=lambda path: str(path.relative_to(ROOT)))
def test_modules_and_classes_fit_a_reader(module):
    assert _lines(module) <= 450
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ClassDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            assert node.end_lineno - first + 1 <= 250, node.name


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.name)
def test_pages_fit_a_reader(page):
    assert _lines(page) <= 450
