"""LoRA GRPO (``grpo.lora``, issue #42): the adapter trains on the frozen base, each weight sync
moves only the adapter's tensors into an engine serving base + adapter, and the export is the
adapter merged into the SFT model (SFT's checked merge)."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from tests_helpers_trainer import (
    grpo_cli_args,
    grpo_step_lines,
    recipe_paths,
    small_grpo_config,
    subprocess_env,
)
from transformers import AutoModelForCausalLM

from cluster.torchrun import torchrun_command
from core.modeling import load_tokenizer
from trainer.backends import build_backend
from trainer.distributed import DistInfo
from trainer.grpo import engines
from trainer.grpo.config import GRPOConfig
from trainer.grpo.micro_batch import Micro
from trainer.grpo.recipe import run_grpo
from trainer.grpo.sync_check import SyncCheck, sync_probe
from trainer.grpo.update import backend_request
from trainer.grpo.weight_sync import sync_engine
from trainer.metrics import read_metrics
from trainer.placement import run_placement
from trainer.sft.merge import MERGE_REPORT

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
LORA = {"r": 4, "alpha": 8}
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj")
BENCH = Path(__file__).resolve().parents[2] / "bench" / "lora_sync_bytes.py"


def _tiny_lora_run(**overrides) -> dict:
    """One short LoRA GRPO run: an lr that moves the adapter, the last policy exported."""
    return small_grpo_config(
        **{
            "max_steps": 2,
            "checkpoint_every": 0,
            "lora": LORA,
            "guard": {"keep_best": False},
            "optim": {"learning_rate": 1e-2, "lr_scheduler": "constant"},
            **overrides,
        }
    )


def _grpo_job(tmp_path: Path, name: str, cfg: dict, model: Path, data: Path, nproc: int):
    """``trainer.grpo`` under torchrun with ``nproc`` processes, as a job runs it: its step
    lines (the job's output tail when it fails)."""
    args = grpo_cli_args(tmp_path, name, cfg, model, data)
    job = subprocess.run(
        torchrun_command("trainer.grpo", args, nproc),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    return grpo_step_lines(tmp_path, name)


def _assert_merged_export(model_dir: Path, base_dir: Path) -> None:
    """The export loads as a plain HF model; only the adapted modules moved from the base,
    and the merge check passed (float32: within its tolerance)."""
    base = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(merged) == set(base)
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(any(m in k for m in ADAPTED) for k in changed), changed
    report = json.loads((model_dir / MERGE_REPORT).read_text())
    assert report["merged_adapter"] and report["max_abs_diff_after_reload"] <= 1e-4


def test_lora_is_refused_where_it_does_not_run_yet():
    with pytest.raises(ValidationError, match="vLLM rollout engine does not serve the adapter"):
        GRPOConfig.model_validate({"lora": LORA, "rollout": {"engine": "vllm"}})
    megatron = {"backend": "megatron", "megatron": {"layout": "tiny-cpu"}}
    with pytest.raises(ValidationError, match="Megatron backend does not train"):
        GRPOConfig.model_validate({"lora": LORA, "optim": megatron})
    assert GRPOConfig().lora.r == 0  # full-parameter GRPO stays the default


def test_lora_grpo_on_torch_trains_the_adapter_alone_and_exports_the_checked_merge(
    tmp_path, tiny_model_dir, prepared_data
):
    cfg = GRPOConfig.model_validate(_tiny_lora_run())
    result = run_grpo(cfg, *recipe_paths(tiny_model_dir, prepared_data, tmp_path))
    assert [m["step"] for m in read_metrics(result.metrics_file) if "loss" in m] == [1, 2]
    final = tmp_path / "work" / "final_policy"  # the policy snapshot is the adapter alone
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    assert any(t.abs().sum() > 0 for n, t in adapter.items() if "lora_B" in n)  # it trained
    _assert_merged_export(Path(result.model_dir), tiny_model_dir)


@pytest.fixture
def lora_policy_and_engine(tiny_model_dir):
    """A LoRA policy built as the GRPO step builds it and a dedicated HF engine built as a
    rollout-only process builds it, with the probe the sync is checked on."""
    cfg = GRPOConfig.model_validate(small_grpo_config(lora=LORA))
    tokenizer = load_tokenizer(tiny_model_dir)
    request = backend_request(cfg, tiny_model_dir, torch.float32, ONE, tokenizer.pad_token_id)
    backend, policy = build_backend(request)
    site = engines.EngineSite(cfg, tiny_model_dir, tokenizer, run_placement(cfg, ONE), ONE)
    engine = engines.engine_builders("hf").rollout_only(site)
    probe = sync_probe([tokenizer("Why is the sky blue at noon?")["input_ids"]], 16)
    return backend, policy, engine, probe, tokenizer.pad_token_id


def test_each_sync_moves_only_the_adapter_into_an_engine_serving_base_plus_adapter(
    lora_policy_and_engine,
):
    backend, policy, engine, probe, pad = lora_policy_and_engine
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # the base is frozen
    frozen = {n: p.clone() for n, p in policy.named_parameters() if not p.requires_grad}
    check = SyncCheck(torch.float32)
    sync_engine(engine, backend, probe, check, pad, ONE, 0, adapter_only=True)
    with torch.no_grad():  # an update: the optimizer moves the adapter alone
        for param in trainable.values():
            param.add_(torch.randn_like(param) * 0.5)
    report = sync_engine(engine, backend, probe, check, pad, ONE, 1, adapter_only=True)
    assert report.bytes == sum(p.numel() * 4 for p in trainable.values())
    served = dict(engine.model.named_parameters())
    assert all(torch.equal(served[n], p) for n, p in trainable.items())
    assert all(torch.equal(served[n], p) for n, p in frozen.items())  # base untouched
    assert report.gap.max < 1e-5  # the engine's log-probs are the policy's
    whole = sum(p.numel() * 4 for p in policy.parameters())
    assert report.bytes < 0.05 * whole


def test_an_engine_left_without_the_adapter_fails_the_sync_check(lora_policy_and_engine):
    """The check sees a sync that skipped the adapter (the engine kept ``B = 0``)."""
    from trainer.grpo.sync_check import WeightSyncError

    backend, policy, engine, probe, pad = lora_policy_and_engine
    check = SyncCheck(torch.float32)
    sync_engine(engine, backend, probe, check, pad, ONE, 0, adapter_only=True)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.5)
    engine.sync_weights = lambda named: sum(0 for _ in named)  # receives, loads nothing
    with pytest.raises(WeightSyncError, match="step 1"):
        sync_engine(engine, backend, probe, check, pad, ONE, 1, adapter_only=True)


@pytest.mark.slow  # the fast test above covers the same sync; this runs the bench itself
def test_the_bench_measures_lora_sync_bytes_under_five_percent_of_full():
    """``bench/lora_sync_bytes.py`` on the tiny demo model (docs/benchmarks.md's figures)."""
    out = subprocess.run(
        [sys.executable, str(BENCH)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout.splitlines()
    full, lora = (json.loads(line) for line in out if line.startswith("{"))  # its JSON rows
    assert full["sync_bytes"] == 4 * full["model_parameters"]
    assert lora["sync_bytes"] == 4 * lora["trainable_parameters"]
    assert lora["sync_bytes"] <= 0.05 * full["sync_bytes"]
    assert full["sync_logprob_max_diff"] < 1e-5 and lora["sync_logprob_max_diff"] < 1e-5


@pytest.mark.slow
def test_lora_grpo_on_deepspeed_zero3_with_a_dedicated_hf_engine(
    tmp_path, tiny_model_dir, prepared_data
):
    """Two DeepSpeed ZeRO-3 trainers and one dedicated HF engine (3 processes): each sync
    carries the adapter alone over the engines' channel, the engine serves base + adapter
    (its log-probs equal the policy's), the adapter is saved gathered and the export merged."""
    pytest.importorskip("deepspeed")
    cfg = _tiny_lora_run(
        nproc=2,
        micro_batch_size=4,
        rollout={"n_samples": 4, "max_new_tokens": 16, "colocate": False, "num_engines": 1},
        optim={"learning_rate": 1e-2, "lr_scheduler": "constant", "backend": "deepspeed"}
        | {"zero_stage": 3},
    )
    steps = _grpo_job(tmp_path, "ds", cfg, tiny_model_dir, prepared_data, 3)
    assert [m["step"] for m in steps] == [1, 2]
    adapter = load_file(tmp_path / "ds" / "work" / "final_policy" / "adapter_model.safetensors")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    assert all(m["sync_bytes"] == adapter_bytes for m in steps)
    assert all(m["sync_logprob_max_diff"] < 1e-5 for m in steps)
    _assert_merged_export(tmp_path / "ds" / "model", tiny_model_dir)


def _one_response(tokenizer) -> Micro:
    """One prompt + response row laid out as the update lays it out (no padding)."""
    ids = torch.tensor([tokenizer("Why is the sky blue at noon? Because of air.")["input_ids"]])
    width = ids.shape[1] - 4
    return Micro(
        ids=ids,
        attention=torch.ones_like(ids),
        positions=torch.arange(ids.shape[1])[None],
        mask=torch.ones(1, width),
    )


def test_the_lora_kl_reference_is_the_frozen_base_with_the_adapter_off(tiny_model_dir):
    """With KL on, LoRA GRPO keeps no second model (the 20b's would be 39 GiB a GPU): the
    reference log-probs are the base's with the adapter (experts too) switched off, equal to
    the SFT model's before and after the adapter moves, while the policy's move with it."""
    cfg = GRPOConfig.model_validate(
        small_grpo_config(lora=LORA | {"experts": True}, algorithm={"kl_loss_coef": 0.01})
    )
    tokenizer = load_tokenizer(tiny_model_dir)
    request = backend_request(cfg, tiny_model_dir, torch.float32, ONE, tokenizer.pad_token_id)
    assert request.with_reference
    backend, policy = build_backend(request)
    assert backend.reference is None  # no copy of the base
    micro = _one_response(tokenizer)
    sft = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = micro.hf_log_probs(sft, False)[0]
    before = backend.log_probs([micro], reference=True)[0]
    torch.testing.assert_close(before, expected, rtol=0, atol=1e-6)
    with torch.no_grad():  # an update: the optimizer moves the adapter alone
        for param in (p for p in policy.parameters() if p.requires_grad):
            param.add_(torch.randn_like(param) * 0.5)
    moved = backend.log_probs([micro])[0]
    assert (moved - expected).abs().max() > 1e-2  # the policy moved (adapter on again)
    after = backend.log_probs([micro], reference=True)[0]
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_lora_grpo_on_deepspeed_zero2_with_kl_and_colocated_hf_engines(
    tmp_path, tiny_model_dir, prepared_data
):
    """gpt-oss-20b-lora's shape on the tiny model: two DeepSpeed ZeRO-2 trainers, each
    sampling with the HF engine on the module it trains, KL on against the base with the
    adapter off (no reference copy): it trains, the KL starts at zero and grows."""
    pytest.importorskip("deepspeed")
    cfg = _tiny_lora_run(
        nproc=2,
        micro_batch_size=4,
        rollout={"n_samples": 4, "max_new_tokens": 16},
        algorithm={"kl_loss_coef": 0.01},
        optim={"learning_rate": 1e-2, "lr_scheduler": "constant", "backend": "deepspeed"}
        | {"zero_stage": 2},
    )
    steps = _grpo_job(tmp_path, "ds2", cfg, tiny_model_dir, prepared_data, 2)
    assert [m["step"] for m in steps] == [1, 2]
    assert abs(steps[0]["kl"]) < 1e-6 < steps[1]["kl"]  # the policy starts as the base
    _assert_merged_export(tmp_path / "ds2" / "model", tiny_model_dir)


def test_sampling_with_lora_on_the_experts_builds_their_delta_once_and_samples_the_same(
    tiny_model_dir, monkeypatch
):
    """``lora_parameters_fixed`` (the HF engine's ``generate``): the experts' base + delta is
    built once a call instead of at every forward (peft's ``ParamWrapper``), and the rollouts
    are the same tokens and log-probs, bit for bit; afterwards nothing of it is left."""
    from peft.tuners.lora.layer import ParamWrapper

    from trainer.grpo.config import RolloutConfig
    from trainer.grpo.rollout import HFRolloutEngine
    from trainer.sft.config import LoraSettings
    from trainer.sft.lora import apply_lora

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = apply_lora(base, LoraSettings(r=4, alpha=8, experts=True))
    with torch.no_grad():  # an adapter that moves the experts (B starts at 0)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.1)
    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    assert wrappers  # gate_up_proj and down_proj of every layer
    built = []  # each activation registers the parametrization and builds the delta
    activate = ParamWrapper._activate_lora
    monkeypatch.setattr(
        ParamWrapper, "_activate_lora", lambda self, a: built.append(1) or activate(self, a)
    )
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = HFRolloutEngine(model, tokenizer, RolloutConfig(n_samples=2, max_new_tokens=12))
    prompts = [tokenizer("Combien de jours ?")["input_ids"], tokenizer("Wie viele?")["input_ids"]]
    seeds = [[1, 2], [3, 4]]

    fixed = engine.generate(prompts, seeds)
    once = len(built)
    with monkeypatch.context() as per_forward:  # peft's own path: a delta every forward
        per_forward.setattr(
            "trainer.grpo.rollout.lora_parameters_fixed", lambda model: nullcontext()
        )
        built.clear()
        theirs = engine.generate(prompts, seeds)
    assert once <= len(wrappers) < len(built)  # once a wrapper, against once a forward
    assert [r.response_ids for r in fixed] == [r.response_ids for r in theirs]
    assert all(
        torch.equal(torch.as_tensor(a.log_probs), torch.as_tensor(b.log_probs))
        for a, b in zip(fixed, theirs, strict=True)
    )
    assert all("_activate_lora" not in vars(w) for w in wrappers)  # the class's again
    experts = {w.get_base_layer() for w in wrappers}
    assert not any(getattr(e, "parametrizations", None) for e in experts)  # none left
