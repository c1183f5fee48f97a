"""The ``nccl`` weight transport on GPUs (trainer/grpo/weight_transfer.py, vllm_transfer.py):
a dedicated vLLM engine on GPU 1, this process sending from GPU 0 over vLLM's NCCL group
(``nccl_common``: a ``StatelessProcessGroup`` store, a ``PyNcclCommunicator``), the workers
loading with the GPT-OSS reload rules. Needs two GPUs (NCCL refuses two ranks of one
communicator on one GPU); not run on CPU."""

from __future__ import annotations

import pytest
import torch

from trainer.grpo.config import RolloutConfig
from trainer.placement import Device, EnginePlacement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs (the sender and the engine on GPUs of their own)",
    ),
]


@pytest.fixture(scope="module")
def engine(vllm_model_dir, policy, rollout_settings):
    from trainer.grpo.vllm_dedicated import DedicatedVLLMEngine

    torch.cuda.set_device(0)  # CUDA is up in this process before the engine narrows its GPUs
    _, tokenizer = policy
    placement = EnginePlacement(0, (1,), (Device(node=0, local_gpu=1),))
    engine = DedicatedVLLMEngine(
        str(vllm_model_dir),
        tokenizer,
        RolloutConfig(**rollout_settings),
        engine=placement,
        dtype="float32",
        bucket_bytes=16 << 10,
    )
    yield engine
    engine.close()


def test_the_weights_go_gpu_to_gpu_and_take(engine, policy, gap, perturb):
    model, _ = policy
    assert engine.transport == "nccl"
    assert gap(engine) < 1e-3
    perturb(model)
    assert gap(engine) > 0.05
    sent = engine.sync_weights((n, p.detach().cuda()) for n, p in model.named_parameters())
    assert gap(engine) < 1e-3
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sent == model_bytes  # one worker, every byte once
    assert engine.worker_bytes_received() == [model_bytes]
    assert engine.sender.stats.collectives_per_bucket == 1.0
