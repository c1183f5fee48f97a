"""Do two Pythons (two torch releases) speak one job's store and channels? One measurement.

The Megatron branch's decoupled GRPO job spans two images: the trainers run the Megatron
image (NGC PyTorch 25.10, its own torch build), the dedicated vLLM engines the GPU image
(torch 2.14.0). One torchrun job holds both, so one c10d TCPStore (hosted by node 0's
torchrun agent, a trainer pod) and the gloo channels built from it
(``trainer.grpo.channels``) carry messages and weights between two torch releases.

This runs that wire with each side in its own Python, as two torchrun "nodes" of one static
rendezvous on 127.0.0.1 (node 0 hosts the store). Each process runs the project's own code:
``job_store``, ``open_channels`` (with its torch-release handshake), ``announce_ready`` /
``wait_until_ready``, then over the channel ``broadcast_object`` of a nested dict (dtypes,
shapes, unicode, big ints, bytes, an int16 numpy array: what the weight stream's headers and
the rollouts carry), ``broadcast_tensor`` of a uint8 weight bucket (64 MiB,
``rollout.sync_bucket_mb``'s default) and of a float32 and a bfloat16 tensor whose bit
patterns cover NaNs, infinities, signed zeros and subnormals, and ``gather_objects`` of each
side's report. Every value is checked
bit for bit on the receiving side. Node 0 prints one JSON line: both sides' torch and Python,
bytes, seconds, pass or fail with the error.

    # driver: launches both nodes, both orders when the Pythons differ (one JSON line each)
    python bench/channel_compat.py --python-a .venv/bin/python \\
        --python-b .venv-torch-old/bin/python [--bucket-mb 64] [--json results.jsonl]

Each Python needs torch and what ``trainer.grpo.channels`` imports (numpy, pydantic, tqdm:
both images carry the whole project); the repository goes on its ``PYTHONPATH``. The
figures are in docs/megatron.md, "Two torch releases in one job".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG_TAIL = 4000
"""Characters of a node's output kept in a failed run's report."""

log = logging.getLogger("bench.channel_compat")


# ---- node side: one process of the two-node job ------------------------------------------


def _message():
    """The nested object the leader broadcasts (built the same on both sides, to compare),
    with a rollout's ``routed_experts`` (an int16 numpy array) among its values."""
    import numpy as np
    import torch

    return {
        "routed_experts": np.arange(-300, 300, 7, dtype=np.int16).reshape(2, -1),
        "bucket": (
            "bucket",
            [("model.layers.0.mlp.experts.gate_up_proj", torch.bfloat16, (4, 64, 256))],
        ),
        "dtypes": [torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float16],
        "shape": torch.Size([2, 3, 5]),
        "text": "réponse — Antwort — 回答 \u2028 \x00",
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**100],
        "floats": [0.1, -0.0, float("inf"), 1e-310],
        "bytes": bytes(range(256)),
        "nested": {"a": [{"b": (1, 2.5, None, True)}], ("tuple", "key"): frozenset({1, 2})},
    }


def _bucket(n_bytes: int):
    """``n_bytes`` of uint8 whose every MiB differs: integer arithmetic, the same on any torch."""
    import torch

    block = 1 << 20
    i = torch.arange(block, dtype=torch.int64)
    pattern = ((i * 131 + (i >> 8) * 7 + 17) % 256).to(torch.uint8)
    blocks = -(-n_bytes // block)
    shift = (torch.arange(blocks, dtype=torch.int64) % 256).to(torch.uint8)[:, None]
    return (pattern.repeat(blocks, 1) + shift).view(-1)[:n_bytes].contiguous()


def _bit_patterns(n: int, bits: int):
    """``n`` integers spread over the ``bits``-bit patterns, led by +0, -0, the smallest
    subnormal, +inf and a NaN once viewed as floats (as int32 / int16)."""
    import torch

    sign = 1 << (bits - 1)
    inf = 0x7F800000 if bits == 32 else 0x7F80
    i = torch.arange(n, dtype=torch.int64)
    spread = (i * 2654435761 + 12345) % (1 << bits) - sign  # as signed integers
    spread[:5] = torch.tensor([0, -sign, 1, inf, sign - 1], dtype=torch.int64)
    return spread.to(torch.int32 if bits == 32 else torch.int16)


def _float_tensors(n: int):
    """A float32 and a bfloat16 tensor made from bit patterns (compared as integers)."""
    import torch

    return {
        "float32": _bit_patterns(n, 32).view(torch.float32).view(n // 512, 512),
        "bfloat16": _bit_patterns(n, 16).view(torch.bfloat16).view(n // 512, 512),
    }


def _same_message(got: dict, want: dict) -> bool:
    import numpy as np

    got, want = dict(got), dict(want)
    array, expected = got.pop("routed_experts"), want.pop("routed_experts")
    same_array = array.dtype == expected.dtype and np.array_equal(array, expected)
    return same_array and got == want and repr(got) == repr(want)


def _same_bits(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(width), b.view(width))


def run_node(bucket_mb: int, timeout_s: float) -> dict:
    """This process's part of the job (under torchrun, one process per node). Returns the
    report on node 0 (both sides' checks, gathered over the channel); None on node 1."""
    import torch

    from trainer.grpo import channels

    rank = int(os.environ["RANK"])
    other = 1 - rank
    timeout = timedelta(seconds=timeout_s)
    seconds: dict[str, float] = {}
    checks: dict[str, bool] = {}

    def timed(name, call, *args):
        started = time.perf_counter()
        out = call(*args)
        seconds[name] = round(time.perf_counter() - started, 4)
        return out

    store = timed("store", channels.job_store, timeout)
    channel, weights = timed("channels", channels.open_channels, store, [1], [1], rank, timeout)
    assert channel is weights and channel.members == [0, 1]
    channels.announce_ready(store, rank)
    timed("ready", channels.wait_until_ready, store, [other], timeout, "the other node")

    expected = _message()
    received = timed("object", channel.broadcast_object, expected if rank == 0 else None)
    checks["object"] = _same_message(received, expected)

    bucket_bytes = bucket_mb << 20
    want = _bucket(bucket_bytes)
    got = want if rank == 0 else torch.empty_like(want)
    timed("bucket", channel.broadcast_tensor, got)
    checks["bucket"] = _same_bits(got, want)

    for name, want in _float_tensors(1 << 20).items():
        got = want if rank == 0 else torch.empty_like(want)
        timed(name, channel.broadcast_tensor, got)
        checks[name] = _same_bits(got, want)

    report = {
        "node": rank,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "checks": checks,
        "broadcast_bytes": channel.broadcast_bytes,
        "seconds": seconds,
    }
    reports = timed("gather", channel.gather_objects, report)
    channel.close()
    if rank != 0:
        return None
    gathered = [r["node"] for r in reports] == [0, 1]
    peer = reports[1]
    passed = gathered and all(checks.values()) and all(peer["checks"].values())
    failed = [f"node {r['node']}: {k}" for r in reports for k, ok in r["checks"].items() if not ok]
    return {
        "pass": passed,
        "error": None if passed else "values differ: " + ", ".join(failed or ["gather"]),
        "node0": {k: report[k] for k in ("torch", "python")},
        "node1": {k: peer[k] for k in ("torch", "python")},
        "store_on": "node0",
        "bucket_bytes": bucket_bytes,
        "bytes": report["broadcast_bytes"],
        "bucket_mb_per_s": round(bucket_mb / max(seconds["bucket"], 1e-9), 1),
        "seconds": seconds,
        "node1_seconds": peer["seconds"],
        "checks": {f"node1.{k}": v for k, v in peer["checks"].items()},
    }


def _node_main(args: argparse.Namespace) -> int:
    # Python put bench/ first on the path, where bench/data_prep.py would shadow the
    # package: the repository goes first
    here = Path(__file__).resolve().parent
    sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != here]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    try:
        report = run_node(args.bucket_mb, args.timeout_s)
    except Exception as exc:  # reported on one line, the run fails
        logging.exception("channel_compat node failed")
        print(json.dumps({"pass": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    if report is None:
        return 0
    report["seconds"]["total"] = round(time.perf_counter() - started, 3)
    line = json.dumps(report)
    if args.result:
        partial = Path(f"{args.result}.partial")
        partial.write_text(line + "\n")
        os.replace(partial, args.result)
    print(line, flush=True)
    return 0 if report["pass"] else 1


# ---- driver: launches the two nodes -----------------------------------------------------


_PROBE = """
import json, platform, torch
versions = {"torch": torch.__version__, "python": platform.python_version()}
try:
    import trainer.grpo.channels
except ImportError as exc:
    versions["missing"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(versions))
"""


def python_versions(python: str) -> dict:
    """``python``'s torch and Python versions; exits naming what it lacks to run a node."""
    done = subprocess.run(
        [python, "-c", _PROBE], capture_output=True, text=True, env=_node_env(), timeout=300
    )
    if done.returncode != 0:
        raise SystemExit(f"{python}: cannot import torch: {done.stderr.strip()[-500:]}")
    versions = json.loads(done.stdout.strip().splitlines()[-1])
    if "missing" in versions:
        raise SystemExit(
            f"{python}: cannot import trainer.grpo.channels ({versions['missing']}): install "
            f"what it needs beside torch: {python} -m pip install numpy pydantic tqdm"
        )
    return {"bin": python, **versions}


def _node_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "VLLM"))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _error_line(output: str) -> str | None:
    """A node's error: the one its process reported (``_node_main``), else the last line of
    its output that names one (torch's, torchrun's)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith('{"pass": false'):
            return json.loads(line)["error"]
    for line in reversed(lines):
        if re.search(r"(Error|Exception|error:|failed|Timeout|refused)", line):
            return line[-600:]
    return None


def _handshake_lines(output: str) -> list[str]:
    """What the coordinator's torch-release handshake logged (``channels.check_torch_releases``)."""
    marks = ("rollout channel members", "torch releases")
    return [line for line in output.splitlines() if any(m in line for m in marks)]


def run_pair(python0: dict, python1: dict, bucket_mb: int, timeout_s: float) -> dict:
    """One two-node job: ``python0`` as node 0 (hosting the store), ``python1`` as node 1."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="channel-compat-") as tmp:
        result = Path(tmp) / "result.json"
        processes = []
        for node, python in enumerate((python0, python1)):
            command = [python["bin"], "-m", "torch.distributed.run", "--nnodes=2"]
            command += [f"--node_rank={node}", "--nproc_per_node=1", "--master_addr=127.0.0.1"]
            command += [f"--master_port={port}", str(Path(__file__).resolve()), "--worker"]
            command += ["--bucket-mb", str(bucket_mb), "--timeout-s", str(timeout_s)]
            if node == 0:
                command += ["--result", str(result)]
            processes.append(
                subprocess.Popen(
                    command,
                    env=_node_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,  # its own group: a hung node is ended whole
                )
            )
        started = time.monotonic()
        outputs, hung = [], []
        for process in processes:
            left = max(1.0, timeout_s + 60 - (time.monotonic() - started))
            try:
                outputs.append(process.communicate(timeout=left)[0])
            except subprocess.TimeoutExpired:
                hung.append(processes.index(process))
                os.killpg(process.pid, signal.SIGKILL)
                outputs.append(process.communicate()[0])
        wall = round(time.monotonic() - started, 2)
        report = json.loads(result.read_text()) if result.exists() else None
    pair = {"node0": _side(python0), "node1": _side(python1)}
    if report is None:
        errors = {f"node{n}": _error_line(out) for n, out in enumerate(outputs)}
        report = {
            "pass": False,
            "error": "; ".join(f"{k}: {v}" for k, v in errors.items() if v)
            or (f"node(s) {hung} hung" if hung else "no report"),
            "store_on": "node0",
        }
        report["log_tails"] = {f"node{n}": out[-LOG_TAIL:] for n, out in enumerate(outputs)}
    report.update(pair)
    report["exit_codes"] = [p.returncode for p in processes]
    report["wall_s"] = wall
    report["handshake"] = _handshake_lines(outputs[0])
    return report


def _side(python: dict) -> dict:
    return {k: python[k] for k in ("torch", "python", "bin")}


def _driver_main(args: argparse.Namespace) -> int:
    same = Path(args.python_a).absolute() == Path(args.python_b).absolute()
    side_a = python_versions(args.python_a)
    sides = [side_a, side_a if same else python_versions(args.python_b)]
    orders = [(0, 1)] if same or args.one_order else [(0, 1), (1, 0)]
    passed = True
    lines = []
    for first, second in orders:
        report = run_pair(sides[first], sides[second], args.bucket_mb, args.timeout_s)
        passed &= report["pass"]
        line = json.dumps(report)
        lines.append(line)
        print(line, flush=True)
    if args.json:
        partial = Path(f"{args.json}.partial")
        partial.write_text("".join(f"{line}\n" for line in lines))
        os.replace(partial, args.json)
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-a", default=sys.executable, help="node 0's Python first")
    parser.add_argument("--python-b", default=sys.executable, help="node 1's Python first")
    parser.add_argument("--one-order", action="store_true", help="only A as node 0")
    parser.add_argument("--bucket-mb", type=int, default=64, help="the weight bucket's MiB")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="store/channel timeout")
    parser.add_argument("--json", help="also write the JSON lines here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return _node_main(args) if args.worker else _driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
