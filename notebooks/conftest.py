"""``pytest --nbmake notebooks``: the kernels import this checkout's gradtools.

nbmake runs each notebook in a fresh Jupyter kernel, a separate process that
starts in ``notebooks/``. Putting the repository root first on its
``PYTHONPATH`` makes ``import gradtools`` find the code under test even when
the package is not installed (and the same code when it is, editable).
"""

import os
import pathlib

_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
