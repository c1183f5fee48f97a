"""The compiled pipeline kept in the repo matches the code, and is a valid KFP v2 spec."""

import inspect

import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from pipelines.compile import COMPILED_PIPELINE, compile_pipeline
from pipelines.pipeline import lingo_pipeline
from pipelines.presets import DEFAULT_PRESET, PRESETS, Preset, get_preset, pipeline_arguments


def _load(path):
    """The pipeline spec: the first YAML document (a second one holds the platform spec)."""
    return next(yaml.safe_load_all(path.read_text()))


def test_kept_yaml_has_not_drifted(tmp_path):
    fresh = compile_pipeline(tmp_path / "p.yaml", get_preset(DEFAULT_PRESET))
    assert _load(fresh) == _load(COMPILED_PIPELINE), (
        "pipelines/compiled/lingo_pipeline.yaml is stale: run "
        "`lingo compile -o pipelines/compiled/lingo_pipeline.yaml` and commit it"
    )


def test_kept_yaml_parses_strictly_as_pipeline_spec():
    spec = pipeline_spec_pb2.PipelineSpec()
    json_format.ParseDict(_load(COMPILED_PIPELINE), spec, ignore_unknown_fields=False)
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
    tasks = spec.components["comp-exit-handler-1"].dag.tasks
    assert {"start-tracking", "data-prep", "base-model", "sft"} <= set(tasks)
    assert list(tasks["sft"].dependent_tasks) == [
        "base-model",
        "capacity-check",
        "data-prep",
        "start-tracking",
    ]
    # GRPO and what follows it: one branch per backend (dsl.If / dsl.Else on `backend`),
    # named for what runs
    branches = [t for t in tasks if t.startswith("condition-branches")]
    assert len(branches) == 1
    conditions = spec.components["comp-" + branches[0]].dag.tasks.values()
    assert sorted(c.task_info.name for c in conditions) == [
        "grpo-on-hf-weights",
        "grpo-on-megatron",
    ]
    assert list(tasks[branches[0]].dependent_tasks) == [
        "base-model",
        "data-prep",
        "sft",
        "start-tracking",
    ]
    dags = [
        {t: sorted(task.dependent_tasks) for t, task in c.dag.tasks.items()}
        for c in spec.components.values()
        if c.dag.tasks
    ]
    # both branches end in export_hf, then eval
    hf = next(d for d in dags if "grpo" in d)
    assert hf["grpo"] == [] and hf["export-hf"] == ["grpo"]
    assert hf["evaluate"] == ["export-hf"]
    assert hf["gate"] == ["evaluate", "export-hf"]
    megatron = next(d for d in dags if "grpo-2" in d)
    assert megatron["grpo-2"] == ["convert-megatron"]
    assert megatron["export-hf-2"] == ["grpo-2"]
    assert megatron["evaluate-2"] == ["export-hf-2"]
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
    spec = pipeline_spec_pb2.PipelineSpec()
    json_format.ParseDict(_load(COMPILED_PIPELINE), spec, ignore_unknown_fields=False)

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


def test_pipeline_parameters_are_the_preset_fields_with_the_config_defaults():
    params = inspect.signature(lingo_pipeline.pipeline_func).parameters
    for preset in PRESETS.values():
        assert set(pipeline_arguments(preset)) == set(params)
    defaults = {name: p.default for name, p in params.items()}
    assert defaults == pipeline_arguments(Preset(name="defaults", description=""))


def test_compiled_defaults_are_the_default_presets_values():
    inputs = _load(COMPILED_PIPELINE)["root"]["inputDefinitions"]["parameters"]
    expected = pipeline_arguments(PRESETS[DEFAULT_PRESET])
    assert {k: v["defaultValue"] for k, v in inputs.items()} == expected


def test_preset_values_become_parameter_defaults(tmp_path):
    path = compile_pipeline(tmp_path / "p.yaml", get_preset("gpt-oss-20b"))
    inputs = _load(path)["root"]["inputDefinitions"]["parameters"]
    assert inputs["data_source"]["defaultValue"] == "HuggingFaceH4/Multilingual-Thinking"


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
    arguments = pipeline_arguments(get_preset("gpt-oss-20b"))
    assert arguments["grpo_execution"]["mode"] == "job"
    assert arguments["grpo_execution"]["job"]["job_api"] == "auto"
    assert arguments["grpo_execution"]["job"]["shared_pvc"] == "lingo-workspace"
    # the local preset (the kept YAML) carries no platform settings
    assert len(list(yaml.safe_load_all(COMPILED_PIPELINE.read_text()))) == 1


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
    # data-prep step runs here as the pipeline runs it (kfp.local), with the kept YAML's
    # defaults and only data_source changed.
    from conftest import make_rows, write_jsonl
    from kfp import local

    from components.data_prep import data_prep
    from pipelines.presets import DATA_PREP_PREFIX

    parameters = _load(COMPILED_PIPELINE)["root"]["inputDefinitions"]["parameters"]
    defaults = {  # the YAML writes integers as floats (9.0)
        name.removeprefix(DATA_PREP_PREFIX): int(spec["defaultValue"])
        if spec["parameterType"] == "NUMBER_INTEGER"
        else spec["defaultValue"]
        for name, spec in parameters.items()
        if name.startswith(DATA_PREP_PREFIX)
    }
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "r"))
    source = write_jsonl(tmp_path / "mine.jsonl", make_rows(10))
    mine = data_prep(**{**defaults, "source": str(source), "workers": 1})
    assert mine.outputs["train_data"].metadata["synthetic_rows"] == 0
    assert mine.outputs["train_data"].metadata["rows"] == 45  # 50 rows, 5 to eval
    # the demo's own data keeps its augmentation (the README's figures)
    bundled = data_prep(**{**defaults, "workers": 1})
    assert bundled.outputs["train_data"].metadata["synthetic_rows"] > 0


def _tasks(spec: dict) -> dict[str, dict]:
    """Every task of the compiled spec by name, whichever DAG (branch) holds it."""
    return {
        name: task
        for component in spec["components"].values()
        for name, task in component.get("dag", {}).get("tasks", {}).items()
    }


def test_the_verl_presets_megatron_branch_rolls_out_on_dedicated_vllm_engines(tmp_path):
    """``lingo compile --preset gpt-oss-20b-verl``, then a run with ``-p backend=megatron``:
    the Megatron branch's GRPO step builds its config from the compiled defaults as the
    component does (``branch_config``), and that config rolls out on 2 dedicated
    vLLM engines one step off-policy, on the job's second node."""
    from cluster.config import ExecutionConfig
    from trainer.grpo.config import GRPOConfig, branch_config
    from trainer.placement import grpo_placement

    spec = _load(compile_pipeline(tmp_path / "verl.yaml", get_preset("gpt-oss-20b-verl")))
    defaults = {
        name: parameter.get("defaultValue")
        for name, parameter in spec["root"]["inputDefinitions"]["parameters"].items()
    }
    inputs = _tasks(spec)["grpo-2"]["inputs"]["parameters"]  # the Megatron branch's GRPO
    assert inputs["backend"]["runtimeValue"]["constant"] == "megatron"
    for name in ("config", "megatron_optim", "megatron_layout", "execution"):
        assert inputs[name]["componentInputParameter"].startswith("pipelinechannel--")
    config = branch_config(
        defaults["grpo_config"],
        "megatron",
        defaults["megatron_layout"],
        "/mnt/shared/ckpt",
        defaults["megatron_optim"],
    )
    cfg = GRPOConfig.model_validate(config)  # the YAML's numbers are floats: 1.0 layers
    rollout = cfg.rollout
    assert (rollout.engine, rollout.colocate, rollout.num_engines) == ("vllm", False, 2)
    assert (rollout.tensor_parallel_size, rollout.async_steps) == (4, 1)
    assert cfg.optim.backend == "megatron" and not cfg.gradient_checkpointing
    megatron = cfg.optim.megatron
    assert (megatron.recompute_granularity, megatron.optimizer_offload_fraction) == ("full", 1.0)
    layout = megatron.resolved_layout()
    assert (layout.tp, layout.ep, layout.pp, cfg.nproc) == (8, 8, 1, 8)
    # the job: the 8 trainers on its first node, the engines' 8 processes on its second
    execution = ExecutionConfig.model_validate(defaults["grpo_execution"])
    nodes, per_node = execution.cluster(cfg.nproc, cfg.rollout_processes)
    assert (nodes, per_node, cfg.rollout_processes) == (1, 8, 8)
    plan = grpo_placement(cfg, nodes, per_node)
    assert plan.training_ranks == tuple(range(8))
    assert [(e.node, e.ranks) for e in plan.engines] == [(1, (8, 9, 10, 11)), (1, (12, 13, 14, 15))]
