"""The documentation site builds with warnings as errors and opens in a browser.

``mkdocs build --strict`` writes the site to a temporary directory; a local
HTTP server serves it and a headless Chromium loads pages and dumps the DOM
after the page's JavaScript has run. Skipped, with the reason, where mkdocs
(``pip install -e ".[docs]"``) or Chromium (``apt-get install chromium``) is
missing.
"""

from __future__ import annotations

import functools
import html
import http.server
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=10000",  # let the page's scripts run before the dump
]


def _require_tools():
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python", "mkdocs_jupyter"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[docs]'")
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed: apt-get install -y chromium")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    _require_tools()
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.fixture(scope="module")
def server(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(site))
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _dom(url: str, profile: pathlib.Path) -> str:
    proc = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"chromium exited with {proc.returncode}:\n{proc.stderr[-2000:]}"
    return proc.stdout


def _text(dom: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", dom))


def _check_rendered(dom: str, title: str, code: str) -> None:
    """The page has its title, ran its scripts, and shows ``code`` in a code block."""
    found = re.search(r"<title>(.*?)</title>", dom, re.S)
    assert found and found.group(1).strip() == title, f"title: {found and found.group(1)!r}"
    html_tag = re.search(r"<html[^>]*>", dom).group(0)
    assert re.search(r'class="[^"]*\bjs\b', html_tag), f"the page's scripts did not run: {html_tag}"
    blocks = re.findall(r'<div class="[^"]*highlight[^"]*">(.*?)</div>', dom, re.S)
    assert any(code in _text(b) for b in blocks), f"no code block shows {code!r}"
    assert "md-code__button" in dom, "code blocks were not decorated by the page's scripts"


def test_index_page_renders(server, tmp_path):
    dom = _dom(f"{server}/", tmp_path / "profile")
    _check_rendered(dom, "gradtools", "tx = gradtools.dynamic_loss_scale(optax.adam(0.1))")
    assert 'href="api/"' in dom or 'href="./api/"' in dom, "no link to the API reference"


def test_api_page_renders(server, tmp_path):
    dom = _dom(f"{server}/api/loss_scale/", tmp_path / "profile")
    _check_rendered(
        dom,
        "Loss scaling - gradtools",
        ">>> tx = gradtools.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)",
    )
    headings = re.findall(r'<h2 id="(gradtools\.[\w.]+)"', dom)
    assert "gradtools.loss_scale.dynamic_loss_scale" in headings, headings
    # The docstring's formula, Args table and cross-reference survived rendering.
    text = _text(dom)
    assert "scale = max(scale * backoff_factor, min_scale)" in text
    assert re.search(r"growth_interval\s+int\s+consecutive finite steps", text)
    assert 'href="#gradtools.loss_scale.LossScaleState"' in dom


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.skipif(not NOTEBOOKS, reason="no notebooks in notebooks/ yet")
def test_a_notebook_page_renders_its_outputs(server, tmp_path):
    notebook = NOTEBOOKS[0]
    dom = _dom(f"{server}/notebooks/{notebook.stem}/", tmp_path / "profile")
    assert re.search(r'<html[^>]*class="[^"]*\bjs\b', dom), "the page's scripts did not run"
    assert "jp-OutputArea" in dom, f"{notebook.name}: no cell outputs on the page"
    assert "Traceback" not in _text(dom), f"{notebook.name}: the page shows an error"


def test_a_missing_page_is_not_taken_for_a_page(server, tmp_path):
    dom = _dom(f"{server}/no-such-page/", tmp_path / "profile")
    with pytest.raises(AssertionError, match="title"):
        _check_rendered(dom, "gradtools", "gradtools")


def _build_copy(tmp_path: pathlib.Path, edit) -> subprocess.CompletedProcess:
    """Builds a copy of the docs, changed by ``edit(docs_dir)``, against this checkout's code."""
    _require_tools()
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    (root / "gradtools").symlink_to(ROOT / "gradtools", target_is_directory=True)
    (root / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)  # included
    edit(root / "docs")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=root,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_broken_reference_fails_the_build(tmp_path):
    def edit(docs):
        with open(docs / "index.md", "a") as f:
            f.write("\nSee [`nothing`][gradtools.no_such_name].\n")

    proc = _build_copy(tmp_path, edit)
    assert proc.returncode != 0
    assert "gradtools.no_such_name" in proc.stdout + proc.stderr


def test_a_public_name_without_an_api_entry_fails_the_build(tmp_path):
    def edit(docs):
        page = docs / "api" / "loss_scale.md"
        page.write_text(page.read_text().replace("::: gradtools.loss_scale.all_finite\n", ""))

    proc = _build_copy(tmp_path, edit)
    assert proc.returncode != 0
    assert "without an API entry: ['all_finite']" in proc.stdout + proc.stderr


def test_docstring_rest_is_rendered_as_markdown(caplog):
    pytest.importorskip("griffe", reason="griffe is not installed: pip install -e '.[docs]'")
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import griffe_rst
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    doc = "\n".join(
        [
            "Uses :func:`dynamic_loss_scale` and :class:`~gradtools.metrics`, 2**16.",
            "",
            "Each step does::",
            "",
            "  x = 1",
            "",
            "===  ====",
            "key  type",
            "===  ====",
            "a    int",
            "===  ====",
            "",
            ".. list-table:: Spellings",
            "   :header-rows: 1",
            "",
            "   * - ours",
            "     - theirs",
            "   * - ``a``",
            "     - ``b``",
            "       continued",
            "",
            "Args:",
            "  n: a count; an int",
            "    >= 1.",
            "",
            "Example:",
            "  >>> 2**3",
            "  8",
            "",
            "References:",
            "  Someone, `A title",
            "  <https://example.org/x>`_, 2020.",
        ]
    )
    out = griffe_rst.rst_to_markdown(doc, "gradtools.loss_scale").splitlines()
    assert out[0] == (
        "Uses [`dynamic_loss_scale`][gradtools.loss_scale.dynamic_loss_scale] and "
        "[`metrics`][gradtools.metrics.metrics], 2\\*\\*16."
    )
    assert out[2:7] == ["Each step does:", "", "```python", "x = 1", "```"]
    assert "| key | type |" in out and "| a | int |" in out
    assert "**Spellings**" in out and "| ``a`` | ``b`` continued |" in out
    assert "    \\>= 1." in out  # not a block quote
    assert "Examples:" in out and "  >>> 2**3" in out  # doctests left alone
    assert "  Someone, [A title](https://example.org/x), 2020." in out
    with caplog.at_level("WARNING"):
        griffe_rst.rst_to_markdown(".. math:: x", "gradtools.m")
    assert "reST that renders verbatim" in caplog.text
