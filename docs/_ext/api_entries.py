"""Which public names the API pages render; shared by the mkdocs hook and the tests.

No mkdocs import here, so the tests can use it without the docs extra.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

API_DIR = Path(__file__).resolve().parents[1] / "api"
_DIRECTIVE = re.compile(r"^:::\s+(gradtools(?:\.\w+)*)\s*$", re.MULTILINE)


def resolve(path: str) -> object:
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

    shown = {id(resolve(path)) for path in directives(api_dir)}
    public = sorted(set(gradtools.__all__) - {"__version__"})
    return [name for name in public if id(getattr(gradtools, name)) not in shown]
