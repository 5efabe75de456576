"""``python -m benchmarks``: see ``benchmarks/cli.py`` and ``--help``."""

from benchmarks.cli import main

main()
