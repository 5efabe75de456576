"""mkdocs hooks: the checks that make ``mkdocs build --strict`` fail on gaps.

- Every name in ``gradtools.__all__`` (but ``__version__``) must have an
  ``::: gradtools.<name>`` entry in a page under ``docs/api/``.
- The notebooks in ``notebooks/`` are added to the site (and to the nav, under
  "Notebooks") from their committed outputs; a notebook with an error output,
  or with a code cell that was never run, fails the build.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import mkdocs.plugins
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File
from mkdocs.structure.files import Files

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
API_DIR = ROOT / "docs" / "api"
_DIRECTIVE = re.compile(r"^:::\s+(gradtools(?:\.\w+)*)\s*$", re.MULTILINE)


def _resolve(path: str) -> object:
    """The object ``path`` names, read as griffe reads it (a submodule wins)."""
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for attr in parts[n:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def directives(api_dir: Path = API_DIR) -> list[str]:
    """The ``::: gradtools...`` paths of the API pages."""
    return [
        m.group(1)
        for page in sorted(api_dir.glob("*.md"))
        for m in _DIRECTIVE.finditer(page.read_text())
    ]


def undocumented(api_dir: Path = API_DIR) -> list[str]:
    """The names of ``gradtools.__all__`` that no API page renders."""
    import gradtools

    shown = {id(_resolve(path)) for path in directives(api_dir)}
    public = sorted(set(gradtools.__all__) - {"__version__"})
    return [name for name in public if id(getattr(gradtools, name)) not in shown]


def notebook_problems(path: Path) -> list[str]:
    """Why a committed notebook cannot be rendered without running it."""
    problems = []
    cells = json.loads(path.read_text())["cells"]
    for n, cell in enumerate(cells):
        if cell["cell_type"] != "code" or not "".join(cell["source"]).strip():
            continue
        if cell.get("execution_count") is None:
            problems.append(f"code cell {n} has not been run")
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                problems.append(f"code cell {n} raised {out.get('ename')}: {out.get('evalue')}")
    return problems


def notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    if str(ROOT) not in sys.path:  # document the checkout being built, installed or not
        sys.path.insert(0, str(ROOT))
    missing = undocumented()
    if missing:
        raise PluginError(
            f"gradtools.__all__ names without an API entry: {missing}. Add "
            f"'::: gradtools.<module>.<name>' to a page in {API_DIR.relative_to(ROOT)}/."
        )
    if notebooks() and config.nav is not None:
        entries = [f"notebooks/{nb.name}" for nb in notebooks()]
        keys = [next(iter(item)) if isinstance(item, dict) else item for item in config.nav]
        at = keys.index("API reference") if "API reference" in keys else len(keys)
        config.nav.insert(at, {"Notebooks": entries})
    return config


@mkdocs.plugins.event_priority(100)  # before mkdocs-jupyter wraps the notebook files
def on_files(files: Files, config: MkDocsConfig) -> Files:
    for nb in notebooks():
        problems = notebook_problems(nb)
        if problems:
            raise PluginError(f"{nb.relative_to(ROOT)}: " + "; ".join(problems))
        files.append(
            File(
                f"notebooks/{nb.name}",
                src_dir=str(ROOT),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files
