"""``python -m pipelines`` is the ``lingo`` command (for environments without the script)."""

from pipelines.cli import app

app()
