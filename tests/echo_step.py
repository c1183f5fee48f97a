"""A stand-in training entry point for the tests of ``trainer/step_run.py``: every rank
appends the command line it was given; rank 0 writes a summary of all of them."""

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    """Record ``argv`` and the rank's environment in ``--work-dir``."""
    work_dir = Path(argv[argv.index("--work-dir") + 1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (work_dir / f"rank{rank}.json").write_text(json.dumps({"argv": argv, "world": world}))
    if rank != 0:
        return
    deadline = time.monotonic() + 60
    while len(list(work_dir.glob("rank*.json"))) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = [json.loads(p.read_text()) for p in work_dir.glob("rank*.json")]
    same_argv = all(r["argv"] == argv for r in ranks)
    summary = {"argv": argv, "world": world, "ranks": len(ranks), "same_argv": same_argv}
    (work_dir / "echo_summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
