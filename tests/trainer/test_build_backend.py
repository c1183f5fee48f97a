"""``trainer.backends.build``: the backends registry keyed by ``OptimConfig.backend`` and
``build_backend``, which loads the model a step trains and answers what the recipe used to
work out from the backend's name (which module an in-process engine samples with, whether a
forward of it is collective, how the policy is saved). Real torch backend on the tiny model;
DeepSpeed ZeRO-3's answers are checked under torchrun in ``test_zero3.py``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer.backends import BACKENDS, BackendRequest, OptimConfig, build_backend, make_backend
from trainer.distributed import DistInfo

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_the_registry_covers_every_backend_name_of_the_config():
    """The config accepts the names ``plan.TRAINERS`` holds, and each has its builder."""
    from plan.backends import TRAINERS

    assert sorted(BACKENDS) == sorted(TRAINERS)
    for name in TRAINERS:
        assert OptimConfig._a_registered_backend(name) == name


def test_the_torch_backend_trains_the_policy_it_returns(tiny_model_dir, tmp_path):
    optim = OptimConfig(learning_rate=1e-2)
    backend, policy = build_backend(
        BackendRequest(tiny_model_dir, optim, torch.float32, ONE, 4, 2, 1)
    )
    assert policy is backend.unwrapped()
    assert all(p.requires_grad for p in policy.parameters())
    assert not backend.forward_is_collective
    assert backend.reference is None  # no KL: no frozen copy
    backend.save_policy(tmp_path / "policy", tiny_model_dir, torch.float32)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").state_dict()
    for name, value in policy.state_dict().items():
        assert torch.equal(saved[name], value), name


def test_gradient_checkpointing_and_the_reference_are_asked_for(tiny_model_dir):
    request = BackendRequest(
        tiny_model_dir,
        OptimConfig(learning_rate=1e-2),
        torch.float32,
        ONE,
        4,
        2,
        1,
        gradient_checkpointing=True,
        with_reference=True,
    )
    backend, policy = build_backend(request)
    assert policy.is_gradient_checkpointing
    assert backend.reference is not policy
    assert not any(p.requires_grad for p in backend.reference.parameters())


def test_the_torch_backend_refuses_several_processes():
    two = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="backend 'torch' runs one process, but 2"):
        make_backend(torch.nn.Linear(2, 2), OptimConfig(), 1, two, 1, 1)
