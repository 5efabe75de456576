"""The package version, in one place (read by pyproject.toml)."""

__version__ = "0.1.0"
