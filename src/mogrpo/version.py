"""The package's version: one place, read by the build (pyproject.toml), `mogrpo --version`, the
judge's User-Agent and `mogrpo.__version__`."""

__version__ = "0.1.0"
