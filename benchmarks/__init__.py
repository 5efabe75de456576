"""Benchmarks: gradtools against the optax, jmp and flax code it replaces.

Run ``python -m benchmarks`` (``--help`` for the options, ``--quick`` for a
smoke-sized run). Everything is timed side by side in one process, in
interleaved rounds, and reported as medians with min-max and as ratios.
"""
