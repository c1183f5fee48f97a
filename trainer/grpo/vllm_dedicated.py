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
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import timedelta

import torch

from generation.vllm import VLLMGenerator
from trainer.grpo.config import RolloutConfig
from trainer.grpo.remote import buckets, flatten_bucket
from trainer.grpo.vllm_rollout import (
    VLLM_MISSING,
    VLLMRolloutEngine,
    enable_routed_experts,
    refuse_quantized_reload,
    vllm_engine_kwargs,
)
from trainer.grpo.weight_transfer import GlooSender, TransferChoice, open_sender, pipelined
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
        self.transport = "gloo" if current_platform.is_cpu() else "nccl"
        self.sender: GlooSender | None = None
        """This process's end of the group when it sends the weights itself (``sync_weights``);
        None when the trainer does (``join_transfer``, ``receive_weights``)."""
        self.joined = False

    def join_transfer(self, init_info: dict) -> None:
        """Have the engine's workers join the trainer's transfer group (``trainer.grpo.
        weight_transfer``: the trainer rank 0, these workers from ``init_info['rank_offset']``);
        returns once they have, which is once the trainer has joined too."""
        if self.joined:
            raise RuntimeError("the vLLM engine's workers already joined a weight-transfer group")
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        self.joined = True

    def receive_weights(self, messages) -> int:
        """One sync sent by the trainer itself: per bucket, its names, dtypes and shapes come
        on ``messages`` (a ``Channel``: ``(BUCKET, spec, size)``, then ``(END,)``) and this
        process asks the workers to take it (``update_weights``), which they do from the
        trainer's broadcast; no weight byte passes through this process. Returns 0 (the
        bytes this process received)."""
        from trainer.grpo.remote import END

        ended = False
        try:
            refuse_quantized_reload(self.quantization, self.model_dir)
            self.llm.start_weight_update()
            while True:
                message = messages.broadcast_object()
                if message[0] == END:
                    ended = True
                    break
                _, spec, _ = message
                self.llm.update_weights({"update_info": _update_info(spec)})
            self.llm.finish_weight_update()
        except Exception:
            while not ended:  # read the rest of the headers, to stay in step with the trainer
                ended = messages.broadcast_object()[0] == END
            raise
        self.llm.reset_prefix_cache()
        return 0

    def worker_bytes_received(self) -> list[int]:
        """Weight bytes each of the engine's workers has received, worker order."""
        return [int(n) for n in self.llm.collective_rpc("weight_bytes_received")]

    def _connect(self) -> GlooSender:
        """This process as the sender (rank 0) of a group with the engine's workers."""
        host = "127.0.0.1"
        sender = open_sender(
            TransferChoice("lingo_gloo" if self.transport == "gloo" else "nccl", True, "client"),
            host,
            1 + self.workers,
            timedelta(minutes=5),
        )
        info = {
            "master_address": host,
            "master_port": sender.port,
            "world_size": 1 + self.workers,
            "client_pid": os.getpid(),
            "transport": self.transport,
        }
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(self.join_transfer, info)
            sender.connect()
            joined.result()
        return sender

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Send the policy's weights to the workers from this process, in buckets (the next
        drawn while one is on the wire); they load them with vLLM's layerwise reload
        (``trainer.grpo.vllm_transfer``). Returns the bytes sent (each worker counted: every
        one receives the whole bucket, its loaders keep its shard)."""
        refuse_quantized_reload(self.quantization, self.model_dir)
        if self.sender is None:
            self.sender = self._connect()
        self.llm.start_weight_update()
        count = sent = 0
        with ThreadPoolExecutor(max_workers=2) as pool:
            for bucket in pipelined(buckets(named_tensors, self.bucket_bytes)):
                sent += self._send(pool, bucket) * self.workers
                count += len(bucket)
        self.llm.finish_weight_update()
        self.llm.reset_prefix_cache()
        log.debug("sent %d tensors to the vLLM engine", count)
        return sent

    def _send(self, pool: ThreadPoolExecutor, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """One bucket: the workers' ``update_weights`` (which waits for the bytes) and the
        broadcast on side threads; an error of the workers raises here rather than leave this
        process waiting on a broadcast they will not join. Returns its bytes."""
        spec, flat = flatten_bucket(bucket, torch.device("cpu"))
        info = _update_info(spec)
        loaded = pool.submit(self.llm.update_weights, {"update_info": info})
        sent = pool.submit(self.sender.send, flat)
        wait([loaded, sent], return_when=FIRST_EXCEPTION, timeout=300)
        try:
            if loaded.done():
                loaded.result()  # the workers' error, if they failed before the broadcast
            sent.result(timeout=300)
            loaded.result()
        except Exception as exc:
            raise RuntimeError(
                f"the vLLM engine failed to load the weight bucket of {info['names'][0]!r} "
                f"and {len(bucket) - 1} more tensors: {exc}"
            ) from exc
        return flat.numel()

    def close(self) -> None:
        """Stop the engine's processes (``serve`` calls it when the run ends)."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self.llm.llm_engine.engine_core.shutdown()


def _update_info(spec: list) -> dict:
    """A bucket's ``update_weights`` payload: its tensors' names, dtypes and shapes."""
    return {
        "names": [name for name, _, _ in spec],
        "dtype_names": [str(dtype).removeprefix("torch.") for _, dtype, _ in spec],
        "shapes": [list(shape) for _, _, shape in spec],
    }
