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
    # the image's own compiled op cannot be built here (no nvcc): torch stands in for it
    monkeypatch.setattr(image_checks, "MEGATRON_COMPILED_OPS", ("torch",))
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


def test_the_megatron_image_check_names_fast_hadamard_transform_when_it_does_not_import(
    monkeypatch,
):
    monkeypatch.setattr(image_checks, "transformer_engine_version", lambda: "2.8.0")
    problems = image_checks.check_megatron_image()
    assert len(problems) == 1 and problems[0].startswith("fast_hadamard_transform: ")


# --- the node's driver (issue #39: vllm 0.33's _C needs libcudart.so.13, driver R580+) ----
PROC_550 = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
)
PROC_580_OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 07:09:59 UTC 2025\n"
)


@pytest.mark.parametrize(
    ("text", "version"), [(PROC_550, "550.54.15"), (PROC_580_OPEN, "580.65.06"), ("", None)]
)
def test_the_driver_version_is_read_from_the_kernel_modules_line(tmp_path, text, version):
    path = tmp_path / "version"
    path.write_text(text)
    assert image_checks._proc_driver_version(path) == version
    assert image_checks._proc_driver_version(tmp_path / "absent") is None


def test_the_first_source_that_answers_gives_the_driver():
    sources = (("proc", lambda: None), ("nvidia-smi", lambda: "575.51.03"), ("NVML", lambda: 1))
    assert image_checks.nvidia_driver_version(sources) == ("575.51.03", "nvidia-smi")
    assert image_checks.nvidia_driver_version((("proc", lambda: None),)) is None


def test_nvidia_smi_and_nvml_answer_none_where_there_is_no_driver(monkeypatch):
    monkeypatch.setattr(image_checks.shutil, "which", lambda name: None)
    assert image_checks._nvidia_smi_driver_version() is None

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(image_checks.ctypes, "CDLL", no_library)
    assert image_checks._nvml_driver_version() is None


def test_an_old_driver_is_refused_in_one_line_naming_it_r580_and_libcudart_13():
    problem = image_checks.driver_problem(("550.54.15", "/proc/driver/nvidia/version"), 580)
    assert problem is not None and "\n" not in problem
    assert "550.54.15" in problem and "/proc/driver/nvidia/version" in problem
    assert "R580" in problem and "libcudart.so.13" in problem
    assert image_checks.driver_problem(("580.65.06", "NVML"), 580) is None
    assert image_checks.driver_problem(("595.1", "NVML"), 580) is None
    assert image_checks.driver_problem(None, 580) is None  # no driver: a CPU node
    assert "not a version" in image_checks.driver_problem(("N/A", "nvidia-smi"), 580)
    assert "R525" in image_checks.driver_problem(("470.2", "nvidia-smi"), 525)


def test_only_an_image_that_names_its_minimum_driver_checks_it():
    old = lambda: ("550.54.15", "nvidia-smi")  # noqa: E731
    image_checks.require_supported_driver({}, old)  # the CPU and Megatron images
    with pytest.raises(ImageCheckError, match=r"NVIDIA driver 550\.54\.15 .* older than R580"):
        image_checks.require_supported_driver({image_checks.MIN_DRIVER_ENV: "580"}, old)
    image_checks.require_supported_driver(
        {image_checks.MIN_DRIVER_ENV: "580"}, lambda: ("580.82.07", "NVML")
    )
    with pytest.raises(ImageCheckError, match="expected a driver branch"):
        image_checks.require_supported_driver({image_checks.MIN_DRIVER_ENV: "r580"}, old)


def test_a_step_in_the_gpu_image_on_an_old_driver_stops_at_its_start(monkeypatch, caplog):
    """``start_step_process`` (every pipeline step's first call) and a training rank's
    ``step_main``: one ``error:`` line, before any work."""
    from core.processes import start_step_process
    from trainer.entry import step_main

    monkeypatch.setenv(image_checks.MIN_DRIVER_ENV, "580")
    monkeypatch.setattr(image_checks, "nvidia_driver_version", lambda: ("550.54.15", "nvidia-smi"))
    monkeypatch.setattr("core.processes.die_with_parent", lambda *a: None)
    monkeypatch.setattr("trainer.entry.die_with_parent", lambda *a: None)
    with pytest.raises(SystemExit, match=r"^error: NVIDIA driver 550\.54\.15") as stopped:
        start_step_process()
    assert "libcudart.so.13" in str(stopped.value.code)
    ran = []
    argv = ["--config", "c.json", "--model", "m", "--train", "t", "--model-output", "o",
            "--work-dir", "w"]  # fmt: skip
    with pytest.raises(SystemExit, match=r"^error: NVIDIA driver 550\.54\.15"):
        step_main("trainer.sft", type(None), lambda *a: ran.append(a), "model", False, argv)
    assert ran == []
