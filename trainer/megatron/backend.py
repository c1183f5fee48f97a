"""The Megatron-Core training backend of the GRPO loop (``optim.backend: megatron``).

The actor (and, when KL is on, a frozen reference) is built by megatron-bridge's provider from
the SFT model's Hugging Face config with the layout's TP/PP/EP/ETP and sequence parallelism,
wrapped in Megatron-Core's ``DistributedDataParallel``, and loaded from the ``torch_dist``
checkpoint ``convert_megatron`` wrote. Every forward runs through Megatron-Core's pipeline
schedule (``get_forward_backward_func()``): with PP > 1 a stage holds only its layers, so the
loop hands over whole micro-batch lists and a per-micro-batch loss function
(``TrainingBackend.forward_backward``), and only the last stage computes log-probs and losses.

Layout: the loop's rows are right-aligned (left padding); Megatron gets them left-aligned with
padding at the end, positions ``0..n-1`` and the causal mask only (padding after a row's last
token cannot reach it), every micro-batch of one call padded to the same length (pipeline
stages exchange fixed shapes; a multiple of TP with sequence parallelism). The response
log-probs and entropies go back to the loop's ``[B, width]`` right-aligned layout.

Logits are split over TP along the vocabulary; log-probs and entropies are computed from the
shards with sums over the TP group and an analytic backward that needs no communication (as
Megatron's ``vocab_parallel_cross_entropy``). Columns of Megatron's padded vocabulary beyond
the model's are masked out.

Loss scaling: the loop's micro-batch loss is already its share of the global loss. Megatron's
schedule divides a returned ``(loss, stats)`` by the number of micro-batches and DDP averages
gradients over the data-parallel group, so the loss handed to the schedule is multiplied by
both; the gradients end up the plain sum, as with the other backends.

Also here: the distributed optimizer (``OptimizerConfig`` from ``OptimConfig``: lr, betas,
weight decay, clipping, optional CPU offload), the learning-rate schedule (``lr_factor``, the
same as the other backends), activation recompute, ``torch_dist`` checkpoints for resume, and
the weights in Hugging Face names for the rollout engine (``AutoBridge.export_hf_weights``:
one tensor at a time, each gathered over its own TP/EP/PP group, never the whole model on one
rank). megatron-core / megatron-bridge need Python >= 3.12 and are imported inside the
functions.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.backends.config import OptimConfig
from trainer.backends.interface import DataParallel, LossFn, ResponseBatch
from trainer.backends.schedule import lr_factor
from trainer.megatron.vocab_parallel import VocabShard, vocab_parallel_log_probs

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "megatron"
"""Where ``save_checkpoint`` puts the ``torch_dist`` files inside a ``step-<N>`` directory."""

_INSTALL_HINT = (
    "optim.backend=megatron needs megatron-core and megatron-bridge, which need Python >= 3.12: "
    "pip install 'lingo-rl[megatron]' in a Python 3.12+ environment (the GPU image has it)"
)


def require_megatron() -> None:
    """Raise a clear ``ImportError`` unless megatron-core and megatron-bridge import."""
    if sys.version_info < (3, 12):
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise ImportError(f"{_INSTALL_HINT}; this is Python {version}")
    try:
        import megatron.bridge  # noqa: F401
        import megatron.core  # noqa: F401
    except ImportError as err:
        raise ImportError(f"{_INSTALL_HINT} ({err})") from err


# --- batches: the loop's right-aligned rows as Megatron's left-aligned ones -----------------


@dataclass
class MegatronBatch:
    """One micro-batch as Megatron runs it: each row's tokens from column 0, then padding."""

    input_ids: torch.Tensor
    """``[B, S]``."""
    position_ids: torch.Tensor
    """``[B, S]``: ``0..S-1`` on every row."""
    lengths: torch.Tensor
    """``[B]`` tokens (prompt + response) per row."""
    response_lengths: torch.Tensor
    """``[B]`` response tokens per row (the row's last tokens)."""
    width: int
    """The loop's response width: log-probs come back as ``[B, width]``, right-aligned."""
    temperature: float = 1.0
    """The log-probs and entropies are of ``softmax(logits / temperature)``
    (``ResponseBatch.temperature``)."""


def padded_length(micro_batches: Sequence[ResponseBatch], multiple: int = 1) -> int:
    """The sequence length every micro-batch of one schedule call is padded to: the longest
    row, at least 2, rounded up to ``multiple`` (TP with sequence parallelism)."""
    longest = max(int(m.attention.sum(-1).max()) for m in micro_batches)
    return math.ceil(max(2, longest) / multiple) * multiple


def megatron_batch(micro: ResponseBatch, seq_len: int, pad_id: int, device) -> MegatronBatch:
    """``micro``'s rows left-aligned into ``[B, seq_len]``."""
    lengths = micro.attention.sum(-1).long()
    rows, total = micro.ids.shape
    if int(lengths.max()) > seq_len:
        raise ValueError(f"a row of {int(lengths.max())} tokens does not fit seq_len {seq_len}")
    input_ids = torch.full((rows, seq_len), pad_id, dtype=torch.long)
    for i, length in enumerate(lengths.tolist()):
        input_ids[i, :length] = micro.ids[i, total - length :].cpu()
    return MegatronBatch(
        input_ids=input_ids.to(device),
        position_ids=torch.arange(seq_len, device=device).repeat(rows, 1),
        lengths=lengths.to(device),
        response_lengths=micro.mask.sum(-1).round().long().to(device),
        width=micro.mask.shape[1],
        temperature=micro.temperature,
    )


def response_log_probs(
    logits: torch.Tensor, batch: MegatronBatch, shard: VocabShard, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The response tokens' log-probs (and entropies) of ``softmax(logits / T)``
    (``batch.temperature``) as ``[B, width]``, right-aligned.

    Logit ``t`` of a row predicts its token ``t + 1``; only the positions from the earliest
    response's predictor on are computed. Columns before a row's response are 0.
    """
    seq_len = logits.shape[1]
    predictors = (batch.lengths - batch.response_lengths - 1).clamp(min=0)
    start = min(int(predictors.min()), seq_len - 2)
    window = logits[:, start : seq_len - 1]
    targets = batch.input_ids[:, start + 1 : seq_len]
    log_probs, entropy = vocab_parallel_log_probs(
        window, targets, shard, with_entropy, batch.temperature
    )
    columns = torch.arange(batch.width, device=logits.device)
    # column c holds the row's token at L − width + c, predicted by logit L − width + c − 1
    source = (batch.lengths - batch.width - 1 - start)[:, None] + columns[None, :]
    valid = columns[None, :] >= (batch.width - batch.response_lengths)[:, None]
    index = source.clamp(0, window.shape[1] - 1)

    def align(values: torch.Tensor) -> torch.Tensor:
        return torch.gather(values, 1, index) * valid

    return align(log_probs), align(entropy) if entropy is not None else None


# --- the backend ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelContext:
    """Where this rank sits in Megatron's grids, as far as the backend needs it."""

    data_parallel: DataParallel
    """The data-parallel group: ranks with different micro-batches (DDP averages over it)."""
    pipeline_group: Any = None
    """This rank's pipeline-parallel group; ``None``: one stage."""
    last_stage_rank: int = 0
    """Global rank of the last pipeline stage of this rank's pipeline."""
    is_last_stage: bool = True
    seq_multiple: int = 1
    """Sequences are padded to a multiple of this (TP with sequence parallelism)."""

    @classmethod
    def from_parallel_state(cls, device: torch.device, sequence_parallel: bool) -> ParallelContext:
        """The context of this rank, from Megatron-Core's ``parallel_state``."""
        from megatron.core import parallel_state as mpu

        pipeline = mpu.get_pipeline_model_parallel_world_size()
        return cls(
            data_parallel=DataParallel(
                rank=mpu.get_data_parallel_rank(),
                size=mpu.get_data_parallel_world_size(),
                device=device,
                group=mpu.get_data_parallel_group(),
            ),
            pipeline_group=mpu.get_pipeline_model_parallel_group() if pipeline > 1 else None,
            last_stage_rank=mpu.get_pipeline_model_parallel_last_rank(),
            is_last_stage=mpu.is_pipeline_last_stage(ignore_virtual=True),
            seq_multiple=mpu.get_tensor_model_parallel_world_size() if sequence_parallel else 1,
        )


def gpt_forward(chunk, batch: MegatronBatch) -> torch.Tensor:
    """A Megatron ``GPTModel`` chunk on one micro-batch: logits ``[B, S, V/TP]`` on the last
    stage, hidden states for the next stage elsewhere (the causal mask only)."""
    return chunk(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None)


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / Float16Module wrappers (whose state dicts, sharded or not,
    carry a ``module.`` prefix that checkpoints of the bare model do not have)."""
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk


class MegatronBackend:
    """GRPO's training backend on Megatron-Core (see the module docstring).

    Built by ``build_megatron_backend``; the pieces are passed in, so the micro-batch plumbing
    also runs with stand-ins (a schedule that follows Megatron's contract, a plain module).
    """

    forward_is_collective = False
    """The HF policy an in-process engine samples with is a whole copy (not this model)."""

    def __init__(
        self,
        *,
        model: list[torch.nn.Module],
        optimizer,
        cfg: OptimConfig,
        total_steps: int,
        parallel: ParallelContext,
        vocab: VocabShard,
        pad_id: int,
        schedule: Callable,
        forward: Callable[[torch.nn.Module, MegatronBatch], torch.Tensor] = gpt_forward,
        reference: list[torch.nn.Module] | None = None,
        bridge=None,
        dtype: torch.dtype = torch.float32,
        checkpoint_metadata: dict | None = None,
        cleanup: contextlib.ExitStack | None = None,
    ) -> None:
        self.module = model
        self.model = model
        self.optimizer = optimizer
        self.cfg = cfg
        self.total_steps = total_steps
        self.parallel = parallel
        self.data_parallel = parallel.data_parallel
        self.vocab = vocab
        self.pad_id = pad_id
        self.schedule = schedule
        self.forward = forward
        self.reference = reference
        self.bridge = bridge
        self.dtype = dtype
        self.checkpoint_metadata = checkpoint_metadata or {}
        self._cleanup = cleanup or contextlib.ExitStack()
        self._step = 0

    # the update

    def forward_backward(
        self, micro_batches: Sequence[ResponseBatch], loss_fn: LossFn
    ) -> list[dict[str, float]]:
        for chunk in self.model:
            chunk.train()
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        stats = self._run_schedule(self.model, micro_batches, loss_fn)
        return self._from_last_stage(stats)

    @torch.no_grad()
    def log_probs(
        self, micro_batches: Sequence[ResponseBatch], reference: bool = False
    ) -> list[torch.Tensor]:
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: it is built only when kl_loss_coef > 0")
        outputs = [out["log_probs"] for out in self._run_schedule(model, micro_batches, None)]
        if self.parallel.pipeline_group is None:
            return outputs
        shared = self._from_last_stage([t.cpu() for t in outputs])  # pickled between stages
        return [t.to(self.data_parallel.device) for t in shared]

    def _run_schedule(
        self, model: list[torch.nn.Module], micro_batches: Sequence[ResponseBatch], loss_fn
    ) -> list:
        """One call of the pipeline schedule over ``micro_batches``; ``loss_fn`` None: forward
        only, collecting the log-probs. Returns what the last stage's loss functions reported
        (an empty list on other stages)."""
        forward_only = loss_fn is None
        device = self.data_parallel.device
        seq_len = padded_length(micro_batches, self.parallel.seq_multiple)
        batches = [megatron_batch(m, seq_len, self.pad_id, device) for m in micro_batches]
        rows = {int(b.input_ids.shape[0]) for b in batches}
        if len(rows) != 1:
            raise ValueError(
                f"micro-batches of one schedule call have {sorted(rows)} rows; they need the same "
                "number (pipeline stages exchange fixed shapes)"
            )
        # the schedule divides the returned loss by the micro-batch count and DDP averages the
        # gradients over data-parallel ranks; the loop's loss is already its global share
        scale = len(batches) * self.data_parallel.size

        def forward_step(data_iterator, chunk):
            k, batch = next(data_iterator)
            output = self.forward(chunk, batch)

            def loss_func(output_tensor: torch.Tensor):
                log_probs, entropy = response_log_probs(
                    output_tensor, batch, self.vocab, with_entropy=not forward_only
                )
                if forward_only:
                    return output_tensor.new_zeros(()), {"log_probs": log_probs.detach()}
                loss, stats = loss_fn(k, log_probs, entropy)
                return loss * scale, stats

            return output, loss_func

        items = list(enumerate(batches))
        return self.schedule(
            forward_step_func=forward_step,
            data_iterator=[iter(items) for _ in model],
            model=model,
            num_microbatches=len(batches),
            seq_length=seq_len,
            micro_batch_size=next(iter(rows)),
            forward_only=forward_only,
        )

    def _from_last_stage(self, values: list) -> list:
        """The last pipeline stage's ``values`` on every stage of this pipeline."""
        if self.parallel.pipeline_group is None:
            return values
        import torch.distributed as dist

        box = [values if self.parallel.is_last_stage else None]
        dist.broadcast_object_list(
            box, src=self.parallel.last_stage_rank, group=self.parallel.pipeline_group
        )
        return box[0]

    def step(self) -> float:
        """Set this step's learning rate, clip and update (Megatron's optimizer reduces the
        gradient norm over the model-parallel ranks); returns the norm before clipping."""
        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            value = lr * group.get("lr_mult", 1.0)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(value)
            else:
                group["lr"] = value
        updated, grad_norm, _ = self.optimizer.step()
        self._step += 1
        if not updated:
            log.warning("Megatron's optimizer skipped step %d (non-finite gradients)", self._step)
        return float(grad_norm) if grad_norm is not None else float("nan")

    def learning_rate(self) -> float:
        return self.cfg.learning_rate * lr_factor(self._step, self.total_steps, self.cfg)

    # checkpoints

    def _sharded_state(self, is_loading: bool) -> dict:
        state: dict[str, Any] = {}
        for i, chunk in enumerate(self.model):
            key = "model" if len(self.model) == 1 else f"model{i}"
            state[key] = unwrap(chunk).sharded_state_dict(metadata=dict(self.checkpoint_metadata))
        state["optimizer"] = self.optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=dict(self.checkpoint_metadata)
        )
        state["lr_step"] = self._step
        return state

    def save_checkpoint(self, directory: Path) -> None:
        """Model, optimizer and schedule position as a ``torch_dist`` checkpoint in
        ``directory/megatron`` (collective; each rank writes its shards)."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        target = Path(directory) / CHECKPOINT_DIR
        if dist.get_rank() == 0:
            target.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(
            self._sharded_state(is_loading=False),
            str(target),
            content_metadata=dict(self.checkpoint_metadata),
        )

    def load_checkpoint(self, directory: Path) -> None:
        """Resume from ``save_checkpoint``'s files (the same layout; data-parallel size may
        differ only without the distributed optimizer's ``dp_reshardable`` state)."""
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(
            self._sharded_state(is_loading=True),
            str(Path(directory) / CHECKPOINT_DIR),
            strict="raise_all",
        )
        for i, chunk in enumerate(self.model):
            key = "model" if len(self.model) == 1 else f"model{i}"
            load_model_state(unwrap(chunk), loaded[key], directory)
        self.optimizer.load_state_dict(loaded["optimizer"])
        self._step = int(loaded["lr_step"])

    def set_base_learning_rate(self, learning_rate: float) -> None:
        """Nothing to do: each step's rate is ``cfg.learning_rate × lr_factor`` from the
        config this backend was built with, not from the checkpoint."""

    # weights out

    def hf_weights(self, trainable_only: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
        """The actor's weights under HF names, one gathered tensor at a time, on every rank
        (every one is trained here: ``trainable_only`` leaves none out)."""
        return self._export(cpu=False)

    def _export(self, cpu: bool) -> Iterable[tuple[str, torch.Tensor]]:
        return self.bridge.export_hf_weights(
            self.model, cpu=cpu, show_progress=False, weight_dtype=self.dtype
        )

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every weight (HF names) on CPU on rank 0, None elsewhere: the whole model on one
        host; the GRPO loop streams instead (``hf_weights``, ``save_hf_pretrained``)."""
        import torch.distributed as dist

        main = dist.get_rank() == 0
        state = {}
        for name, tensor in self._export(cpu=True):
            if main:
                state[name] = tensor.clone()
        return state if main else None

    def save_policy(
        self, directory: Path, base_model: str | Path | None = None, dtype=None
    ) -> None:
        """The actor's weights as a Megatron ``torch_dist`` checkpoint laid out like
        ``convert_megatron``'s (the GRPO step's ``model`` output on this backend; the
        pipeline's ``export_hf`` turns it into a HF directory; ``base_model`` and ``dtype``
        are not needed). Collective."""
        from trainer.megatron.bridge import save_megatron_model

        save_megatron_model([unwrap(chunk) for chunk in self.model], directory)

    def save_hf_pretrained(self, directory: Path, base_model: str | Path, dtype) -> None:
        """The actor as a HF directory: the weights streamed to safetensors shards of at most
        5 GB that rank 0 writes as they fill (``trainer.megatron.bridge``'s shard writer),
        ``config.json`` and ``generation_config.json`` from ``base_model``. Collective."""
        import torch.distributed as dist
        from transformers import AutoConfig

        from core.mxfp4 import drop_quantization_config
        from trainer.megatron.bridge import _ShardWriter

        directory = Path(directory)
        writer = _ShardWriter(directory) if dist.get_rank() == 0 else None
        for name, tensor in self._export(cpu=True):
            if writer is not None:
                writer.add(name, tensor)
        if writer is not None:
            writer.close()
            config = AutoConfig.from_pretrained(str(base_model))
            config.dtype = self.dtype
            drop_quantization_config(config)  # the weights written are unpacked
            config.save_pretrained(directory)
            generation = Path(base_model) / "generation_config.json"
            if generation.is_file():
                shutil.copy(generation, directory / generation.name)
        dist.barrier()

    def unwrapped(self) -> torch.nn.Module:
        return torch.nn.ModuleList(unwrap(chunk) for chunk in self.model)

    def close(self) -> None:
        """Tear down the Megatron parallel state this backend set up."""
        self._cleanup.close()


def load_model_state(chunk: torch.nn.Module, state: dict, source) -> None:
    """``chunk.load_state_dict`` that fails on any missing or unexpected weight; only
    Transformer Engine's ``_extra_state`` (fp8 metadata) may be absent, as in
    ``trainer.megatron.bridge``'s loader."""
    from trainer.megatron.bridge import MegatronCheckpointError

    missing, unexpected = chunk.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise MegatronCheckpointError(
            f"{source}: does not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
