"""The ``lingo`` command line: run the pipeline locally, compile it, run one step alone.

The commands live one family a module (``run``, ``serve``, ``estimate``, ``kfp``, ``cluster``),
each registering on ``app.app`` as it is imported; they are imported here in the order
``lingo --help`` lists them. The entry point is ``lingo = "pipelines.cli:app"``.
"""

from __future__ import annotations

import importlib

from pipelines.cli.app import app, echo, load_preset

for _module in ("run", "serve", "estimate", "kfp", "cluster"):
    importlib.import_module(f"pipelines.cli.{_module}")

__all__ = ["app", "echo", "load_preset"]
