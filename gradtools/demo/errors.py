"""What a demo raises for bad input: a bad option, or bad data.

:func:`gradtools.demo.cli.run_main` turns each into its exit status: 2 with
the usage for a :class:`ConfigError`, 1 with one line for a :class:`DataError`.
"""

__all__ = ["ConfigError", "DataError"]


class ConfigError(ValueError):
    """An option has a bad value, or options do not fit together."""


class DataError(ValueError):
    """A data file is missing, damaged or does not hold what its name says."""
