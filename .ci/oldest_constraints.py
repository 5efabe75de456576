"""Prints pip constraints that pin jax, jaxlib and optax to pyproject's floors.

CI installs the project with them and runs the library's tests, so the
lowest versions ``pyproject.toml`` admits are the ones it has tested.
"""

import re
from pathlib import Path

TEXT = Path("pyproject.toml").read_text()


def floor(name: str) -> str:
    found = re.search(rf'"{name}>=([\d.]+)"', TEXT)
    if found is None:
        raise SystemExit(f"pyproject.toml: no '{name}>=X' dependency to take the floor of")
    return found[1]


jax, optax = floor("jax"), floor("optax")
print(f"jax=={jax}\njaxlib=={jax}\noptax=={optax}")
