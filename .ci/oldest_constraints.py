"""Prints pip constraints that pin jax, jaxlib and optax to pyproject's floors.

CI installs the project with them and runs the library's tests, so the
lowest versions ``pyproject.toml`` admits are the ones it has tested.
"""

import re
from pathlib import Path

text = Path("pyproject.toml").read_text()
floors = {name: re.search(rf'"{name}>=([\d.]+)"', text) for name in ("jax", "optax")}
missing = [name for name, found in floors.items() if found is None]
if missing:
    raise SystemExit(f"pyproject.toml: no '{missing[0]}>=X' dependency to take the floor of")
jax, optax = (floors[name][1] for name in ("jax", "optax"))  # pyright: ignore
print(f"jax=={jax}\njaxlib=={jax}\noptax=={optax}")
