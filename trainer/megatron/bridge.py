"""Every call into megatron-bridge and megatron-core, in one place.

The rest of ``trainer.megatron`` (layout checks, manifest, precision report) and
``trainer.export_hf`` call only these:

- ``convert_hf_to_megatron``: HF directory → Megatron distributed checkpoint (``torch_dist``);
- ``export_megatron_to_hf``: Megatron checkpoint → HF safetensors + ``config.json``, streamed;
- ``megatron_next_token_logits``: next-token logits of the Megatron model (precision check);
- ``megatron_parallel``: the ``torch.distributed`` process group and Megatron-Core parallel
  state they run in.

Checkpoint layout (Megatron-LM's and megatron-bridge's): ``<dir>/iter_0000000/`` holds the
``torch_dist`` files of ``{"checkpoint_version": 3.0, "iteration": 0, "model": <sharded state
dict>}`` (``model0``, ``model1``, … with virtual pipeline stages) and
``<dir>/latest_checkpointed_iteration.txt`` says ``0``, so megatron-bridge's
``_load_model_weights_from_checkpoint`` and Megatron-LM's ``--pretrained-checkpoint`` read it.
A ``torch_dist`` checkpoint reshards on load: the loaders here rebuild the model from the HF
config in the caller's parallel layout (TP = PP = EP = 1 in a plain single process) and
``dist_checkpointing.load`` reassembles the shards, whatever layout they were saved with.

megatron-core / megatron-bridge need Python ≥ 3.12 and are imported inside the functions
(``pip install 'lingo-rl[megatron]'``; ``tools/megatron_env.sh`` builds a CPU test env).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from core.atomic import publish_dir
from plan import ParallelSizes

if TYPE_CHECKING:
    from trainer.megatron.layout import MegatronLayout

log = logging.getLogger(__name__)

ITERATION_DIR = "iter_0000000"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
EMBEDDING_KEY = "embedding.word_embeddings.weight"
MAX_SHARD_BYTES = 5 * 1024**3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INSTALL_HINT = (
    "the Megatron path needs megatron-core and megatron-bridge (Python >= 3.12): "
    "pip install 'lingo-rl[megatron]', or bash tools/megatron_env.sh for a CPU test env"
)


@dataclass(frozen=True)
class MegatronSizes:
    """What the bridge sets on a model provider: the parallel sizes and Megatron's two
    settings beside them. The rules they meet are checked before they get here
    (``plan.ParallelSizes``, ``trainer.megatron.layout.validate_layout``), and Megatron-Core
    checks them again when its state is built; the bridge adds none.

    Attributes:
        sizes: tp, pp, ep, etp, cp (and dp, where known).
        vpp: virtual pipeline stages per pipeline rank (``None``: off).
        sequence_parallel: split layer-norm/dropout activations along the sequence over TP.
    """

    sizes: ParallelSizes = ParallelSizes()
    vpp: int | None = None
    sequence_parallel: bool = False

    @classmethod
    def of(cls, layout: MegatronLayout) -> MegatronSizes:
        """A Megatron layout's sizes, ``vpp`` and ``sequence_parallel``."""
        return cls(layout.parallel_sizes, layout.vpp, layout.sequence_parallel)


class MegatronCheckpointError(ValueError):
    """A directory that is not a usable Megatron checkpoint (the message says why)."""


def _auto_bridge():
    try:
        from megatron.bridge import AutoBridge
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
    return AutoBridge


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_parallel(
    sizes: ParallelSizes | None = None,
    vpp: int | None = None,
    seed: int = 0,
    timeout: timedelta | None = None,
) -> Iterator[None]:
    """``torch.distributed`` and Megatron-Core's parallel state, set up and torn down.

    The process group is ``process_group``'s (torchrun's, or a group of one rank). A process
    group or parallel state that already exists is used as it is (the sizes given here are
    then ignored) and left alone; what this context created, it destroys on exit.

    Args:
        sizes: tp, pp, ep, etp and cp (default: all 1); Megatron-Core derives dp from the
            world size.
        vpp: virtual pipeline stages per pipeline rank (``None``: off).
        seed: seed of Megatron's model-parallel CUDA RNG tracker (GPU only).
        timeout: how long a collective of the groups this creates waits (None: torch's and
            Megatron-Core's defaults, 10 and 30 minutes).
    """
    try:
        from megatron.core import parallel_state, tensor_parallel
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err

    sizes = sizes or ParallelSizes()
    cuda = torch.cuda.is_available()
    created_state = False
    with process_group(timeout):
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=sizes.tp,
                pipeline_model_parallel_size=sizes.pp,
                virtual_pipeline_model_parallel_size=vpp,
                context_parallel_size=sizes.cp,
                expert_model_parallel_size=sizes.ep,
                expert_tensor_parallel_size=sizes.etp,
                **(
                    {"distributed_timeout_minutes": math.ceil(timeout.total_seconds() / 60)}
                    if timeout
                    else {}
                ),
            )
            created_state = True
            if cuda:
                tensor_parallel.model_parallel_cuda_manual_seed(seed)
        try:
            yield
        finally:
            if created_state:
                parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def process_group(timeout: timedelta | None = None) -> Iterator[None]:
    """``torch.distributed``'s default process group, set up and torn down.

    Under ``torchrun`` (``WORLD_SIZE`` and ``MASTER_ADDR`` set) it comes from the environment;
    otherwise it is a group of one rank on a free local port. NCCL when CUDA is available
    (each rank on ``LOCAL_RANK``'s GPU), gloo otherwise. A group that already exists is used
    as it is and left alone; what this context created, it destroys on exit. ``timeout``: how
    long its collectives wait (None: torch's default, 10 minutes).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if cuda else "gloo"
    waits = {"timeout": timeout} if timeout else {}
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, **waits)
    else:
        address = f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend, init_method=address, world_size=1, rank=0, **waits)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _current_sizes() -> MegatronSizes:
    """The parallel sizes of the Megatron-Core state this process is in (sequence
    parallelism is a model setting, not state: off)."""
    from megatron.core import parallel_state as ps

    sizes = ParallelSizes(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
    )
    return MegatronSizes(sizes, vpp=ps.get_virtual_pipeline_model_parallel_world_size())


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _configure_provider(provider: Any, hf_config: Any, dtype: torch.dtype) -> Any:
    """What this project sets on the bridge's GPT-OSS provider, and why.

    - YaRN: ``GPTOSSBridge.provider_bridge`` hard-codes gpt-oss-20b/120b's values (factor 32,
      original context 4096, β 32/1, no rounding); they are read from the model's own
      ``rope_parameters`` here instead: the same values for the released models, and the
      right ones for a model of another context size (the tiny test model's logits differ
      by ~5e-3 without this).
    - dtype: ``params_dtype``, ``pipeline_dtype`` and the bf16/fp16 flags follow the
      requested dtype (the bridge sets bf16).
    - Transformer Engine, when installed, must take the provider's ``softmax_type`` (GPT-OSS:
      ``learnable``, from TE 2.8.0 on): an older one is refused here, before any model is
      built, with what to install (``core.image_checks``).
    - without Transformer Engine (CPU test envs) the layer spec is Megatron-Core's local one,
      which builds ``SequentialMLP`` experts (the GPT-OSS mapping covers them); the MoE
      permute fusion (only TE implements it) and the masked-softmax fusion are off. The
      latter's kernel is a separately built CUDA extension (``scaled_masked_softmax_cuda``)
      that pip installs lack, and GPT-OSS's attention sinks take the unfused softmax anyway;
      megatron-core only checks for the kernel in bf16/fp16, where it then fails to import.
    """
    from core.image_checks import require_transformer_engine

    require_transformer_engine(getattr(provider, "softmax_type", "vanilla"))
    hf_config = getattr(hf_config, "config", hf_config)  # a bridge's hf_pretrained works too
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    rope = dict(rope or {})
    if rope.get("rope_type") == "yarn":
        for key, field in (
            ("factor", "yarn_rotary_scaling_factor"),
            ("original_max_position_embeddings", "yarn_original_max_position_embeddings"),
            ("beta_fast", "yarn_beta_fast"),
            ("beta_slow", "yarn_beta_slow"),
        ):
            if rope.get(key) is not None:
                setattr(provider, field, rope[key])
        # transformers rounds the correction range to integers unless ``truncate`` is false
        provider.yarn_correction_range_round_to_int = bool(rope.get("truncate", True))
    provider.params_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    if not _have_transformer_engine():
        from megatron.bridge.models.gpt_provider import local_layer_spec

        provider.transformer_layer_spec = local_layer_spec
        provider.moe_grouped_gemm = False
        provider.moe_permute_fusion = False
        provider.masked_softmax_fusion = False
    return provider


def _set_sizes(provider: Any, parallel: MegatronSizes) -> None:
    """The parallel sizes on the provider.

    The MoE token dispatcher is the bridge's all-to-all only when the experts are spread
    over ranks (EP > 1). With EP = 1 there is nothing to exchange, and Megatron-Core's
    default all-gather dispatcher sends the same tokens to the same experts without the
    all-to-all dispatcher's CUDA side stream, so the single-rank path also runs on a CPU.
    """
    sizes = parallel.sizes
    provider.moe_token_dispatcher_type = "alltoall" if sizes.ep > 1 else "allgather"
    provider.tensor_model_parallel_size = sizes.tp
    provider.pipeline_model_parallel_size = sizes.pp
    provider.expert_model_parallel_size = sizes.ep
    provider.expert_tensor_parallel_size = sizes.etp
    provider.context_parallel_size = sizes.cp
    provider.sequence_parallel = parallel.sequence_parallel
    provider.virtual_pipeline_model_parallel_size = parallel.vpp


def _build_model(provider: Any) -> list[Any]:
    """``provide_distributed_model`` without DDP: on the GPU when there is one, else the CPU."""
    provider.finalize()
    return provider.provide_distributed_model(
        wrap_with_ddp=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        mixed_precision_wrapper=None,
    )


def _model_state_dict(model: list[Any]) -> dict[str, Any]:
    """The model part of a Megatron-LM / megatron-bridge checkpoint's state dict."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if len(model) == 1:
        return {"model": model[0].sharded_state_dict(metadata=metadata)}
    return {f"model{i}": m.sharded_state_dict(metadata=metadata) for i, m in enumerate(model)}


def convert_hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, layout: MegatronLayout) -> None:
    """Convert a HF GPT-OSS directory into a Megatron ``torch_dist`` checkpoint at ``out_dir``.

    ``AutoBridge.from_hf_pretrained`` → ``to_megatron_provider`` (its pre-wrap hook loads the
    HF weights, each rank its own shards) with the layout's TP/PP/EP/ETP/CP, sequence
    parallelism and dtype → ``provide_distributed_model`` → ``dist_checkpointing.save``.
    Collective: every rank of the layout's world calls it (one process for a 1-rank layout).
    The checkpoint is written under ``.<name>.converting`` next to ``out_dir`` and renamed
    into place once every rank has saved; a failure leaves nothing at ``out_dir``.

    Args:
        hf_dir: a HF directory of a ``GptOssForCausalLM``.
        out_dir: the checkpoint directory to create; must not exist.
        layout: the Megatron layout to write it in (its sizes, ``vpp``, sequence
            parallelism and ``params_dtype``).

    Raises:
        FileExistsError: ``out_dir`` exists.
    """

    from core.mxfp4 import is_mxfp4, log_dequantization

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: already exists; remove it or choose a new directory")
    dtype = DTYPES[layout.params_dtype]
    if is_mxfp4(hf_dir):  # megatron-bridge reads the packed pairs itself
        log_dequantization(
            hf_dir,
            torch.bfloat16,
            "megatron-bridge (GPTOSSBridge.maybe_modify_loaded_hf_weight), then cast to "
            f"{layout.params_dtype}",
        )
    parallel = MegatronSizes.of(layout)
    with megatron_parallel(parallel.sizes, parallel.vpp):
        bridge = _auto_bridge().from_hf_pretrained(str(hf_dir), torch_dtype=dtype)
        provider = bridge.to_megatron_provider(load_weights=True)
        _configure_provider(provider, bridge.hf_pretrained.config, dtype)
        _set_sizes(provider, parallel)
        model = _build_model(provider)

        save_megatron_model(model, out_dir)
    log.info("converted %s → %s (%s, %s)", hf_dir, out_dir, layout.params_dtype, parallel)


def save_megatron_model(model: list[Any], out_dir: str | Path) -> Path:
    """Save the model chunks (weights only) as a Megatron ``torch_dist`` checkpoint, laid out
    as ``convert_hf_to_megatron`` writes it (``iter_0000000`` + the tracker file), so
    ``export_megatron_to_hf`` and the GRPO backend read it back. Collective; written under
    ``.<name>.converting`` and renamed into place when every rank has saved."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    out_dir = Path(out_dir)
    rank = dist.get_rank()
    tmp = out_dir.with_name(f".{out_dir.name}.converting")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / ITERATION_DIR).mkdir(parents=True)
    dist.barrier()
    try:
        state = {"checkpoint_version": 3.0, "iteration": 0, **_model_state_dict(model)}
        dist_checkpointing.save(state, str(tmp / ITERATION_DIR))
        dist.barrier()
        if rank == 0:
            (tmp / TRACKER_FILE).write_text("0")
            publish_dir(tmp, out_dir)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    return out_dir


def checkpoint_iteration_dir(megatron_dir: str | Path) -> Path:
    """The ``torch_dist`` directory of a checkpoint (via its tracker file, or itself).

    Raises:
        MegatronCheckpointError: no tracker file and no ``torch_dist`` files.
    """
    root = Path(megatron_dir)
    tracker = root / TRACKER_FILE
    if tracker.is_file():
        iteration = tracker.read_text().strip()
        path = root / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")
    else:
        path = root
    if not (path / ".metadata").is_file():
        raise MegatronCheckpointError(
            f"{root}: not a Megatron torch_dist checkpoint ({path / '.metadata'} is missing)"
        )
    return path


def checkpoint_dtype(megatron_dir: str | Path) -> torch.dtype:
    """The dtype a checkpoint was converted in: its word embeddings' (``params_dtype``).

    (Not every tensor has it: Megatron-Core's local, non-TE norms keep fp32 weights.)
    """
    from torch.distributed.checkpoint import FileSystemReader

    path = checkpoint_iteration_dir(megatron_dir)
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    embeddings = metadata.get(EMBEDDING_KEY)
    if embeddings is None or not hasattr(embeddings, "properties"):
        raise MegatronCheckpointError(f"{path}: no {EMBEDDING_KEY} tensor; not a GPT checkpoint")
    return embeddings.properties.dtype


@contextlib.contextmanager
def _loaded_model(
    megatron_dir: str | Path, hf_dir: str | Path, parallel_output: bool = True
) -> Iterator[tuple[Any, list[Any]]]:
    """``(bridge, model)``: the model built from ``hf_dir``'s config, weights from the checkpoint.

    Built in the caller's parallel layout (``megatron_parallel``'s, one rank by default);
    ``dist_checkpointing.load`` reshards the checkpoint to it.
    """
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    path = checkpoint_iteration_dir(megatron_dir)
    dtype = checkpoint_dtype(megatron_dir)
    with megatron_parallel():
        bridge = _auto_bridge().from_hf_config(AutoConfig.from_pretrained(str(hf_dir)))
        provider = bridge.to_megatron_provider(load_weights=False)
        _configure_provider(provider, bridge.hf_pretrained, dtype)
        _set_sizes(provider, _current_sizes())
        provider.perform_initialization = False
        provider.parallel_output = parallel_output
        model = _build_model(provider)
        loaded = dist_checkpointing.load(_model_state_dict(model), str(path), strict="raise_all")
        keys = ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]
        for module, key in zip(model, keys, strict=True):
            missing, unexpected = module.load_state_dict(loaded[key], strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise MegatronCheckpointError(
                    f"{path}: does not fit {hf_dir}'s architecture "
                    f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
                )
        yield bridge, model


def export_megatron_to_hf(
    megatron_dir: str | Path, hf_template_dir: str | Path, out_dir: str | Path
) -> None:
    """Export a Megatron checkpoint to ``out_dir`` as HF ``config.json`` + safetensors.

    The model is rebuilt from ``hf_template_dir``'s config, loaded from the checkpoint, and
    its weights are streamed out by ``AutoBridge.export_hf_weights`` (one HF tensor at a
    time, each gathered across its own TP/EP/PP group, never the whole state dict on one
    rank) in the checkpoint's dtype, into safetensors shards of at most 5 GB written by
    rank 0 (with ``model.safetensors.index.json`` when there are several). The tokenizer is
    not copied (``trainer.export_hf`` does that). Collective under ``torchrun``.
    """
    import torch.distributed as dist
    from transformers import AutoConfig

    from core.mxfp4 import drop_quantization_config

    out_dir = Path(out_dir)
    dtype = checkpoint_dtype(megatron_dir)
    with _loaded_model(megatron_dir, hf_template_dir) as (bridge, model):
        writer = _ShardWriter(out_dir) if dist.get_rank() == 0 else None
        weights = bridge.export_hf_weights(model, cpu=True, show_progress=False, weight_dtype=dtype)
        for name, tensor in weights:
            if writer is not None:
                writer.add(name, tensor)
        if writer is not None:
            count = writer.close()
            config = AutoConfig.from_pretrained(str(hf_template_dir))
            config.dtype = dtype
            drop_quantization_config(config)  # an MXFP4 template: the export is unpacked
            config.save_pretrained(out_dir)
            log.info("exported %s → %s (%d tensors, %s)", megatron_dir, out_dir, count, dtype)
        dist.barrier()


class _ShardWriter:
    """Safetensors shards of at most ``MAX_SHARD_BYTES``, written as tensors arrive."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[str, list[str]]] = []  # (temporary file, tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > MAX_SHARD_BYTES:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp = self.out_dir / f".shard-{len(self.written) + 1:05d}.safetensors"
        save_file(self.pending, str(tmp), metadata={"format": "pt"})
        self.written.append((tmp.name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> int:
        """Name the shards as transformers does; write the index when there are several."""
        if self.pending or not self.written:
            self._flush()
        count = len(self.written)
        weight_map = {}
        for i, (tmp, names) in enumerate(self.written, start=1):
            final = (
                "model.safetensors" if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
            )
            os.replace(self.out_dir / tmp, self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        if count > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": dict(sorted(weight_map.items())),
            }
            fd, tmp_index = tempfile.mkstemp(dir=self.out_dir, suffix=".json")
            with os.fdopen(fd, "w") as fh:
                json.dump(index, fh, indent=2)
            os.replace(tmp_index, self.out_dir / "model.safetensors.index.json")
        return len(weight_map)


def megatron_next_token_logits(
    megatron_dir: str | Path, hf_dir: str | Path, input_ids: list[list[int]]
) -> torch.Tensor:
    """Float32 ``[batch, vocab]`` next-token logits at each sequence's last position.

    The Megatron model is rebuilt from ``hf_dir``'s config and loaded from ``megatron_dir``
    in the caller's layout (one rank by default; PP and CP must be 1 here, TP and EP may be
    larger under ``torchrun``, the logits are then gathered over TP). Each sequence runs
    alone (no padding) with the causal mask and positions ``0..n-1``; the vocabulary is cut
    back to the HF ``vocab_size`` (Megatron may pad it).
    """
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(hf_dir)).vocab_size
    rows = []
    with _loaded_model(megatron_dir, hf_dir, parallel_output=False) as (_, model):
        sizes = _current_sizes().sizes
        if sizes.pp > 1 or sizes.cp > 1:
            raise ValueError(
                f"next-token logits need pp = cp = 1, not pp={sizes.pp}, cp={sizes.cp}"
            )
        module = model[0]
        module.eval()
        device = next(module.parameters()).device
        with torch.no_grad():
            for ids in input_ids:
                tokens = torch.tensor([ids], dtype=torch.long, device=device)
                positions = torch.arange(len(ids), device=device).unsqueeze(0)
                logits = module(tokens, positions, attention_mask=None)
                rows.append(logits[0, -1, :vocab].float().cpu())
    return torch.stack(rows)
