"""A new rollout engine, policy loss or job API is one definition and its registration (issue
#40): each is added here, in this file only, and runs through the code that reads the
registries, with no name of it anywhere in the product.

- the engine (``counting``): its facts (``plan.EngineSpec``) and its builders
  (``trainer.grpo.engines.EngineBuilders``; the facts sit in ``plan``, below the trainer that
  holds the builders), registered by name; ``rollout.engine: counting`` then runs a GRPO step.
- the policy loss (``reinforce``): a function in ``trainer.grpo.algorithm.POLICY_LOSSES``;
  ``algorithm.policy_loss: reinforce`` then trains with it.
- the job API (``fakejob``): a ``cluster.jobs.JobKind`` with its manifest builder in
  ``cluster.jobs.JOB_KINDS``; ``cluster.job_api: fakejob`` (or ``auto`` on a server that
  serves only it) then runs a step job through it, on kmock's emulated API server
  (``tests/kube_emulator.py``: no API server runs here) with a thread playing its controller.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch
from kube_emulator import JOB_RESOURCES, kube_emulator
from kubernetes import client as k8s
from tests_helpers_trainer import recipe_paths, small_grpo_config
from transformers import AutoModelForCausalLM

import cluster.launcher
from cluster.access import job_role_rules, step_access
from cluster.config import ExecutionConfig
from cluster.jobs import JOB_KINDS, JobKind, job_state
from cluster.launcher import JobLauncher
from cluster.step_job import (
    RUN_LABEL,
    StepJob,
    build_step_manifest,
    build_step_runtime,
    job_name,
    run_step_job,
)
from cluster.torchrun import entry_point_command
from core.modeling import load_causal_lm, resolve_dtype
from plan import ENGINE_SPECS, EngineSpec, job_spec
from trainer.grpo import algorithm as algo
from trainer.grpo.config import GRPOConfig
from trainer.grpo.engines import ENGINES, EngineBuilders
from trainer.grpo.recipe import run_grpo
from trainer.grpo.rollout import HFRolloutEngine
from trainer.metrics import read_metrics
from trainer.sft.config import SFTConfig

# --------------------------------------------------------------------------- the engine


class CountingEngine(HFRolloutEngine):
    """An engine of this test's own: Hugging Face sampling on a copy of the policy that it
    keeps (so every step's weights reach it through ``sync_weights`` and the sync check),
    recording no log-probs; it keeps the shape of each request (prompts, samples of each)
    and counts the syncs it took."""

    def __init__(self, model, tokenizer, cfg) -> None:
        super().__init__(model, tokenizer, cfg)
        self.requests: list[tuple[int, int]] = []
        self.syncs = 0

    def generate(self, prompts, seeds):
        self.requests.append((len(prompts), len(seeds[0])))
        return [dataclasses.replace(r, log_probs=None) for r in super().generate(prompts, seeds)]

    def sync_weights(self, named_tensors) -> int:
        self.syncs += 1
        return super().sync_weights(named_tensors)


BUILT: list[CountingEngine] = []


def _colocated(site, policy, backend) -> CountingEngine:
    engine = CountingEngine(
        copy.deepcopy(policy).requires_grad_(False), site.tokenizer, site.cfg.rollout
    )
    BUILT.append(engine)
    return engine


def _rollout_only(site) -> CountingEngine:
    dtype = resolve_dtype(site.cfg.dtype, site.info.device)
    model = load_causal_lm(site.sft_model, dtype, site.info.device).requires_grad_(False)
    return CountingEngine(model, site.tokenizer, site.cfg.rollout)


COUNTING_SPEC = EngineSpec(
    name="counting",
    tensor_parallel=False,
    reserves_gpu_memory=False,
    needs_cuda=False,
    serves_lora=False,
    colocated_transfer="in_process_reload",
    colocated_reason="the counting engine: its own copy of the policy, in this process",
    dedicated_transfer="channel",
    dedicated_reason="dedicated counting engines load what they receive",
)
COUNTING_BUILDERS = EngineBuilders(_colocated, _rollout_only, lambda site, dp: (dp.rank,))

# --------------------------------------------------------------------------- the policy loss

LOSS_CALLS: list[int] = []


def reinforce_loss(
    x: algo.PolicyLossInputs, settings: algo.PolicyLossSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE with the group advantage: ``-A · log π(token)``, aggregated as the run's
    ``loss_agg_mode``; no ratio, so nothing is clipped."""
    LOSS_CALLS.append(x.log_probs.shape[0])
    advantages = x.advantages if x.advantages.dim() == 2 else x.advantages[:, None]
    loss = algo.aggregate_loss(
        -advantages * x.log_probs,
        x.response_mask,
        settings.loss_agg_mode,
        norm_length=settings.norm_length,
        global_normalizer=settings.global_normalizer,
    )
    mask = x.response_mask
    approx_kl = ((x.old_log_probs - x.log_probs) * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"approx_kl": approx_kl.detach(), "clip_fraction": torch.zeros(())}


# --------------------------------------------------------------------------- the job API


def build_fakejob(name: str, layout, module: str, args: list[str]) -> dict:
    """A FakeJob: ``layout.nodes`` pods of ``layout.image`` running the entry point."""
    return {
        "apiVersion": "example.org/v1",
        "kind": "FakeJob",
        "metadata": {"name": name, "namespace": layout.namespace},
        "spec": {
            "replicas": layout.nodes,
            "image": layout.image,
            "command": entry_point_command(module, args),
        },
    }


FAKEJOB = JobKind(
    api="fakejob",
    kind="FakeJob",
    group="example.org",
    version="v1",
    plural="fakejobs",
    succeeded="Done",
    container="main",
    job_label="example.org/job-name",
    primary_labels=(("example.org/rank", "0"),),
    builder=build_fakejob,
)

# --------------------------------------------------------------------------- the tests


def test_a_grpo_step_runs_through_a_registered_engine_and_policy_loss(
    tmp_path, tiny_model_dir, prepared_data, monkeypatch
):
    monkeypatch.setitem(ENGINE_SPECS, COUNTING_SPEC.name, COUNTING_SPEC)
    monkeypatch.setitem(ENGINES, COUNTING_SPEC.name, COUNTING_BUILDERS)
    monkeypatch.setitem(algo.POLICY_LOSSES, "reinforce", reinforce_loss)
    BUILT.clear()
    LOSS_CALLS.clear()
    cfg = GRPOConfig.model_validate(
        small_grpo_config(
            rollout={"engine": "counting", "n_samples": 4, "max_new_tokens": 8},
            algorithm={"policy_loss": "reinforce"},
            prompts_per_step=2,
            eval_prompts=2,
            mini_batch_size=8,
            micro_batch_size=8,
            max_steps=2,
            checkpoint_every=0,
            optim={"learning_rate": 1e-3, "lr_scheduler": "constant"},
        )
    )
    result = run_grpo(cfg, *recipe_paths(tiny_model_dir, prepared_data, tmp_path))
    (engine,) = BUILT
    # the SFT baseline's held-out eval (eval_prompts, eval_samples each), then each step's
    # prompts (n_samples each)
    assert engine.requests == [(2, 1), (2, 4), (2, 4)], engine.requests
    assert engine.syncs >= 1  # the first step's update reached it before the second step
    assert len(LOSS_CALLS) == 2 and all(rows == 8 for rows in LOSS_CALLS)  # one per step
    steps = [m for m in read_metrics(result.metrics_file) if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["clip_fraction"] == 0 for m in steps)  # the loss's own statistics
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "work" / "final_policy").state_dict()
    assert any(not torch.equal(before[k], final[k]) for k in before)  # the loss trained it


def test_the_config_names_only_registered_components(monkeypatch):
    with pytest.raises(ValueError, match="rollout.engine='counting' is not a rollout engine"):
        GRPOConfig.model_validate(small_grpo_config(rollout={"engine": "counting"}))
    with pytest.raises(ValueError, match="unknown policy loss 'reinforce'"):
        GRPOConfig.model_validate(small_grpo_config(algorithm={"policy_loss": "reinforce"}))
    with pytest.raises(ValueError, match="cluster.job_api='fakejob' is not a job API"):
        ExecutionConfig(mode="job", job={"job_api": "fakejob"})
    monkeypatch.setitem(ENGINE_SPECS, COUNTING_SPEC.name, COUNTING_SPEC)
    monkeypatch.setitem(algo.POLICY_LOSSES, "reinforce", reinforce_loss)
    monkeypatch.setitem(JOB_KINDS, FAKEJOB.api, FAKEJOB)
    named = {"rollout": {"engine": "counting"}, "algorithm": {"policy_loss": "reinforce"}}
    assert GRPOConfig.model_validate(small_grpo_config(**named))
    execution = ExecutionConfig(mode="job", job={"job_api": "fakejob"})
    assert execution.cluster_job("img:1", "team").job_api == "fakejob"


class FakeController(threading.Thread):
    """Plays the FakeJob's controller and its training: once the job exists, writes the model
    and the metrics where the command says, then reports the job ``Done``."""

    def __init__(self, api_client: k8s.ApiClient, namespace: str, name: str) -> None:
        super().__init__(daemon=True)
        self.jobs = k8s.CustomObjectsApi(api_client)
        self.namespace, self.name = namespace, name
        self.command: list[str] | None = None

    def run(self) -> None:
        path = (FAKEJOB.group, FAKEJOB.version, self.namespace, FAKEJOB.plural)
        deadline = time.monotonic() + 60
        while self.command is None and time.monotonic() < deadline:
            try:
                self.command = self.jobs.get_namespaced_custom_object(*path, self.name)["spec"][
                    "command"
                ]
            except k8s.ApiException:
                time.sleep(0.05)
        command = self.command or []
        model = command[command.index("--model-output") + 1]
        work = command[command.index("--work-dir") + 1]
        for directory, file in ((model, "config.json"), (work, "training_metrics.jsonl")):
            target = Path(directory)
            target.mkdir(parents=True, exist_ok=True)
            (target / file).write_text("{}\n")
        status = {"conditions": [{"type": FAKEJOB.succeeded, "status": "True"}]}
        self.jobs.patch_namespaced_custom_object_status(*path, self.name, {"status": status})


def test_a_step_job_runs_through_a_registered_job_api(tmp_path, monkeypatch):
    monkeypatch.setitem(JOB_KINDS, FAKEJOB.api, FAKEJOB)
    # what the emulated API server serves (test scaffolding, not a registration)
    monkeypatch.setitem(JOB_RESOURCES, "fakejob", {"example.org/v1/fakejobs": ("FakeJob", True)})
    namespace, run_id = "team", "run-1"
    execution = ExecutionConfig(
        mode="job",
        job={"namespace": namespace, "job_api": "auto"},
        work_root=str(tmp_path / "shared"),
        poll_s=0.05,
        timeout_s=60,
    )
    cluster_job = execution.cluster_job("img:1", namespace)
    model_in = tmp_path / "base"
    model_in.mkdir()
    (model_in / "config.json").write_text("{}")
    job = StepJob("sft", "trainer.sft", SFTConfig(), "base-model", model_in, model_in, None)
    # the manifest, as the step builds it
    manifest = build_step_manifest(job, cluster_job, run_id, ["--x"], job_spec("fakejob"))
    assert manifest["kind"] == "FakeJob" and manifest["spec"]["replicas"] == 1
    assert manifest["metadata"]["labels"][RUN_LABEL] == run_id
    assert build_step_runtime(job, cluster_job, run_id, ["--x"], FAKEJOB) is None
    assert {(a.verb, a.group, a.resource) for a in step_access(FAKEJOB)} >= {
        ("create", "example.org", "fakejobs")
    }
    assert {"apiGroups": ["example.org"], "resources": ["fakejobs"]}.items() <= next(
        rule for rule in job_role_rules() if rule["apiGroups"] == ["example.org"]
    ).items()
    # the whole step, on a server that serves only FakeJobs: auto finds it by discovery
    with kube_emulator(namespace=namespace, apis=("fakejob",)) as api_client:
        monkeypatch.setattr(cluster.launcher, "default_api_client", lambda: api_client)
        assert JobLauncher.connect(namespace, "auto", api_client).kind is FAKEJOB
        name = job_name("sft", run_id)
        controller = FakeController(api_client, namespace, name)
        controller.start()
        execution = execution.model_copy(update={"delete_on_success": False})
        work = run_step_job(
            job, execution, run_id, tmp_path / "model", tmp_path / "work",
            tmp_path / "job.yaml", "img:1",
        )  # fmt: skip
        controller.join(5)
        finished = JobLauncher(namespace, api_client, FAKEJOB).get(name)
    assert job_state(FAKEJOB, finished) == "succeeded"
    assert controller.command[:5] == ["python", "-m", "torch.distributed.run", "-m", "trainer.sft"]
    assert (tmp_path / "model" / "config.json").exists()
    assert (work / "training_metrics.jsonl").exists()
    assert "kind: FakeJob" in (tmp_path / "job.yaml").read_text()
