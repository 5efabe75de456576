"""The documentation: every public name has an API entry, every code block runs.

Code blocks in ``docs/**/*.md`` are read by their fence:

- ```` ```python ```` (options such as ``title="..."`` allowed): gradtools code.
  The blocks of one page run top to bottom in one namespace, like a notebook.
- ```` ```{.python .torch} ````: PyTorch code shown for contrast; run (in a
  namespace of its own per page) only where ``torch`` is installed.
- ```` ```{.python .mindspore} ````: MindSpore code shown for contrast; never
  run. Neither kind may use gradtools, so every gradtools example is run.
- Any other language (``bash``, ``text``, ...) is not run.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import re
import sys
import types

import pytest

import gradtools

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import api_entries  # noqa: E402  (docs/_ext/api_entries.py: no mkdocs needed)
import includes  # noqa: E402  (docs/_ext/includes.py: no mkdocs needed)

sys.path.remove(str(ROOT / "docs" / "_ext"))
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_ext" not in p.parts)
_FENCE = re.compile(r"^( *)(`{3,})\s*(.*)$")
CONTRAST = {"torch", "mindspore"}


def code_blocks(text: str) -> list[tuple[int, str, set[str], str]]:
    """``(line, language, classes, code)`` of every fenced block in ``text``."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
        if info.startswith("{"):
            tokens = info.strip("{}").split()
            classes = [t[1:] for t in tokens if t.startswith(".")]
            lang, classes = (classes[0] if classes else ""), set(classes[1:])
        else:
            lang, classes = (info.split() or [""])[0], set()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:])
            j += 1
        blocks.append((i + 1, lang, classes, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def _blocks(page: pathlib.Path, kind: str | None) -> list[tuple[int, str]]:
    """The python blocks of ``page`` with class ``kind`` (``None``: plain ones)."""
    out = []
    for line, lang, classes, code in code_blocks(page.read_text()):
        if lang != "python":
            continue
        if kind is None and not classes or kind is not None and kind in classes:
            out.append((line, code))
    return out


def _run(page: pathlib.Path, blocks: list[tuple[int, str]]) -> None:
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    for line, code in blocks:
        # Pad with the lines above the block so tracebacks give the page's line numbers.
        exec(compile("\n" * line + code, str(page.relative_to(ROOT)), "exec"), namespace)


def _id(page: pathlib.Path) -> str:
    return str(page.relative_to(DOCS))


# Pages whose examples train models for a while: CI runs them after the README's command.
_SLOW_PAGES = {
    "demo.md",
    "guides/language_models.md",
    "guides/from_mindspore.md",
    "guides/from_optax.md",
}
RUN_PAGES = [
    pytest.param(p, marks=pytest.mark.slow) if _id(p) in _SLOW_PAGES else p
    for p in PAGES
    if _blocks(p, None)
]
TORCH_PAGES = [p for p in PAGES if _blocks(p, "torch")]


def test_fences_are_known():
    """A python block is plain or marked as PyTorch/MindSpore contrast, nothing else."""
    for page in PAGES:
        for line, lang, classes, code in code_blocks(page.read_text()):
            where = f"{_id(page)}:{line}"
            assert not (classes - CONTRAST), f"{where}: unknown marker {classes - CONTRAST}"
            if classes:
                assert lang == "python", f"{where}: contrast blocks are python"
                assert "gradtools" not in code, f"{where}: a gradtools block must run"


@pytest.mark.parametrize("page", RUN_PAGES, ids=_id)
def test_page_code_runs(page):
    _run(page, _blocks(page, None))


@pytest.mark.parametrize("page", TORCH_PAGES, ids=_id)
def test_pytorch_contrast_code_runs(page):
    pytest.importorskip("torch", reason="PyTorch is not installed: its contrast blocks are not run")
    _run(page, _blocks(page, "torch"))


def test_the_guides_have_a_table_and_running_code():
    guides = sorted((DOCS / "guides").glob("*.md"))
    assert {g.stem for g in guides} >= {"from_pytorch", "from_mindspore", "from_optax"}
    for guide in guides:
        text = guide.read_text()
        assert re.search(r"^\|.*\|\s*\n\|\s*-{3}", text, re.MULTILINE), f"{guide.name}: no table"
        assert _blocks(guide, None), f"{guide.name}: no gradtools code block"


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_with_outputs(notebook):
    """The site renders notebooks without running them: each must carry its outputs."""
    cells = json.loads(notebook.read_text())["cells"]
    for n, cell in enumerate(cells):
        if cell["cell_type"] != "code" or not "".join(cell["source"]).strip():
            continue
        assert cell.get("execution_count") is not None, f"code cell {n} has not been run"
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, f"code cell {n} raised {errors[0].get('ename')}"


def test_every_public_name_has_an_api_entry():
    missing = api_entries.undocumented()
    assert not missing, f"no '::: gradtools.<module>.<name>' entry in docs/api/ for {missing}"


def test_api_entries_name_gradtools_objects():
    entries = api_entries.directives()
    assert entries
    for path in entries:
        assert path.startswith("gradtools."), path
        obj = api_entries.resolve(path)
        module = (
            obj if isinstance(obj, types.ModuleType) else importlib.import_module(obj.__module__)
        )
        assert module.__name__.startswith("gradtools"), f"{path} is not a gradtools object"


def test_api_check_sees_a_missing_name(monkeypatch):
    """The coverage check fails when a public name has no entry."""
    monkeypatch.setattr(gradtools, "__all__", [*gradtools.__all__, "_not_documented"], raising=True)
    monkeypatch.setattr(gradtools, "_not_documented", lambda: None, raising=False)
    with pytest.raises(AssertionError, match="_not_documented"):
        test_every_public_name_has_an_api_entry()


def _table_rows(path: pathlib.Path, heading: str) -> list[str]:
    """The table rows after ``heading`` in ``path``, up to the next line that starts with '#'."""
    lines = path.read_text().splitlines()
    start = lines.index(heading) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("#"))
    return [line for line in lines[start:end] if line.startswith("|")]


def test_benchmarks_page_shows_the_targets_of_results_md():
    results = ROOT / "benchmarks" / "RESULTS.md"
    page = includes.expand((DOCS / "benchmarks.md").read_text())
    cpu, gpu = _table_rows(results, "## Targets"), _table_rows(results, "### Targets")
    assert len(cpu) > 3 and len(gpu) > 3 and cpu != gpu
    assert "\n".join(cpu) in page and "\n".join(gpu) in page
    assert "<!-- include" not in page


def test_an_include_takes_its_section_and_names_what_is_missing(tmp_path):
    (tmp_path / "r.md").write_text(
        "# Title\n## A\nkeep\n### A.1\nkeep too\n```\n## not a heading\n```\n## B\nnot this\n"
    )
    page = 'before\n<!-- include r.md "## A" -->\nafter\n'
    assert includes.expand(page, root=tmp_path) == (
        "before\nkeep\n### A.1\nkeep too\n```\n## not a heading\n```\nafter\n"
    )
    with pytest.raises(ValueError, match="no heading '## C'"):
        includes.expand('<!-- include r.md "## C" -->', root=tmp_path)
    with pytest.raises(ValueError, match="nothing.md"):
        includes.expand('<!-- include nothing.md "## A" -->', root=tmp_path)
