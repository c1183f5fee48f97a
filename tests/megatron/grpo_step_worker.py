"""One rank of a Megatron GRPO step, started by ``torchrun`` from the tests (or called in the
test's own process for one rank):

    torchrun --nproc_per_node 2 tests/megatron/grpo_step_worker.py HF_DIR CHECKPOINT OUT \\
        --pp 2

Every rank builds the Megatron backend with the layout's TP / PP (the checkpoint, converted
on one rank, is resharded as it loads), runs one GRPO update (``update.policy_update``, two PPO
epochs, KL) on the fixed batch, then draws the weights under HF names
(``backend.hf_weights``: ``AutoBridge.export_hf_weights`` gathers each tensor over its TP
and PP groups on every rank, which each rank must draw in step). ``--export-only`` skips
the update (a TP > 1 update of a MoE model needs sequence parallelism, which needs
Transformer Engine: not on a CPU; ``validate_layout(training=True)`` refuses such a layout
for the GRPO step) and records the reference's log-probs instead, building the backend as one
that does not train. Rank 0
writes the export before and after the update and the update's statistics to OUT
(``torch.save``). Without CUDA it applies the test-only CPU patches, as the in-process tests
do.

``--wire FILE`` also records the updated weights as the dedicated engines receive them: the
stream cut into buckets (``remote.buckets``) and each flattened to its spec and one byte
tensor (``remote.flatten_bucket``), what ``RemoteRolloutEngine.sync_weights`` broadcasts; the vLLM
tests load that file into a vLLM engine (this env cannot hold vLLM, docs/megatron.md).
``--convert`` first converts HF_DIR into CHECKPOINT (one rank).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]  # the repository root

import cpu_patches  # noqa: E402


def grpo_step(
    hf_dir: Path,
    checkpoint: Path,
    out: Path,
    tp: int = 1,
    pp: int = 1,
    wire: Path | None = None,
    export_only: bool = False,
) -> None:
    """The step on this rank (world size = ``tp × pp``, one data-parallel replica);
    ``export_only``: the export and the reference's log-probs, no update."""
    import os

    import torch
    from test_megatron_grpo_step import _config
    from tests_helpers_trainer import fixed_grpo_batch
    from transformers import AutoConfig

    from trainer.backends import make_backend
    from trainer.distributed import DistInfo
    from trainer.grpo import micro_batch, update
    from trainer.grpo.config import GRPOConfig

    rank = int(os.environ.get("RANK", "0"))
    base = _config(checkpoint, distributed_optimizer=False).model_dump()
    world = tp * pp
    base["optim"]["megatron"]["layout"] = {"preset": "tiny-cpu", "tp": tp, "pp": pp}
    base["optim"]["megatron"]["layout"]["gpus_per_node"] = world
    cfg = GRPOConfig.model_validate({**base, "nproc": world})
    info = DistInfo(rank, world, rank, torch.device("cpu"))
    if export_only:  # no update: the layout is checked as one that does not train
        from trainer.megatron.build import build_megatron_backend

        backend = build_megatron_backend(cfg.optim, 6, info, hf_dir, True, training=False)
    else:
        backend = make_backend(
            None, cfg.optim, 6, info, 4, 1, with_reference=True, hf_dir=hf_dir, pad_id=0
        )
    try:
        before = {n: t.detach().cpu().clone() for n, t in backend.hf_weights()}
        batch = fixed_grpo_batch(AutoConfig.from_pretrained(hf_dir).vocab_size)
        if export_only:  # the frozen reference's log-probs: a forward without training
            micros = [
                micro_batch.sequences(batch.prompts, batch.rollouts[s : s + 4], 0, info.device)
                for s in range(0, 16, 4)
            ]
            scored = [t.cpu() for t in backend.log_probs(micros, reference=True)]
            if rank == 0:
                torch.save({"before": before, "reference_log_probs": scored}, out)
            return
        stats = update.policy_update(cfg, backend, batch, 0, 0)
        after = {n: t.detach().cpu().clone() for n, t in backend.hf_weights()}
        if rank == 0:
            torch.save({"before": before, "after": after, "stats": stats}, out)
        if wire is not None:
            from trainer.grpo.remote import buckets, flatten_bucket

            sent = [
                flatten_bucket(b, torch.device("cpu"))
                for b in buckets(backend.hf_weights(), 16 << 10)
            ]
            if rank == 0:
                torch.save(sent, wire)
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--wire", type=Path)
    parser.add_argument("--convert", action="store_true")
    parser.add_argument("--export-only", action="store_true")
    args = parser.parse_args()
    cpu_patches.import_megatron_bridge()
    from test_megatron_grpo_step import training_cpu_patches

    from trainer.megatron.bridge import convert_hf_to_megatron
    from trainer.megatron.layout import MegatronLayout

    with cpu_patches.cpu_patches(), training_cpu_patches():
        if args.convert:
            layout = MegatronLayout(name="tiny", params_dtype="fp32")
            convert_hf_to_megatron(str(args.hf_dir), str(args.checkpoint), layout)
        grpo_step(
            args.hf_dir, args.checkpoint, args.out, args.tp, args.pp, args.wire, args.export_only
        )


if __name__ == "__main__":
    main()
