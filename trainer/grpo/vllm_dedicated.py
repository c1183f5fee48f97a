"""A vLLM rollout engine run by a rollout-only process (dedicated, non-hybrid placement).

A torchrun rollout process already has torch.distributed's default group: the whole job.
vLLM's worker, built in this process, would take that group as its world
(``vllm/distributed/parallel_state.py``, ``init_distributed_environment``: when
torch.distributed is initialized it builds its world group from every rank of the job, and
``initialize_model_parallel`` carves its groups out of it, collectives the trainer would have
to join). So the engine runs as vLLM runs by default: its engine core in a process of its own
(V1 multiprocessing), whose workers have a torch.distributed world of their own — one worker
for tensor parallel 1, ``tensor_parallel_size`` workers (vLLM's multiprocess executor) on the
engine's GPUs otherwise. This process is its client: it submits the requests and relays the
policy's weights to the workers through vLLM's weight-transfer API with the host-memory backend
of ``trainer.grpo.vllm_transfer``, one bucket of at most ``bucket_bytes`` at a time.

Under torchrun an engine of tensor parallel ``k`` is ``k`` processes of the placement plan
(``plan.engines[i].ranks``, one per GPU): the first builds the engine over the engine's GPUs
(``CUDA_VISIBLE_DEVICES``), the others only keep their place in the job's collectives
(``trainer.grpo.remote.EngineFollower``).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import timedelta

import torch

from generation.vllm import VLLMGenerator
from trainer.grpo.config import RolloutConfig
from trainer.grpo.remote import _flat, buckets
from trainer.grpo.rollout import (
    VLLM_MISSING,
    VLLMRolloutEngine,
    enable_routed_experts,
    refuse_quantized_reload,
    vllm_engine_kwargs,
)
from trainer.placement import EnginePlacement

log = logging.getLogger(__name__)


class DedicatedVLLMEngine(VLLMRolloutEngine):
    """``VLLMRolloutEngine``'s sampling and scoring, with the engine in processes of its own
    and the weights sent to it (``sync_weights``) over vLLM's weight-transfer API.

    Args:
        model_dir: the SFT model the engine starts from.
        tokenizer: its tokenizer.
        cfg: the rollout settings.
        seed: the run's seed (the engine's is ``seed + engine.index``).
        engine: this engine in the run's placement plan (None: one engine, tensor parallel 1).
        dtype: the policy's dtype, in which the engine samples.
        bucket_bytes: largest weight bucket sent to the workers at once.
        record_routing: the rollouts carry the engine's expert routing (routing replay).
    """

    def __init__(
        self,
        model_dir: str,
        tokenizer,
        cfg: RolloutConfig,
        seed: int = 0,
        engine: EnginePlacement | None = None,
        *,
        dtype: str = "bfloat16",
        bucket_bytes: int = 64 << 20,
        record_routing: bool = False,
    ) -> None:
        try:
            from vllm import LLM
            from vllm.config import WeightTransferConfig
            from vllm.platforms import current_platform

            from trainer.grpo import vllm_transfer
        except ImportError as exc:
            raise ImportError(VLLM_MISSING) from exc
        # the engine core in a process of its own, with a torch.distributed world of its own
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        if engine is not None and current_platform.is_cuda_alike():
            os.environ["CUDA_VISIBLE_DEVICES"] = engine.cuda_visible_devices
        self.cfg = cfg
        self.sampling = cfg.sampling
        self.sleep_mode = self.asleep = False  # dedicated engines own their devices
        self.bucket_bytes = bucket_bytes
        if record_routing:
            enable_routed_experts(current_platform.is_cpu())
        # world_size 1: vLLM starts the engine's workers itself (no external launcher)
        kwargs = vllm_engine_kwargs(
            model_dir,
            cfg,
            engine,
            1,
            seed,
            dtype,
            cpu=current_platform.is_cpu(),
            record_routing=record_routing,
        )
        self.workers = int(kwargs["tensor_parallel_size"])
        kwargs["weight_transfer_config"] = WeightTransferConfig(backend=vllm_transfer.BACKEND)
        kwargs["worker_extension_cls"] = vllm_transfer.WORKER_EXTENSION
        VLLMGenerator.__init__(self, LLM(**kwargs), model_dir, tokenizer)
        self.group = self._connect()

    def _connect(self):
        """The gloo group of this process (rank 0) and the engine's workers; they join it in
        ``init_weight_transfer_engine``, which returns once they have.

        This process binds the group's store itself: under torchrun
        (``TORCHELASTIC_USE_AGENT_STORE=True``) torch's tcp:// rendezvous makes every rank a
        client of a store it expects torchrun's agent to host, and nobody would host this one.
        """
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        host, size = "127.0.0.1", 1 + self.workers
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen()
        port = listener.getsockname()[1]
        info = {
            "master_address": host,
            "master_port": port,
            "world_size": size,
            "client_pid": os.getpid(),
        }
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(self.llm.init_weight_transfer_engine, {"init_info": info})
            group = stateless_init_torch_distributed_process_group(
                host, port, 0, size, "gloo", listen_socket=listener
            )
            joined.result()
        return group

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Send the policy's weights to the workers in buckets; they load them with vLLM's
        layerwise reload (``trainer.grpo.vllm_transfer``). Returns the bytes sent (each
        worker counted: every one receives the whole bucket, its loaders keep its shard)."""
        refuse_quantized_reload(self.quantization, self.model_dir)
        self.llm.start_weight_update()
        count = sent = 0
        with ThreadPoolExecutor(max_workers=1) as pool:
            for bucket in buckets(named_tensors, self.bucket_bytes):
                sent += self._send(pool, bucket) * self.workers
                count += len(bucket)
        self.llm.finish_weight_update()
        self.llm.reset_prefix_cache()
        log.debug("sent %d tensors to the vLLM engine", count)
        return sent

    def _send(self, pool: ThreadPoolExecutor, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """One bucket: the workers' ``update_weights`` (which waits for the bytes) on a side
        thread, the bytes broadcast from here; an error of the workers raises here rather than
        leave this process waiting on a broadcast they will not join. Returns its bytes."""
        spec, flat = _flat(bucket, torch.device("cpu"))
        info = {
            "names": [name for name, _, _ in spec],
            "dtype_names": [str(dtype).removeprefix("torch.") for _, dtype, _ in spec],
            "shapes": [list(shape) for _, _, shape in spec],
        }
        loaded = pool.submit(self.llm.update_weights, {"update_info": info})
        sent = self.group.broadcast(flat, 0)
        while not (sent.is_completed() or loaded.done()):
            wait([loaded], timeout=0.05)
        try:
            if loaded.done():
                loaded.result()  # the workers' error, if they failed before the broadcast
            sent.wait(timedelta(minutes=5))
            loaded.result()
        except Exception as exc:
            raise RuntimeError(
                f"the vLLM engine failed to load the weight bucket of {info['names'][0]!r} "
                f"and {len(bucket) - 1} more tensors: {exc}"
            ) from exc
        return flat.numel()

    def close(self) -> None:
        """Stop the engine's processes (``serve`` calls it when the run ends)."""
        self.group = None
        self.llm.llm_engine.engine_core.shutdown()
