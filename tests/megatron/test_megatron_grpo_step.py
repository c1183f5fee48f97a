"""GRPO updates through the Megatron training backend, with real megatron-core / megatron-bridge.

The tiny GPT-OSS model is converted to a ``torch_dist`` checkpoint, the backend builds the
actor (DDP) and the reference from it (``trainer.megatron.backend``), and the checks are:

- the response log-probs that come out of Megatron's pipeline schedule (rows left-aligned,
  vocabulary-parallel log-softmax, back to the loop's right-aligned layout) equal a plain
  log-softmax of the same Megatron model run on each row alone;
- the gradients ``forward_backward`` leaves (after the schedule's 1/micro-batches and DDP's
  1/data-parallel) equal those of a plain backward of the summed losses, row by row;
- against the Hugging Face model the log-probs differ by no more than the conversion's own
  logit difference allows (log-softmax moves by at most twice the largest logit change);
- one GRPO step (``update.policy_update``: old and reference log-probs, two PPO epochs, KL,
  entropy), a checkpoint through ``trainer.checkpoint``, and a resumed backend that repeats
  the next step with the same statistics and weights;
- the streamed HF weights carry exactly the HF parameter names, and ``save_hf_pretrained``
  writes a directory ``transformers`` loads with those weights.

On a CPU this runs with ``cpu_patches`` (the harness's, for conversion and inference) plus
``training_cpu_patches`` below (what training adds: DDP, schedule, optimizer); on a GPU it runs
unpatched (``pytest -m gpu``). Needs Python >= 3.12 with megatron-core / megatron-bridge
(``bash tools/run_megatron_tests.sh``); elsewhere it skips, saying why.
"""

from __future__ import annotations

import contextlib
import functools
import types
from pathlib import Path

import pytest
import torch
from tests_helpers_trainer import fixed_grpo_batch

from trainer.backends import lr_factor, make_backend
from trainer.distributed import DistInfo
from trainer.grpo.config import GRPOConfig
from trainer.megatron.layout import MegatronLayout

# --- what training needs on a CPU, beyond cpu_patches ------------------------------------


class _NoStream:
    """A CUDA stream stand-in whose waits are no-ops (patch 7)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _torch_with_cpu_factories() -> types.SimpleNamespace:
    """``torch`` for one module, whose tensor factories put ``device="cuda"`` on the CPU."""

    def on_cpu(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    class TorchOnCpu(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    proxy = TorchOnCpu("torch")
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(proxy, name, on_cpu(getattr(torch, name)))
    return proxy


@contextlib.contextmanager
def training_cpu_patches():
    """Patches 7-10 (CUDA is absent), undone on exit. Like ``cpu_patches``'s, each names the
    call it replaces and why no number the test compares can change.
    """
    if torch.cuda.is_available():
        raise RuntimeError("training_cpu_patches() is for machines without CUDA")
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.utils as core_utils
    from megatron.core.tensor_parallel import mappings

    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    # Patch 7: ddp_init_stream_is_noop.
    # Call: megatron/training/models/dist_utils.py `_ddp_wrap`: `torch.cuda.Stream()`,
    # `.wait_stream(torch.cuda.current_stream())` and `with torch.cuda.stream(...)` around
    # building DistributedDataParallel (an initialization stream for CUDA graphs).
    # Why safe: it only orders CUDA work; without CUDA there is none, DDP is built the same.
    patch(torch.cuda, "Stream", _NoStream)
    patch(torch.cuda, "current_stream", lambda device=None: _NoStream())
    patch(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    # Patch 8: cuda_scalars_on_cpu.
    # Call: `torch.zeros/tensor(..., device="cuda")` for bookkeeping scalars:
    # schedules.py:749 `total_num_tokens` (forward_backward_no_pipelining); optimizer.py:1249
    # FP32Optimizer `_scale`, :690-702 found_inf / overflow buffer / scale one;
    # clip_grads.py:96-112,180 the grad-norm accumulators and overflow buffers;
    # utils.py:1332 `local_multi_tensor_l2_norm` (the grad norm without apex/TE);
    # distrib_optimizer.py the buffers it allocates on the current device.
    # Patch: those five modules see a `torch` whose factories put "cuda" on the CPU.
    # Why safe: the same values, allocated where the model is.
    for module in (schedules, optimizer, clip_grads, distrib_optimizer, core_utils):
        patch(module, "torch", _torch_with_cpu_factories())

    # Patch 9: reduce_returns_a_new_tensor.
    # Call: tensor_parallel/mappings.py:28 `_reduce` returns its input unchanged when the
    # group has one rank, so `_ReduceFromModelParallelRegion` (RowParallelLinear's output)
    # hands autograd its own input; transformer/mlp.py:354 then adds the expert bias in
    # place (`output += output_bias ...`, Megatron-Core's local SequentialMLP experts, the
    # spec used without Transformer Engine) and autograd refuses in-place ops on such a
    # view in training. With TE (the GPU path) experts are TEGroupedMLP and this line is
    # not reached. Patch: a one-rank `_reduce` returns a copy.
    # Why safe: the copy has the same values; the backward of the region is the identity.
    reduce = mappings._reduce

    def reduce_to_new_tensor(input_, group):
        out = reduce(input_, group)
        return out.clone() if out is input_ else out

    patch(mappings, "_reduce", reduce_to_new_tensor)

    # Patch 10: clip_grads_on_cpu.
    # Call: optimizer/clip_grads.py:174 `clip_grad_by_total_norm_fp32` asserts
    # `param.grad.type() == 'torch.cuda.FloatTensor'`, then scales the grads in place with
    # `multi_tensor_applier(multi_tensor_scale_impl, ..., clip_coeff)` when clip_coeff < 1.
    # Patch: the same scaling, `grad.mul_(max_norm / (total_norm + 1e-6))` when below 1.
    # Why safe: it is the function's own arithmetic, without the CUDA-only assertion.
    def clip_on_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff < 1.0:
            for param in parameters:
                grad = param.decoupled_grad if use_decoupled_grad else param.grad
                if grad is not None:
                    grad.mul_(coeff)

    patch(optimizer, "clip_grad_by_total_norm_fp32", clip_on_cpu)

    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


# --- the test ----------------------------------------------------------------------------


def _config(checkpoint: Path, distributed_optimizer: bool) -> GRPOConfig:
    return GRPOConfig.model_validate(
        {
            "rollout": {"n_samples": 4, "max_new_tokens": 16},
            "prompts_per_step": 4,
            "mini_batch_size": 8,
            "micro_batch_size": 4,
            "max_steps": 3,
            "dtype": "float32",
            "algorithm": {"ppo_epochs": 2, "kl_loss_coef": 0.1, "entropy_coeff": 0.01},
            "optim": {
                "learning_rate": 1e-3,
                "lr_scheduler": "cosine",
                "warmup_steps": 1,
                "backend": "megatron",
                "megatron": {
                    "layout": "tiny-cpu",
                    "checkpoint": str(checkpoint),
                    "use_distributed_optimizer": distributed_optimizer,
                },
            },
        }
    )


def _row_log_probs(module, ids: list[int], response: int) -> torch.Tensor:
    """Log-probs of a row's last ``response`` tokens, the Megatron module on the row alone."""
    device = next(module.parameters()).device
    tokens = torch.tensor([ids], device=device)
    positions = torch.arange(len(ids), device=device)[None]
    logits = module(input_ids=tokens, position_ids=positions, attention_mask=None)[0].float()
    log_probs = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[0, 1:, None])[:, 0]
    return log_probs[len(ids) - 1 - response :]


def _main_grads(module) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in module.named_parameters()}


def check_grpo_step(hf_dir: Path, tmp_path: Path, device: str, distributed_optimizer: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.checkpoint import load_checkpoint, save_checkpoint
    from trainer.grpo import micro_batch, update
    from trainer.megatron import bridge
    from trainer.megatron.backend import unwrap

    tol = {"cpu": 1e-5, "cuda": 2e-3}[device]
    checkpoint = tmp_path / "megatron"
    bridge.convert_hf_to_megatron(
        str(hf_dir), str(checkpoint), MegatronLayout(name="tiny", params_dtype="fp32")
    )
    cfg = _config(checkpoint, distributed_optimizer)
    info = DistInfo(0, 1, 0, torch.device(device))

    def build():
        return make_backend(
            None, cfg.optim, 6, info, 4, 1, with_reference=True, hf_dir=hf_dir, pad_id=0
        )

    vocab = AutoConfig.from_pretrained(hf_dir).vocab_size
    batch = fixed_grpo_batch(vocab)
    micros = [
        micro_batch.sequences(batch.prompts, batch.rollouts[s : s + 4], 0, device)
        for s in range(0, 16, 4)
    ]
    backend = build()
    actor = unwrap(backend.model[0])

    # 1. schedule log-probs == the same Megatron model on each row alone
    through_schedule = backend.log_probs(micros)
    reference = backend.log_probs(micros, reference=True)
    alone = []
    with torch.no_grad():
        for k, micro in enumerate(micros):
            for i, rollout in enumerate(batch.rollouts[4 * k : 4 * k + 4]):
                row = batch.prompts[rollout.prompt_index].ids + rollout.response_ids
                n = len(rollout.response_ids)
                want = _row_log_probs(actor, row, n)
                alone.append(want)
                got = through_schedule[k][i][micro.width - n :] if n else want
                torch.testing.assert_close(got, want, atol=tol, rtol=0)
                ref = reference[k][i][micro.width - n :] if n else want
                torch.testing.assert_close(ref, want, atol=tol, rtol=0)

    # 2. forward_backward's gradients == a plain backward of the summed losses
    weights = torch.linspace(-1.0, 1.0, 16, device=device).reshape(4, 4)

    def loss_fn(k, log_probs, entropy):
        mask = micros[k].mask
        total = (log_probs * mask * weights[k][:, None]).sum() / 50
        return total, {"loss": float(total.detach())}

    for chunk in backend.model:
        chunk.zero_grad_buffer()
    for j, rollout in enumerate(batch.rollouts):
        if rollout.response_ids:
            row = batch.prompts[rollout.prompt_index].ids + rollout.response_ids
            lp = _row_log_probs(actor, row, len(rollout.response_ids))
            (lp.sum() * weights[j // 4][j % 4] / 50).backward()
    plain = _main_grads(actor)
    stats = backend.forward_backward(micros, loss_fn)
    scheduled = _main_grads(actor)
    assert len(stats) == 4 and all(set(s) == {"loss"} for s in stats)
    for name, grad in plain.items():
        torch.testing.assert_close(scheduled[name], grad, atol=10 * tol, rtol=1e-3, msg=name)
    for chunk in backend.model:
        chunk.zero_grad_buffer()

    # 3. against the HF model: within what the conversion's logit difference allows
    hf = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    hf = hf.to(device).eval()
    full_rows = [type(m)(m.ids, m.attention, m.positions, m.mask, None) for m in micros]
    hf_lp = [m.hf_log_probs(hf, False)[0].detach() for m in full_rows]
    with torch.no_grad():
        logit_gap = 0.0
        for rollout in batch.rollouts:
            row = batch.prompts[rollout.prompt_index].ids + rollout.response_ids
            tokens = torch.tensor([row], device=device)
            positions = torch.arange(len(row), device=device)[None]
            ours = actor(input_ids=tokens, position_ids=positions, attention_mask=None)[0]
            gap = (ours[:, :vocab].float() - hf(input_ids=tokens).logits[0].float()).abs().max()
            logit_gap = max(logit_gap, float(gap))
    # fp32: the backend's Megatron model is the HF model (2.4e-7 measured on CPU)
    assert logit_gap < (1e-5 if device == "cpu" else 1e-3), logit_gap
    for got, want, micro in zip(through_schedule, hf_lp, micros, strict=True):
        assert float(((got - want) * micro.mask).abs().max()) <= 2 * logit_gap + tol

    # 4. one GRPO step, a checkpoint, and a resumed backend repeating the next step
    initial = {n: t.detach().cpu().clone() for n, t in backend.hf_weights()}
    first = update.policy_update(cfg, backend, batch, 0, 0)
    assert all(torch.isfinite(torch.tensor(v)) for v in first.values()), first
    lr = [cfg.optim.learning_rate * lr_factor(s, 6, cfg.optim) for s in range(5)]
    assert first["learning_rate"] == pytest.approx(sum(lr[:4]) / 4)  # 2 epochs × 2 minis
    assert first["kl"] > 0  # two epochs: the second moves away from the reference
    moved = {n: t.detach().cpu() for n, t in backend.hf_weights()}
    assert any(not torch.equal(moved[n], initial[n]) for n in initial)
    root = tmp_path / "checkpoints"
    saved = save_checkpoint(root, 1, backend, {"marker": 1}, info, keep=2)
    second = update.policy_update(cfg, backend, batch, 0, 1)
    after = {n: t.detach().cpu().clone() for n, t in backend.hf_weights()}
    backend.close()
    resumed = build()
    assert load_checkpoint(saved, resumed, info)["marker"] == 1
    assert resumed.learning_rate() == pytest.approx(lr[4])
    again = update.policy_update(cfg, resumed, batch, 0, 1)
    for key, value in second.items():
        assert again[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    for name, tensor in resumed.hf_weights():
        torch.testing.assert_close(tensor.detach().cpu(), after[name], atol=1e-6, rtol=0)

    # 5. HF names, and an HF directory transformers loads with the same weights
    assert set(after) == {n for n, _ in hf.named_parameters()}
    out = tmp_path / "hf_out"
    resumed.save_hf_pretrained(out, hf_dir, torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, tensor in after.items():
        torch.testing.assert_close(loaded[name], tensor, atol=1e-6, rtol=0)

    # 6. the GRPO step's output on this backend: a torch_dist checkpoint that the pipeline's
    # export_hf step (bridge.export_megatron_to_hf) turns into the same HF weights
    policy = tmp_path / "policy"
    resumed.save_policy(policy)
    assert (policy / "latest_checkpointed_iteration.txt").read_text() == "0"
    exported = tmp_path / "exported"
    bridge.export_megatron_to_hf(str(policy), str(hf_dir), str(exported))
    reloaded = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    for name, tensor in after.items():
        torch.testing.assert_close(reloaded[name], tensor, atol=1e-6, rtol=0)
    resumed.close()


@pytest.fixture
def megatron_on_cpu(megatron_bridge):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the unpatched @pytest.mark.gpu test covers this")
    from cpu_patches import cpu_patches

    with cpu_patches(), training_cpu_patches():
        yield


def test_grpo_step_on_cpu(megatron_on_cpu, tiny_models, tmp_path):
    """Megatron-Core's plain (fp32) optimizer: its DistributedOptimizer accepts only CUDA
    parameters (distrib_optimizer.py:477 raises "Wrapped parameters must be one of
    torch.cuda.FloatTensor, ..."), so on a CPU the distributed optimizer is the GPU test's."""
    check_grpo_step(tiny_models["square"], tmp_path, "cpu", distributed_optimizer=False)


@pytest.mark.gpu
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_grpo_step_on_gpu(megatron_bridge, tiny_models, tmp_path, distributed_optimizer):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_grpo_step(tiny_models["square"], tmp_path, "cuda", distributed_optimizer)


def _two_ranks(tmp_path: Path, hf_dir: Path, checkpoint: Path, *flags: str) -> dict:
    """``grpo_step_worker.py`` on 2 processes (torchrun, gloo); what rank 0 recorded."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MASTER_ADDR")}
    worker = Path(__file__).with_name("grpo_step_worker.py")
    out = tmp_path / "two.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(worker), str(hf_dir), str(checkpoint), str(out), *flags]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out)


@pytest.fixture
def converted(megatron_on_cpu, tiny_models, tmp_path) -> tuple[Path, Path]:
    """The default tiny model (4 heads, 2 KV heads: TP 2 splits whole query groups; 2
    layers: PP 2 puts one on each stage) and its one-rank torch_dist checkpoint."""
    from trainer.megatron import bridge

    hf_dir = tiny_models["default"]
    checkpoint = tmp_path / "megatron"
    layout = MegatronLayout(name="tiny", params_dtype="fp32")
    bridge.convert_hf_to_megatron(str(hf_dir), str(checkpoint), layout)
    return hf_dir, checkpoint


def _same_export(two: dict, one: dict) -> None:
    assert list(two) == list(one)  # every HF name, in the same order
    for name, tensor in one.items():
        assert torch.equal(two[name], tensor), name


def test_a_two_stage_pipeline_step_exports_the_one_rank_weights(converted, tmp_path):
    """The same GRPO step on 2 processes with PP 2 (1F1B over gloo, the log-probs and
    statistics broadcast from the last stage) and on 1: the sharded export
    (``export_hf_weights`` gathering each tensor from its stage, every rank drawing in step)
    gives the one-rank weights, before the update exactly and after it within float32
    rounding."""
    from grpo_step_worker import grpo_step

    hf_dir, checkpoint = converted
    grpo_step(hf_dir, checkpoint, tmp_path / "one.pt")
    one = torch.load(tmp_path / "one.pt")
    two = _two_ranks(tmp_path, hf_dir, checkpoint, "--pp", "2")
    _same_export(two["before"], one["before"])
    for key, value in one["stats"].items():
        assert two["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    worst = max((two["after"][n] - t).abs().max().item() for n, t in one["after"].items())
    moved = min((t - one["before"][n]).abs().max().item() for n, t in one["after"].items())
    print(
        f"PP 2 vs 1 rank after the step: max |diff| {worst:.3g} (each tensor moved >= {moved:.3g})"
    )
    assert moved > 1e-3 and worst < 1e-5


def test_a_two_rank_tensor_parallel_export_gathers_the_one_rank_weights(converted, tmp_path):
    """TP 2 (2 processes, gloo): the export gathers every tensor's shards back to the one-rank
    weights exactly, and the frozen reference's log-probs (vocabulary-parallel) are the
    one-rank ones. No update: Megatron-Core trains a MoE layer with TP > 1 only with sequence
    parallelism (``moe_layer.py:629`` raises otherwise; measured without that guard, the
    experts' squared gradient norm alone exceeded the one-rank model's whole), which needs
    Transformer Engine's or apex's LayerNorm (``torch_norm.py:50``), absent on a CPU; the GPU
    layouts set it."""
    from grpo_step_worker import grpo_step

    hf_dir, checkpoint = converted
    grpo_step(hf_dir, checkpoint, tmp_path / "one.pt", export_only=True)
    one = torch.load(tmp_path / "one.pt")
    two = _two_ranks(tmp_path, hf_dir, checkpoint, "--tp", "2", "--export-only")
    _same_export(two["before"], one["before"])
    for got, want in zip(two["reference_log_probs"], one["reference_log_probs"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
