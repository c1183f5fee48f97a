"""Data-prep throughput and memory: rows/s and peak RSS for 1,000 and 100,000 rows.

The input is the bundled sample replicated, each copy made unique (a counter appended to the
user message) so every row goes the whole way: parse, validate, detect the user's language,
label, render, hash, spool, split, write. Each size runs in a fresh process so its peak RSS is
its own. Target: ≥ 20,000 rows/s, and peak memory that does not grow with the row count.

    python bench/data_prep.py [--sizes 1000 100000]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# This file is named like the package it measures; keep its folder off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

TARGET_ROWS_PER_S = 20_000


def make_input(path: Path, n: int) -> None:
    from data_prep.sources import iter_source, parse_row

    sample = [parse_row(r).data for r in iter_source("bundled")]
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            row = json.loads(json.dumps(sample[i % len(sample)]))
            row["user"] = f"{row['user']} (#{i})"
            row["messages"][1]["content"] = row["user"]
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def run_one(path: Path, out: Path, workers: int) -> dict:
    """Runs in the child process: prepare the dataset once, report time and memory."""
    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare_dataset
    from eval.language_id import identify_language

    identify_language("warm up the language model before timing anything")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    report = prepare_dataset(
        DataPrepConfig(source=str(path), workers=workers),
        out / "train.jsonl",
        out / "eval.jsonl",
        out / "quarantine.jsonl",
        out / "card.md",
    )
    seconds = time.perf_counter() - start
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "rows": report.rows_read,
        "seconds": seconds,
        "rows_per_s": report.rows_read / seconds,
        "peak_rss_mb": rss_after / 1024,
        "rss_growth_mb": (rss_after - rss_before) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1, 0], help="1 = serial, 0 = one per core"
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        src, out, workers = args.child
        print(json.dumps(run_one(Path(src), Path(out), int(workers))))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            src = Path(tmp) / f"rows-{n}.jsonl"
            make_input(src, n)
            for workers in args.workers:
                out = Path(tmp) / f"out-{n}-{workers}"
                child = subprocess.run(
                    [sys.executable, __file__, "--child", str(src), str(out), str(workers)],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                result = json.loads(child.stdout.strip().splitlines()[-1])
                results.append({**result, "workers": workers})
    header = ("rows", "workers", "seconds", "rows/s", "vs target", "peak RSS MB", "RSS growth MB")
    print("  ".join(f"{h:>13}" for h in header))
    for r in results:
        cells = (
            r["rows"],
            r["workers"] or "auto",
            f"{r['seconds']:.2f}",
            f"{r['rows_per_s']:.0f}",
            f"{r['rows_per_s'] / TARGET_ROWS_PER_S:.2f}x",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['rss_growth_mb']:.1f}",
        )
        print("  ".join(f"{c:>13}" for c in cells))
    serial = [r for r in results if r["workers"] == 1]
    if len(serial) >= 2:
        small, large = serial[0], serial[-1]
        per_row = (large["rss_growth_mb"] - small["rss_growth_mb"]) * 1024 * 1024
        per_row /= max(1, large["rows"] - small["rows"])
        print(f"serial: memory per extra row {per_row:.0f} bytes (a row is ~2,000 bytes of text)")


if __name__ == "__main__":
    main()
