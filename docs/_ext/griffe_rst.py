"""Griffe extension: renders the reST idioms of gradtools docstrings as Markdown.

gradtools docstrings follow optax's Google style, which borrows a few reST
idioms that mkdocstrings (a Markdown renderer) would otherwise show verbatim:

- ``:func:`name```, ``:class:`name``` and friends become cross-references, so a
  reference to a name that does not exist is a broken link (an error under
  ``mkdocs build --strict``);
- ``Title <url>`_`` links become Markdown links;
- a paragraph ending in ``::`` followed by an indented block becomes a fenced
  code block;
- simple tables (``===  ===`` borders) and ``.. list-table::`` directives
  become Markdown tables;
- an ``Example:`` section is read as ``Examples:``, so its ``>>>`` lines render
  as a code block.

The docstring text is rewritten when griffe creates the object, before it is
parsed; the source files are not touched. reST left over after the rewrite (a
role or directive not listed above) is logged as a warning, which fails
``mkdocs build --strict``: extend this file rather than let it show verbatim.
"""

from __future__ import annotations

import logging
import re
import types
from typing import Any

import griffe

_log = logging.getLogger("mkdocs.plugins.gradtools.griffe_rst")

_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|obj|exc):`(~?)([\w.]+)(\(\))?`")
_LINK = re.compile(r"`([^`<]+?)\s*<(https?://[^>\s]+)>`_")
_LIST_TABLE = re.compile(r"^(\s*)\.\. list-table::\s*(.*)$")
_LEFTOVER = re.compile(r":[a-z]+:`|^\s*\.\. [\w-]+::")
_BORDER = re.compile(r"^\s*=+(?: +=+)+\s*$")
_CODE_SPAN = re.compile(r"(`+).+?\1")
_INNER_STAR = re.compile(r"(?<=[\w)])(\*+)(?=[\w(])")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _canonical(path: str) -> str:
    """``gradtools.metrics`` (the function) -> ``gradtools.metrics.metrics``.

    A public name that shares its module's name (``loss_scale``, ``metrics``)
    would otherwise point at the module.
    """
    import gradtools

    head, _, name = path.partition(".")
    if head == "gradtools" and name in gradtools.__all__:
        obj = getattr(gradtools, name)
        module = getattr(obj, "__module__", None)
        if module and not isinstance(obj, types.ModuleType):
            return f"{module}.{name}"
    return path


def _roles(text: str, module: str) -> str:
    def repl(m: re.Match) -> str:
        short, name, call = m.group(1), m.group(2), m.group(3) or ""
        label = (name.rsplit(".", 1)[-1] if short else name) + call
        target = name if "." in name else f"{module}.{name}"
        if not target.startswith("gradtools."):
            return f"`{label}`"
        return f"[`{label}`][{_canonical(target)}]"

    return _ROLE.sub(repl, text)


def _links(text: str) -> str:
    return _LINK.sub(lambda m: f"[{' '.join(m.group(1).split())}]({m.group(2)})", text)


def _literal_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::") or line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        k = j
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > base):
            k += 1
        while k > j and not lines[k - 1].strip():
            k -= 1
        if k == j:  # no indented block follows: leave the line alone
            out.append(line)
            i += 1
            continue
        head = line.rstrip()[:-2].rstrip()
        if head.strip():
            out.append(head + ":")
            out.append("")
        body = lines[j:k]
        strip = min(_indent(b) for b in body if b.strip())
        pad = " " * base
        out.append(pad + "```python")
        out.extend(pad + b[strip:] if b.strip() else "" for b in body)
        out.append(pad + "```")
        i = k
    return out


def _tables(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not (
            _BORDER.match(lines[i])
            and i + 2 < len(lines)
            and _BORDER.match(lines[i + 2])
            and lines[i + 2].strip() == lines[i].strip()
        ):
            out.append(lines[i])
            i += 1
            continue
        border = lines[i]
        spans = [m.span() for m in re.finditer(r"=+", border)]
        pad = " " * _indent(border)

        def cells(row: str, spans=spans) -> list[str]:
            starts = [s for s, _ in spans] + [len(row) + 1]
            return [row[starts[c] : starts[c + 1]].strip() for c in range(len(spans))]

        out.append(pad + "| " + " | ".join(cells(lines[i + 1])) + " |")
        out.append(pad + "|" + "|".join("---" for _ in spans) + "|")
        i += 3
        while i < len(lines) and not _BORDER.match(lines[i]):
            if lines[i].strip():
                out.append(pad + "| " + " | ".join(cells(lines[i])) + " |")
            i += 1
        i += 1  # the closing border
    return out


def _escape(prose: str) -> str:
    return _INNER_STAR.sub(lambda m: "\\*" * len(m.group(1)), prose)


def _escape_prose(lines: list[str]) -> list[str]:
    """Escapes what Markdown would misread in prose: ``2**16``, a line opening with ``>``."""
    out, fenced, doctest = [], False, False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        doctest = bool(line.strip()) and (doctest or line.lstrip().startswith(">>>"))
        if fenced or doctest or line.lstrip().startswith("```"):
            out.append(line)
            continue
        parts, last = [], 0
        for m in _CODE_SPAN.finditer(line):
            parts.append(_escape(line[last : m.start()]))
            parts.append(m.group(0))
            last = m.end()
        parts.append(_escape(line[last:]))
        line = "".join(parts)
        if line.lstrip().startswith(">"):  # '>= 1' opening a line is not a quote
            line = line.replace(">", "\\>", 1)
        out.append(line)
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _list_tables(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _LIST_TABLE.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        pad, title = m.group(1), m.group(2).strip()
        header_rows, rows = 0, []
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(pad)):
            item = lines[i].strip()
            option = re.match(r":header-rows:\s*(\d+)", item)
            if option:
                header_rows = int(option.group(1))
            elif item.startswith("* - "):
                rows.append([item[4:]])
            elif item.startswith("- ") and rows:
                rows[-1].append(item[2:])
            elif item and rows:
                rows[-1][-1] += " " + item
            i += 1
        if title:
            out += [f"{pad}**{title}**", ""]
        width = max(len(r) for r in rows)
        head, body = (rows[0], rows[1:]) if header_rows else ([""] * width, rows)
        out.append(pad + "| " + " | ".join(_cell(c) for c in head) + " |")
        out.append(pad + "|" + "|".join("---" for _ in range(width)) + "|")
        for row in body:
            out.append(pad + "| " + " | ".join(_cell(c) for c in row) + " |")
        out.append("")
    return out


def _warn_leftovers(lines: list[str], module: str) -> None:
    fenced = False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and not line.lstrip().startswith(">>>") and _LEFTOVER.search(line):
            _log.warning("%s: reST that renders verbatim: %r", module, line.strip())


def rst_to_markdown(text: str, module: str) -> str:
    """Rewrites the reST idioms of one docstring as Markdown."""
    text = _links(_roles(text, module))
    lines = _list_tables(text.splitlines())
    lines = _escape_prose(_tables(_literal_blocks(lines)))
    _warn_leftovers(lines, module)
    lines = ["Examples:" if line == "Example:" else line for line in lines]
    return "\n".join(lines)


class RstToMarkdown(griffe.Extension):
    """Rewrites every gradtools docstring before griffe parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        del kwargs
        if obj.docstring is None:
            return
        module = obj.path if obj.is_module else obj.module.path
        obj.docstring.value = rst_to_markdown(obj.docstring.value, module)
