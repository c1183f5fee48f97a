"""Weight-sync transport bench (issue #42): one sync of a weight stream from the trainer's
sender (``trainer.grpo.weight_transfer``) to receiving worker processes, per transport: the
bytes, buckets, collectives per bucket, seconds and GB/s.

The stream has the shapes of a model's HF weights (``capacity.model_spec``: the tiny model
with ``--dry-run``, else gpt-oss-20b cut to ``--layers`` decoder layers), bucketed and
pipelined as ``RemoteRolloutEngine.sync_weights`` sends them (``remote.buckets`` under
``weight_transfer.pipelined``). Each receiver joins as ``vllm_transfer``'s worker engine joins
(gloo: the ``tcp://host:port`` store prefix; NCCL: vLLM's ``nccl_common``) and receives each
bucket's bytes in one broadcast, onto its device, then checks the last bucket arrived intact.

    python bench/weight_sync.py --dry-run             # CPU: tiny shapes, lingo_gloo (CI)
    python bench/weight_sync.py --device cuda         # GPU: 2-layer gpt-oss-20b, bf16

On CUDA both transports run when the machine has two GPUs (sender on GPU 0, receivers after
it); NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so on
one GPU the ``nccl`` row is reported as not measurable and only ``lingo_gloo`` runs. Prints
one JSON line per transport; ``--out`` writes them to a file as well.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capacity.model_spec import load_model_spec  # noqa: E402
from trainer.grpo.remote import buckets  # noqa: E402
from trainer.grpo.weight_transfer import (  # noqa: E402
    TransferChoice,
    open_sender,
    pipelined,
)

TIMEOUT = timedelta(minutes=5)


TINY_DEMO = "tiny-demo"
"""The tiny-cpu preset's model (the CPU demo's), as ``--model`` names it."""


def model_spec(model: str):
    """A planner preset's shape, or the tiny-cpu demo's model (``TINY_DEMO``)."""
    if model != TINY_DEMO:
        return load_model_spec(model)
    from pipelines.presets import get_preset

    config = get_preset("tiny-cpu").model.tiny.model_dump(exclude={"seed"})
    return load_model_spec({**config, "model_type": "gpt_oss"})


def weight_shapes(model: str, layers: int | None) -> list[tuple[str, tuple[int, ...]]]:
    """The HF weight names and shapes of ``model`` (``model_spec``), ``layers`` decoder
    layers kept (None: all); as many elements as the planner counts."""
    spec = model_spec(model)
    h, heads, kv, d = (
        spec.hidden_size,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
    )
    e, i, v = spec.num_experts, spec.intermediate_size, spec.vocab_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for layer in range(layers if layers is not None else spec.num_layers):
        p = f"model.layers.{layer}"
        shapes += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (heads * d, h)),
            (f"{p}.self_attn.k_proj.weight", (kv * d, h)),
            (f"{p}.self_attn.v_proj.weight", (kv * d, h)),
            (f"{p}.self_attn.o_proj.weight", (h, heads * d)),
            (f"{p}.self_attn.sinks", (heads,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.router.weight", (e, h)),
            (f"{p}.mlp.experts.gate_up_proj", (e, h, 2 * i)),
            (f"{p}.mlp.experts.down_proj", (e, i, h)),
            (f"{p}.mlp.router.bias", (e,)),
            (f"{p}.mlp.experts.gate_up_proj_bias", (e, 2 * i)),
            (f"{p}.mlp.experts.down_proj_bias", (e, h)),
        ]
        if spec.attention_bias:
            shapes += [
                (f"{p}.self_attn.q_proj.bias", (heads * d,)),
                (f"{p}.self_attn.k_proj.bias", (kv * d,)),
                (f"{p}.self_attn.v_proj.bias", (kv * d,)),
                (f"{p}.self_attn.o_proj.bias", (h,)),
            ]
    shapes.append(("model.norm.weight", (h,)))
    if not spec.tie_word_embeddings:
        shapes.append(("lm_head.weight", (v, h)))
    return shapes


def receive(rank: int, world: int, transport: str, host: str, port: int, sizes, device, out):
    """One receiving worker: join at ``rank``, receive each bucket in one broadcast."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # the sender on GPU 0
    if transport == "nccl":
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        group = stateless_init_process_group(host, port, rank, world, torch.cuda.current_device())
    else:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=TIMEOUT)
        group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"tcp://{host}:{port}", store), rank, world, TIMEOUT
        )
    received, last = 0, None
    for size in sizes:
        if transport == "nccl":
            flat = torch.empty(size, dtype=torch.uint8, device="cuda")
            group.broadcast(flat, src=0, stream=torch.cuda.current_stream())
            torch.cuda.current_stream().synchronize()
        else:
            flat = torch.empty(size, dtype=torch.uint8)
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.broadcast([flat], options).wait()
            if device == "cuda":
                flat = flat.to("cuda")  # what the worker's loaders do with it
        received += flat.numel()
        last = flat
    out.put((rank, received, int(last.sum().item()) if last is not None else 0))


def stream(shapes, dtype, device, seed: int = 0):
    """The weights, made one at a time on ``device`` (what the trainer's gather yields)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in shapes:
        yield (
            name,
            torch.randn(shape, dtype=torch.float32, device=device, generator=generator).to(dtype),
        )


def run(transport: str, shapes, dtype, device: str, workers: int, bucket_mb: int) -> dict:
    from trainer.grpo.remote import flatten_bucket

    plan = [
        flat.numel()
        for _, flat in (
            flatten_bucket(b, "cpu") for b in buckets(stream(shapes, dtype, "cpu"), bucket_mb << 20)
        )
    ]
    host, world = "127.0.0.1", 1 + workers
    choice = TransferChoice(transport, True, "bench")
    sender = open_sender(choice, host, world, TIMEOUT)
    context = mp.get_context("spawn")
    out = context.Queue()
    procs = [
        context.Process(
            target=receive, args=(r, world, transport, host, sender.port, plan, device, out)
        )
        for r in range(1, world)
    ]
    for proc in procs:
        proc.start()
    sender.connect()
    started = time.monotonic()
    last_sum = 0
    for bucket in pipelined(buckets(stream(shapes, dtype, device), bucket_mb << 20)):
        _, flat = flatten_bucket(bucket, "cpu" if transport == "lingo_gloo" else device)
        sender.send(flat)
        last_sum = int(flat.sum().item())
    seconds = time.monotonic() - started
    answers = [out.get(timeout=TIMEOUT.total_seconds()) for _ in procs]
    for proc in procs:
        proc.join()
    sender.close()
    total = sum(plan)
    assert all(got == total and tail == last_sum for _, got, tail in answers), answers
    return {
        "transport": transport,
        "device": device,
        "workers": workers,
        "bytes_per_worker": total,
        "bytes": sender.stats.bytes,
        "buckets": sender.stats.buckets,
        "collectives_per_bucket": sender.stats.collectives_per_bucket,
        "relay_factor": max(got for _, got, _ in answers) / total,
        "seconds": round(seconds, 3),
        "gb_per_s_per_worker": round(total / seconds / 1e9, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (CI)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default="gpt-oss-20b", help=f"a planner preset or {TINY_DEMO}")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.dry_run:
        args.device, args.model, args.layers, args.bucket_mb = "cpu", TINY_DEMO, None, 1
        args.workers = max(args.workers, 2)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --dry-run on CPU)")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shapes = weight_shapes(args.model, args.layers)
    transports = ["lingo_gloo"]
    rows = []
    if args.device == "cuda":
        if torch.cuda.device_count() > args.workers:
            transports.insert(0, "nccl")
        else:
            rows.append(
                {
                    "transport": "nccl",
                    "device": "cuda",
                    "measured": False,
                    "why": f"{torch.cuda.device_count()} GPU(s): NCCL needs the sender and each "
                    "receiver on GPUs of their own",
                }
            )
            if args.workers >= torch.cuda.device_count():
                args.workers = 1
    for transport in transports:
        rows.append(run(transport, shapes, dtype, args.device, args.workers, args.bucket_mb))
    lines = [json.dumps({"model": args.model, "layers": args.layers, **row}) for row in rows]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
