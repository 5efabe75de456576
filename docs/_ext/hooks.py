"""mkdocs hooks: the checks that make ``mkdocs build --strict`` fail on gaps.

- Every name in ``gradtools.__all__`` (but ``__version__``) must have an
  ``::: gradtools.<name>`` entry in a page under ``docs/api/``.
- A line ``<!-- include PATH "## Heading" -->`` in a page is replaced by that
  section of the file (``docs/_ext/includes.py``): ``docs/benchmarks.md``
  shows the targets of ``benchmarks/RESULTS.md`` this way.
- The notebooks in ``notebooks/`` are added to the site (and to the nav, under
  "Notebooks") from their committed outputs; a notebook with an error output,
  or with a code cell that was never run, fails the build.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mkdocs.plugins
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_entries import API_DIR  # noqa: E402  (a sibling file, not a package)
from api_entries import undocumented  # noqa: E402  (a sibling file, not a package)
from includes import expand  # noqa: E402  (a sibling file, not a package)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"


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


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    try:
        return expand(markdown)
    except ValueError as e:
        raise PluginError(f"{page.file.src_path}: {e}") from None
