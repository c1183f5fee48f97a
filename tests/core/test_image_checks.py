"""The images' stack checks (``core.image_checks``): their logic on this machine. The images
run them in their build step (``python -m core.image_checks gpu|megatron``; nothing builds an
image here) and the Megatron path before it builds a model; the ``gpu`` test runs the GPU
image's check for real where vLLM and CUDA are installed."""

from __future__ import annotations

import types

import pytest
import torch

from core import image_checks
from core.image_checks import (
    ImageCheckError,
    cuda_runtime_problem,
    import_problems,
    loaded_cuda_runtimes,
    transformer_engine_problem,
)


@pytest.mark.parametrize("version", ["2.8.0", "2.8.0+40c69e75", "2.9.0.dev0+abc", "2.10.1", "3.0"])
def test_transformer_engine_with_learnable_sinks_passes(version):
    assert transformer_engine_problem("learnable", version) is None


@pytest.mark.parametrize("version", ["2.7.0", "2.7.0+cu13", "1.13.0", "2.1"])
def test_an_older_transformer_engine_is_refused_with_what_to_do(version):
    problem = transformer_engine_problem("learnable", version)
    assert problem is not None
    assert version in problem and "2.8.0" in problem and "learnable" in problem
    assert "images/Dockerfile.megatron" in problem


def test_no_transformer_engine_or_a_plain_softmax_needs_no_minimum():
    assert transformer_engine_problem("learnable", None) is None  # megatron-core's local path
    assert transformer_engine_problem("vanilla", "1.2.0") is None


def test_the_megatron_provider_is_refused_before_any_model_is_built(monkeypatch):
    from trainer.megatron.bridge import _configure_provider

    # stands in for the installed TE's metadata: no TE can be installed on this machine
    monkeypatch.setattr(image_checks, "transformer_engine_version", lambda: "2.7.0+f0a3c2b")
    provider = types.SimpleNamespace(softmax_type="learnable")
    with pytest.raises(ImageCheckError, match=r"Transformer Engine 2\.7\.0\+f0a3c2b is older"):
        _configure_provider(provider, types.SimpleNamespace(), torch.bfloat16)
    assert vars(provider) == {"softmax_type": "learnable"}  # refused before touching it


def test_the_megatron_image_check_needs_transformer_engine(monkeypatch):
    monkeypatch.setattr(image_checks, "transformer_engine_version", lambda: None)
    assert "not installed" in image_checks.check_megatron_image()[0]
    monkeypatch.setattr(image_checks, "transformer_engine_version", lambda: "2.7.0")
    assert "older than 2.8.0" in image_checks.check_megatron_image()[0]
    monkeypatch.setattr(image_checks, "transformer_engine_version", lambda: "2.8.0")
    assert image_checks.check_megatron_image() == []
    assert image_checks.main(["megatron"]) == 0


def test_a_compiled_module_that_does_not_load_is_named_with_its_reason():
    problems = import_problems(["torch._C", "vllm_not_here._C_stable_libtorch"])
    assert len(problems) == 1
    assert problems[0].startswith("vllm_not_here._C_stable_libtorch: ")
    assert "vllm_not_here" in problems[0].split(": ", 1)[1]


SITE = "/opt/conda/lib/python3.11/site-packages/nvidia"
MAPS = f"""\
7f0000000000-7f0000100000 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000200000-7f0000300000 r-xp 00000000 08:01 2 {SITE}/cuda_runtime/lib/libcudart.so.12
7f0000400000-7f0000500000 r-xp 00000000 08:01 3 {SITE}/cu13/lib/libcudart.so.13.0.96
7f0000500000-7f0000600000 r--p 00100000 08:01 3 {SITE}/cu13/lib/libcudart.so.13.0.96
"""


def test_cuda_runtimes_of_two_majors_are_a_problem_named_by_path():
    runtimes = loaded_cuda_runtimes(MAPS)
    assert sorted(runtimes) == [12, 13]
    problem = cuda_runtime_problem("12.8", runtimes)
    assert problem and "CUDA 12.8" in problem and "libcudart.so.13.0.96" in problem
    assert cuda_runtime_problem("13.0", {13: runtimes[13]}) is None
    assert "CPU build" in cuda_runtime_problem(None, {})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_image_check_passes_where_vllm_runs():
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    assert image_checks.check_gpu_image() == []
