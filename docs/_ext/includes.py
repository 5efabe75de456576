"""Sections of files outside ``docs/`` included into a page, for the mkdocs hook and the tests.

A page line ``<!-- include benchmarks/RESULTS.md "## Targets" -->`` is
replaced by the body of the first section of that file (a path from the
repository's root) under that exact heading: the lines after it, up to the
next heading of the same level or above, outside code fences. On GitHub the
line stays an invisible comment. No mkdocs import here, so the tests can use
it without the docs extra.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = re.compile(r'^<!-- include (?P<path>\S+) "(?P<heading>#+ [^"]+)" -->$', re.MULTILINE)
_HEADING = re.compile(r"^(#+) ")


def section(text: str, heading: str) -> str:
    """The body of the first section of ``text`` under the line ``heading``.

    Raises:
      ValueError: if no line outside a code fence is ``heading``.
    """
    level = len(heading) - len(heading.lstrip("#"))
    body: list[str] | None = None
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        found = None if fenced else _HEADING.match(line)
        if body is None:
            if found and line.rstrip() == heading:
                body = []
            continue
        if found and len(found.group(1)) <= level:
            break
        body.append(line)
    if body is None:
        raise ValueError(f"no heading {heading!r}")
    return "\n".join(body).strip()


def expand(markdown: str, root: Path = ROOT) -> str:
    """``markdown`` with every include line replaced by the section it names.

    Raises:
      ValueError: naming the include line, for a missing file or heading.
    """

    def include(m: re.Match[str]) -> str:
        path = root / m.group("path")
        try:
            return section(path.read_text(), m.group("heading"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{m.group(0)}: {e}") from None

    return INCLUDE.sub(include, markdown)
