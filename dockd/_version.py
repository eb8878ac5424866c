"""The one place dockd's version is written (pyproject.toml reads it from here)."""

__version__ = "0.2.0"
