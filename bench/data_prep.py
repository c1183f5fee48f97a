"""Data-prep throughput and memory: rows/s at 1,000 and 100,000 rows, memory up to 1,000,000.

The input is the bundled sample replicated, each copy made unique (a counter appended to the
user message) so every row goes the whole way: parse, validate, detect the user's language,
label, render, hash, dedup, spool, split, write. It is written to a temp file, streamed.

Each (rows, workers) case runs in a fresh process, which
* first imports data_prep and loads the fastText language model: NOT timed, reported on their
  own (a process pays them once, whatever it prepares; the ``rows/s with load`` column adds
  the model load back);
* then times one ``prepare_dataset()`` call from the input file to the renamed, fsynced
  outputs (train, eval, quarantine, card): what ``lingo data-prep`` runs;
* reports the CPU time of that call (its main thread's and its workers'; less sensitive than
  the wall time to other jobs on the machine), its peak RSS, the RSS growth during the call
  (``ru_maxrss`` after − before) and the peak RSS of its worker processes.
Sizes up to 100,000 rows run ``--repeat`` times (fresh processes; the fastest run is shown,
the usual way to read timings on a shared machine); bigger sizes run once: they are there for
memory. Target: ≥ 20,000 rows/s, and memory that does not grow with the row count.

    python bench/data_prep.py                          # 1k, 100k, 1M rows: ~4 min on 2 cores
    python bench/data_prep.py --sizes 1000 100000      # throughput only: ~1 min
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
REPEATED_UP_TO = 100_000


def make_input(path: Path, n: int) -> None:
    """``n`` rows: the bundled sample over and over, each with a unique user message."""
    from data_prep.sources import iter_source, parse_row

    sample = [parse_row(r).data for r in iter_source("bundled")]
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            row = sample[i % len(sample)]
            user = f"{row['user']} (#{i})"
            system, user_message, assistant = row["messages"]
            messages = [system, {**user_message, "content": user}, assistant]
            fh.write(json.dumps({**row, "user": user, "messages": messages}, ensure_ascii=False))
            fh.write("\n")


def run_one(path: Path, out: Path, workers: int) -> dict:
    """Runs in the child process: load, then prepare the dataset once; time and memory."""
    start = time.perf_counter()
    from core.language_id import identify_language
    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare_dataset

    imported = time.perf_counter()
    identify_language("load the language model before timing anything")
    loaded = time.perf_counter()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu_before = _cpu_seconds()
    begin = time.perf_counter()
    report = prepare_dataset(
        DataPrepConfig(source=str(path), workers=workers),
        out / "train.jsonl",
        out / "eval.jsonl",
        out / "quarantine.jsonl",
        out / "card.md",
    )
    seconds = time.perf_counter() - begin
    cpu_seconds = _cpu_seconds() - cpu_before
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "rows": report.rows_read,
        "import_s": imported - start,
        "model_load_s": loaded - imported,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "peak_rss_mb": rss_after / 1024,
        "rss_growth_mb": (rss_after - rss_before) / 1024,
        "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def _cpu_seconds() -> float:
    """CPU time of this thread and of the finished child processes (the workers).

    Not the whole process's: numpy's OpenBLAS thread spins for ~0.2 s after numpy is imported
    (~40 ms of CPU), which would land in the 1,000-row figure although data prep runs no BLAS.
    """
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.thread_time() + children.ru_utime + children.ru_stime


def run_case(src: Path, out: Path, workers: int) -> dict:
    child = subprocess.run(
        [sys.executable, __file__, "--child", str(src), str(out), str(workers)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000, 1_000_000])
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1, 0], help="1 = serial, 0 = one per core"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help=f"runs per case up to {REPEATED_UP_TO:,} rows"
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        src, out, workers = args.child
        print(json.dumps(run_one(Path(src), Path(out), int(workers))))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sorted(args.sizes):
            src = Path(tmp) / f"rows-{n}.jsonl"
            print(f"writing {n:,} rows ...", file=sys.stderr)
            make_input(src, n)
            for workers in args.workers:
                runs = [
                    run_case(src, Path(tmp) / f"out-{n}-{workers}-{k}", workers)
                    for k in range(args.repeat if n <= REPEATED_UP_TO else 1)
                ]
                best = min(runs, key=lambda r: r["seconds"])
                results.append({**best, "workers": workers, "runs": len(runs)})
                print(f"  workers {workers or 'auto'}: {best['seconds']:.2f} s", file=sys.stderr)
            src.unlink()
    _print_table(results)


def _print_table(results: list[dict]) -> None:
    header = (
        "rows", "workers", "runs", "seconds", "rows/s", "vs target", "rows/s with load",
        "CPU s", "peak RSS MB", "RSS growth MB", "workers' peak RSS MB",
    )  # fmt: skip
    print("  ".join(f"{h:>10}" for h in header))
    for r in results:
        rate = r["rows"] / r["seconds"]
        cells = (
            f"{r['rows']:,}",
            r["workers"] or "auto",
            r["runs"],
            f"{r['seconds']:.3f}",
            f"{rate:,.0f}",
            f"{rate / TARGET_ROWS_PER_S:.2f}x",
            f"{r['rows'] / (r['seconds'] + r['model_load_s']):,.0f}",
            f"{r['cpu_seconds']:.3f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['rss_growth_mb']:.1f}",
            f"{r['worker_peak_rss_mb']:.0f}" if r["worker_peak_rss_mb"] else "-",
        )
        print("  ".join(f"{c:>10}" for c in cells))
    loads = [r["model_load_s"] for r in results]
    imports = [r["import_s"] for r in results]
    print(
        f"not timed, once per process: imports {min(imports):.2f}-{max(imports):.2f} s, "
        f"language model load {min(loads) * 1000:.0f}-{max(loads) * 1000:.0f} ms"
    )
    for workers in sorted({r["workers"] for r in results}):
        mine = [r for r in results if r["workers"] == workers]
        if len(mine) >= 2:  # the two largest sizes: past the fixed costs and the caches filling
            small, large = mine[-2], mine[-1]
            extra = (large["rss_growth_mb"] - small["rss_growth_mb"]) * 1024 * 1024
            per_row = extra / max(1, large["rows"] - small["rows"])
            growth = ", ".join(f"{r['rss_growth_mb']:.1f} MB at {r['rows']:,}" for r in mine)
            print(
                f"workers {workers or 'auto'}: RSS growth {growth} rows: {per_row:.1f} bytes per "
                f"row from {small['rows']:,} to {large['rows']:,} (a row: ~1,300 bytes in, "
                "~2,500 out)"
            )


if __name__ == "__main__":
    main()
