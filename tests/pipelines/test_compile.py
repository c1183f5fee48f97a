"""Every preset's compiled pipeline kept in the repo matches the code byte for byte, compiles
to the same bytes every time, and is a valid KFP v2 spec."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from pipelines.compile import compile_pipeline, compiled_path
from pipelines.pipeline import IMAGES
from pipelines.presets import PRESETS, Preset, get_preset, step_configs
from pipelines.run_form import form_arguments

ROOT = Path(__file__).resolve().parents[2]
TINY = compiled_path("tiny-cpu")
VERL = compiled_path("gpt-oss-20b-verl")  # both GRPO branches


def _load(path):
    """The pipeline spec: the first YAML document (a second one holds the platform spec)."""
    return next(yaml.safe_load_all(path.read_text()))


def test_every_presets_kept_yaml_is_what_lingo_compile_writes_byte_for_byte(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import pipelines.compile
    from pipelines import cli

    monkeypatch.setattr(pipelines.compile, "COMPILED_DIR", tmp_path)
    result = CliRunner().invoke(cli.app, ["compile", "--all"])
    assert result.exit_code == 0, result.output
    for name in PRESETS:
        fresh = (tmp_path / f"{name}.yaml").read_bytes()
        assert fresh == (ROOT / "pipelines" / "compiled" / f"{name}.yaml").read_bytes(), (
            f"pipelines/compiled/{name}.yaml is stale: run `lingo compile --all` and commit it"
        )


def test_the_dag_is_built_with_kfps_caller_names_read_without_source():
    """kfp's task setters name their caller through ``inspect.stack()[1][3]``; the cheap stack
    the DAG is built with gives the same files, lines and functions, kfp's error still names
    the setter, and kfp's own ``inspect`` is back after the build."""
    import inspect

    from kfp import dsl
    from kfp.dsl import pipeline_task

    from pipelines.pipeline import _frames_without_source, build_pipeline

    def where(stack):
        return [(f.filename, f.lineno, f.function) for f in stack]

    with _frames_without_source():
        cheap = pipeline_task.inspect
        assert cheap is not inspect
        assert where(cheap.stack()) == where(inspect.stack())  # same line: same frames
        assert cheap.signature is inspect.signature  # the rest is inspect's

        @dsl.component
        def leaf() -> str:
            return "x"

        @dsl.pipeline
        def inner() -> None:
            leaf()

        with pytest.raises(ValueError, match="^set_cpu_limit can only be used"):

            @dsl.pipeline
            def outer() -> None:
                inner().set_cpu_limit("1")

    assert pipeline_task.inspect is inspect
    build_pipeline(PRESETS["tiny-cpu"])
    assert pipeline_task.inspect is inspect


COMPILE_EVERY_PRESET = """
import hashlib, sys
from pathlib import Path
from pipelines.compile import compile_pipeline
from pipelines.presets import PRESETS
for name, preset in PRESETS.items():
    path = compile_pipeline(Path(sys.argv[1]) / f"{name}.yaml", preset)
    print(name, hashlib.sha256(path.read_bytes()).hexdigest())
"""


@pytest.mark.slow  # two interpreters compile every preset: ~30 s on an idle machine
def test_compiling_twice_gives_the_same_bytes_whatever_the_hash_seed(tmp_path):
    """Issue #38: the header listed dict defaults in protobuf's map order, which changes
    with the process's hash seed (so ``lingo submit``'s content-addressed version names
    changed on every compile). Two fresh interpreters, two seeds: the same sha256 for every
    preset, and the kept files'."""
    digests = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        out.mkdir()
        done = subprocess.run(
            [sys.executable, "-c", COMPILE_EVERY_PRESET, str(out)],
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        digests.append(dict(line.split() for line in done.stdout.splitlines()))
    kept = {name: hashlib.sha256(compiled_path(name).read_bytes()).hexdigest() for name in PRESETS}
    assert digests[0] == digests[1] == kept


def test_every_preset_has_its_kept_yaml_and_no_other_is_kept():
    assert {p.stem for p in compiled_path("x").parent.glob("*.yaml")} == set(PRESETS)


def _spec(path) -> pipeline_spec_pb2.PipelineSpec:
    spec = pipeline_spec_pb2.PipelineSpec()
    json_format.ParseDict(_load(path), spec, ignore_unknown_fields=False)
    return spec


def _upstream(spec: pipeline_spec_pb2.PipelineSpec) -> dict[str, set[str]]:
    """Every task of the DAG, nested groups (dsl.If, dsl.ExitHandler) flattened, with what it
    waits for: its own dependencies and those of every group it sits in."""
    found: dict[str, set[str]] = {}

    def walk(dag, inherited: set[str]) -> None:
        for name, task in dag.tasks.items():
            waits = inherited | set(task.dependent_tasks)
            found[name] = waits
            component = spec.components[task.component_ref.name]
            if component.HasField("dag"):
                walk(component.dag, waits)

    walk(spec.root.dag, set())
    return found


def test_the_tiny_presets_yaml_runs_configure_first_and_holds_only_the_hf_branch():
    spec = _spec(TINY)
    upstream = _upstream(spec)
    assert upstream["configure"] == set()
    for name in ("start-tracking", "data-prep", "base-model", "capacity-check", "sft", "grpo"):
        assert "configure" in upstream[name], name
    # training and everything after it waits for the data check (an unchanged-data run stops)
    for name in ("base-model", "capacity-check", "sft", "grpo", "evaluate", "gate"):
        assert "data-check" in upstream[name], name
    assert "capacity-check" in upstream["sft"]  # a run that cannot fit stops before SFT
    assert not [t for t in upstream if t.startswith("condition-branches")]
    assert "comp-convert-megatron" not in spec.components
    assert upstream["grpo"] == {"configure", "data-check", "data-prep", "sft", "start-tracking"}


def test_kept_yaml_parses_strictly_as_pipeline_spec():
    spec = _spec(VERL)
    assert spec.pipeline_info.name == "lingo-rl"
    # every step runs inside the exit handler's group; `finalize` runs after it, whatever
    # happened to it (cancellation and failure included)
    assert set(spec.root.dag.tasks) == {"exit-handler-1", "finalize"}
    finalize = spec.root.dag.tasks["finalize"]
    assert list(finalize.dependent_tasks) == ["exit-handler-1"]
    assert (
        pipeline_spec_pb2.PipelineTaskSpec.TriggerPolicy.TriggerStrategy.Name(
            finalize.trigger_policy.strategy
        )
        == "ALL_UPSTREAM_TASKS_COMPLETED"
    )
    upstream = _upstream(spec)
    assert {"configure", "start-tracking", "data-prep", "base-model", "sft"} <= set(upstream)
    before_training = {"configure", "data-check", "data-prep", "start-tracking"}
    assert upstream["sft"] == {"base-model", "capacity-check", *before_training}
    # GRPO and what follows it: one branch per backend (dsl.If / dsl.Else on `backend`),
    # named for what runs
    branches = [t for t in upstream if t.startswith("condition-branches")]
    assert len(branches) == 1
    conditions = spec.components["comp-" + branches[0]].dag.tasks.values()
    assert sorted(c.task_info.name for c in conditions) == [
        "grpo-on-hf-weights",
        "grpo-on-megatron",
    ]
    assert upstream[branches[0]] == {"base-model", "sft", *before_training}
    dags = [
        {t: sorted(task.dependent_tasks) for t, task in c.dag.tasks.items()}
        for c in spec.components.values()
        if c.dag.tasks
    ]
    # both branches end in export_hf, then eval
    hf = next(d for d in dags if "grpo" in d)
    assert hf["grpo"] == [] and hf["export-hf"] == ["grpo"]
    assert hf["evaluate"] == ["champion", "export-hf"]
    assert hf["gate"] == ["evaluate", "export-hf"]
    megatron = next(d for d in dags if "grpo-2" in d)
    assert megatron["grpo-2"] == ["convert-megatron"]
    assert megatron["export-hf-2"] == ["grpo-2"]
    assert megatron["evaluate-2"] == ["champion-2", "export-hf-2"]
    component = spec.components["comp-data-prep"]
    assert set(component.output_definitions.artifacts) == {
        "train_data",
        "eval_data",
        "quarantine",
        "metrics",
        "card",
    }


def test_kfp_ui_views_have_their_artifact_types():
    """The eval's confusion matrices and figures, and SFT/GRPO's figures, are typed artifacts
    the KFP UI renders natively (issue #18)."""
    spec = _spec(VERL)

    def schemas(component: str) -> dict[str, str]:
        outputs = spec.components[component].output_definitions.artifacts
        return {name: a.artifact_type.schema_title for name, a in outputs.items()}

    for component in ("comp-evaluate", "comp-evaluate-2"):
        evaluate = schemas(component)
        matrices = {
            f"{model}_{part}_language": "system.ClassificationMetrics"
            for model in ("base", "sft", "grpo")
            for part in ("reasoning", "answer")
        }
        assert evaluate.items() >= {**matrices, "metrics": "system.Metrics"}.items()
    for component in ("comp-sft", "comp-grpo"):
        assert schemas(component)["metrics"] == "system.Metrics"


@pytest.mark.parametrize("name", PRESETS)
def test_the_kept_defaults_are_the_presets_form_and_the_images(name):
    inputs = _load(compiled_path(name))["root"]["inputDefinitions"]["parameters"]
    expected = form_arguments(PRESETS[name]) | IMAGES
    assert {k: v["defaultValue"] for k, v in inputs.items()} == expected


def test_cluster_presets_compile_with_a_strict_platform_spec(tmp_path):
    from kfp.pipeline_spec import pipeline_spec_pb2 as pb

    path = compile_pipeline(tmp_path / "p.yaml", get_preset("gpt-oss-20b"))
    spec_doc, platform_doc = list(yaml.safe_load_all(path.read_text()))
    json_format.ParseDict(spec_doc, pb.PipelineSpec(), ignore_unknown_fields=False)
    platform = json_format.ParseDict(platform_doc, pb.PlatformSpec(), ignore_unknown_fields=False)
    executors = platform.platforms["kubernetes"].deployment_spec.executors
    sft = dict(executors["exec-sft"])
    assert sft["pvcMount"][0]["constant"] == "lingo-workspace"
    assert "nodeSelector" not in sft  # SFT launches a job: its pod orchestrates on CPU
    assert "nodeSelector" in dict(executors["exec-evaluate"])
    configs = step_configs(get_preset("gpt-oss-20b"))
    assert configs["grpo_execution"]["mode"] == "job"
    assert configs["grpo_execution"]["job"]["job_api"] == "auto"
    assert configs["grpo_execution"]["job"]["shared_pvc"] == "lingo-workspace"
    # the local preset carries no platform settings
    assert len(list(yaml.safe_load_all(TINY.read_text()))) == 1


def test_every_preset_validates_as_written():
    """A preset built with ``model_copy(update=...)`` skips validation: re-validated, each
    holds."""
    for preset in PRESETS.values():
        again = Preset.model_validate(preset.model_dump())
        assert again == preset, preset.name
    assert PRESETS["gpt-oss-20b"].grpo.rollout.async_steps == 1  # dedicated, one step off
    assert not PRESETS["gpt-oss-20b-verl"].grpo.rollout.colocate


def test_the_compiled_defaults_add_no_synthetic_rows_to_a_users_source(tmp_path):
    # issue #32 item 8: on main the compiled tiny-cpu pipeline kept data_augment_factor=9 when
    # a user changed only data_source in the KFP UI (177 real rows -> +1,593 synthetic). The
    # data-prep step runs here as the pipeline runs it (kfp.local), with the config that the
    # kept YAML's configure step gives when only data_source changes.
    from compiled_form import configure_run
    from conftest import make_rows, write_jsonl
    from kfp import local

    from components.data_prep import data_prep

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "r"))
    source = write_jsonl(tmp_path / "mine.jsonl", make_rows(10))
    config = configure_run(TINY, data_source=str(source))["data_prep"]
    mine = data_prep(config={**config, "workers": 1})
    assert mine.outputs["train_data"].metadata["synthetic_rows"] == 0
    assert mine.outputs["train_data"].metadata["rows"] == 45  # 50 rows, 5 to eval
    # the demo's own data keeps its augmentation (the README's figures)
    bundled = data_prep(config={**configure_run(TINY)["data_prep"], "workers": 1})
    assert bundled.outputs["train_data"].metadata["synthetic_rows"] > 0


def _tasks(spec: dict) -> dict[str, dict]:
    """Every task of the compiled spec by name, whichever DAG (branch) holds it."""
    return {
        name: task
        for component in spec["components"].values()
        for name, task in component.get("dag", {}).get("tasks", {}).items()
    }


def test_the_verl_presets_megatron_branch_rolls_out_on_dedicated_vllm_engines():
    """The kept gpt-oss-20b-verl pipeline, run with ``backend=megatron`` in its form: the
    Megatron branch's GRPO step builds its config from the configure step's outputs as the
    component does (``branch_config``), and that config rolls out on 2 dedicated
    vLLM engines one step off-policy, on the job's second node."""
    from compiled_form import configure_run

    from cluster.config import ExecutionConfig
    from plan import branch_config
    from trainer.grpo.config import GRPOConfig
    from trainer.placement import grpo_placement

    spec = _load(VERL)
    inputs = _tasks(spec)["grpo-2"]["inputs"]["parameters"]  # the Megatron branch's GRPO
    assert inputs["backend"]["runtimeValue"]["constant"] == "megatron"
    for name in ("config", "megatron_optim", "megatron_layout", "execution"):
        assert inputs[name]["componentInputParameter"].startswith("pipelinechannel--configure-")
    configs = configure_run(VERL, backend="megatron")
    config = branch_config(
        configs["grpo"],
        "megatron",
        configs["megatron_layout"],
        "/mnt/shared/ckpt",
        configs["megatron_optim"],
    )
    cfg = GRPOConfig.model_validate(config)
    rollout = cfg.rollout
    assert (rollout.engine, rollout.colocate, rollout.num_engines) == ("vllm", False, 2)
    assert (rollout.tensor_parallel_size, rollout.async_steps) == (4, 1)
    assert cfg.optim.backend == "megatron" and not cfg.gradient_checkpointing
    megatron = cfg.optim.megatron
    assert (megatron.recompute_granularity, megatron.optimizer_offload_fraction) == ("full", 1.0)
    layout = megatron.resolved_layout()
    assert (layout.tp, layout.ep, layout.pp, cfg.nproc) == (8, 8, 1, 8)
    # the job: the 8 trainers on its first node, the engines' 8 processes on its second
    execution = ExecutionConfig.model_validate(configs["grpo_execution"])
    nodes, per_node = execution.cluster(cfg.nproc, cfg.rollout_processes)
    assert (nodes, per_node, cfg.rollout_processes) == (1, 8, 8)
    plan = grpo_placement(cfg, nodes, per_node)
    assert plan.training_ranks == tuple(range(8))
    assert [(e.node, e.ranks) for e in plan.engines] == [(1, (8, 9, 10, 11)), (1, (12, 13, 14, 15))]
