"""The `mogrpo` command line (`app.main`); one module per command group."""

from mogrpo.cli.app import main

__all__ = ["main"]
