"""The size rules the library's code keeps (docs/internals.md), read from its source."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "gradtools"
MODULES = sorted(PACKAGE.glob("*.py"))  # the demo, a program of its own, aside


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def _code_lines(source: list[str], node: ast.AST, docstrings: set[int]) -> int:
    """Lines of ``node``, nested functions included, but blank, comment and docstring lines."""
    return sum(
        1
        for i in range(node.lineno, node.end_lineno + 1)
        if i not in docstrings
        and source[i - 1].strip()
        and not source[i - 1].strip().startswith("#")
    )


def test_the_package_has_modules_to_check():
    assert len(MODULES) >= 15, MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_function_is_longer_than_45_code_lines_counting_nested_ones(path):
    text = path.read_text()
    tree, source = ast.parse(text), text.splitlines()
    docstrings = _docstring_lines(tree)
    long = {
        f"{node.name} (line {node.lineno}): {_code_lines(source, node, docstrings)}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and _code_lines(source, node, docstrings) > 45
    }
    assert not long, long


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_module_is_longer_than_450_lines(path):
    assert len(path.read_text().splitlines()) <= 450


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_module_global_registry_or_ambient_context(path):
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"weakref", "contextvars"}, imported


def test_the_length_count_sees_nested_functions():
    """The counter the tests above use, on a function whose nested def makes it long."""
    source = (
        "def outer():\n    '''doc'''\n    # note\n\n    def inner():\n" + "        x = 1\n" * 50
    )
    tree = ast.parse(source)
    outer = tree.body[0]
    assert _code_lines(source.splitlines(), outer, _docstring_lines(tree)) == 52


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _foreign_private_names(source: str) -> set[str]:
    """The underscore names ``source`` takes from other gradtools modules: imported by name
    (``from gradtools.x import _y``), or read off an imported module (``_x._y``, ``x._y``)."""
    tree = ast.parse(source)
    modules, found = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradtools"):
            for alias in node.names:
                if node.module == "gradtools":
                    modules.add(alias.asname or alias.name)  # from gradtools import _tree
                elif _private(alias.name):
                    found.add(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in modules and _private(node.attr):
                found.add(f"{node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_underscore_name_is_taken_from_another_module(path):
    """What modules share has a name without an underscore, in a module of its own if need be."""
    assert not _foreign_private_names(path.read_text())


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_array_is_matched_by_identity(path):
    calls = [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "id"
    ]
    assert not calls, f"id() at lines {calls}"


def test_the_private_name_check_sees_both_forms():
    source = (
        "from gradtools import _tree, clipping\n"
        "from gradtools.naming import _flatten, path_names\n"
        "_tree.find(x)\nclipping._known(y)\n_tree._private(z)\n"
    )
    assert _foreign_private_names(source) == {
        "gradtools.naming._flatten",
        "clipping._known",
        "_tree._private",
    }
