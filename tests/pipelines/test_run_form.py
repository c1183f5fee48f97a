"""The run form (issue #38): every parameter described, only what applies to the preset, and a
run's values merged onto the preset's, never onto the code's defaults; a field edited in the
form, the same item in ``overrides`` and ``--set`` on the CLI give byte-identical step configs.

The run is read from the kept YAML (``pipelines/compiled/<preset>.yaml``) as KFP hands it to
the ``configure`` step: the preset constant of that task and the form's parameter values."""

import json
import shlex

import pytest
import yaml
from compiled_form import carried_preset, configure_run, form_defaults
from hypothesis import given
from hypothesis import strategies as st

from pipelines import cli
from pipelines.compile import compiled_path
from pipelines.configure import configure
from pipelines.overrides import AssignmentError, apply_overrides, parse_assignments, parse_overrides
from pipelines.presets import PRESETS, TRAINING_STEPS, preset_from_json, preset_json, step_configs
from pipelines.run_form import FORM_FIELDS, RunFormError, check_export_uri, form_fields

GPT = compiled_path("gpt-oss-20b")
VERL = compiled_path("gpt-oss-20b-verl")


def _parameters(path) -> dict:
    return next(yaml.safe_load_all(path.read_text()))["root"]["inputDefinitions"]["parameters"]


def _bytes(configs: dict) -> bytes:
    return json.dumps(configs, sort_keys=True).encode()


@pytest.mark.parametrize("name", PRESETS)
def test_every_parameter_of_every_form_is_described_and_none_is_a_dict(name):
    for parameter, spec in _parameters(compiled_path(name)).items():
        assert len(spec.get("description", "")) > 20, parameter
        # scalars only: `kfp run create ... force=true` parses `true` to a bool
        # (kfp/cli/utils/parsing.py), and the UI shows a scalar as one field
        scalars = ("STRING", "NUMBER_INTEGER", "NUMBER_DOUBLE", "BOOLEAN")
        assert spec["parameterType"] in scalars, parameter
        assert len(json.dumps(spec["defaultValue"])) <= 200, parameter


def test_the_gpt_oss_20b_form_holds_only_the_parameters_that_apply_to_it():
    parameters = _parameters(GPT)
    # issue #38: its form showed the tiny model's config and the Megatron layout of a
    # pipeline whose GRPO runs DeepSpeed on the HF weights, and 13 raw JSON dicts
    for absent in ("model_tiny_config", "megatron_layout", "megatron_optim", "backend"):
        assert absent not in parameters
    assert not [p for p in parameters if p.endswith("_config")]
    assert parameters["model_source"]["defaultValue"] == "openai/gpt-oss-20b"
    assert parameters["sft_learning_rate"]["defaultValue"] == 2e-4
    assert parameters["overrides"]["defaultValue"] == ""
    assert "--set" in parameters["overrides"]["description"]
    # the preset with both GRPO branches lets a run pick one
    assert _parameters(VERL)["backend"]["defaultValue"] == "hf"
    assert [f.name for f in form_fields(PRESETS["gpt-oss-20b-verl"])][-1] == "backend"


def test_one_field_passed_through_the_api_keeps_every_other_value_of_the_preset():
    """Issue #38: ``sft_config='{"max_steps":50}'`` on gpt-oss-20b, as the ``kfp`` CLI, an API
    call or a scheduled run passes it, turned deepspeed into torch, nproc 8 into 1, LoRA r 8
    into 16, gradient checkpointing off and max_seq_len 2048 into 1024. The API now passes
    ``sft_max_steps=50`` (KFP fills the other parameters with the YAML's defaults), or the
    field in ``overrides``; either way the rest is the preset's."""
    preset = PRESETS["gpt-oss-20b"].sft
    for configs in (
        configure_run(GPT, sft_max_steps=50),
        configure_run(GPT, overrides="sft.max_steps=50"),
    ):
        sft = configs["sft"]
        assert sft["max_steps"] == 50
        assert sft["optim"]["backend"] == "deepspeed" and sft["optim"]["zero_stage"] == 3
        assert sft["nproc"] == 8 == preset.nproc
        assert sft["lora"]["r"] == 8 and sft["gradient_checkpointing"] is True
        assert sft["max_seq_len"] == 2048
        assert configs["sft_execution"]["mode"] == "job"
        assert {k: v for k, v in sft.items() if k != "max_steps"} == {
            k: v for k, v in step_configs(PRESETS["gpt-oss-20b"])["sft"].items() if k != "max_steps"
        }


def test_the_configure_step_runs_as_shipped_and_merges_onto_the_preset(tmp_path):
    """The component as KFP runs it (kfp.local, its shipped source): the kept YAML's preset
    constant, one form field and one override."""
    from kfp import local

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path))
    form = form_defaults(GPT) | {"sft_max_steps": 50}  # the pipeline passes every field
    task = configure(preset=carried_preset(GPT), overrides="sft.lora.dropout=0.05", **form)
    sft = task.outputs["sft"]  # through KFP's struct: integers come back as floats
    assert (sft["max_steps"], sft["lora"]["dropout"], sft["lora"]["r"]) == (50, 0.05, 8)
    assert (sft["optim"]["backend"], sft["nproc"], sft["max_seq_len"]) == ("deepspeed", 8, 2048)
    assert task.outputs["backend"] == "hf"
    assert task.outputs["data_source"] == "HuggingFaceH4/Multilingual-Thinking"


CHANGES = [  # (form field, its value in the form, the text a user gives --set)
    ("data_source", "HuggingFaceH4/other-thinking", "HuggingFaceH4/other-thinking"),
    ("model_source", "openai/gpt-oss-120b", "openai/gpt-oss-120b"),
    ("sft_max_steps", 7, "7"),
    ("sft_num_epochs", 2.5, "2.5"),
    ("sft_learning_rate", 1e-5, "1e-5"),
    ("grpo_max_steps", 3, "3"),
    ("grpo_learning_rate", 2e-6, "2e-6"),
    ("grpo_samples_per_prompt", 32, "32"),
    ("grpo_prompts_per_step", 64, "64"),
    ("eval_samples", 3, "3"),
    ("gate_margin", 0.05, "0.05"),
    ("force", True, "true"),
    ("backend", "megatron", "megatron"),
]


def test_every_form_field_is_exercised():
    assert [name for name, _, _ in CHANGES] == [f.name for f in FORM_FIELDS]


@pytest.mark.parametrize("name", PRESETS)
def test_a_form_field_its_overrides_item_and_cli_set_give_byte_identical_step_configs(name):
    path = compiled_path(name)
    preset = PRESETS[name]
    assert _bytes(configure_run(path)) == _bytes(step_configs(preset))  # the defaults
    paths = {f.name: f.path for f in FORM_FIELDS}
    for field, value, text in CHANGES:
        if field not in form_defaults(path):
            continue  # not in this preset's form
        assignment = f"{paths[field]}={text}"
        cli_configs = step_configs(cli.load_preset(name, [assignment]))
        form_configs = configure_run(path, **{field: value})
        overrides_configs = configure_run(path, overrides=shlex.quote(assignment))
        assert _bytes(form_configs) == _bytes(cli_configs) == _bytes(overrides_configs), field
        assert _bytes(form_configs) != _bytes(step_configs(preset)), field


def test_compile_time_set_and_run_time_overrides_give_the_same_step_configs(tmp_path):
    """``lingo compile --set sft.lora.r=4`` bakes the value into the pipeline's preset; the
    kept pipeline run with ``overrides='sft.lora.r=4'`` gives the same configs."""
    from typer.testing import CliRunner

    out = tmp_path / "r4.yaml"
    args = ["compile", "--preset", "gpt-oss-20b", "--set", "sft.lora.r=4", "-o", str(out)]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    compiled = configure_run(out)
    assert compiled["sft"]["lora"]["r"] == 4
    assert _bytes(compiled) == _bytes(configure_run(GPT, overrides="sft.lora.r=4"))


@pytest.mark.parametrize(
    ("path", "form", "overrides", "named"),
    [
        (GPT, {}, "sft.max_steps=-1", "sft.max_steps"),
        (GPT, {"grpo_samples_per_prompt": 1}, "", "parameter grpo_samples_per_prompt"),
        (GPT, {}, "sft.lora.rank=4", "'rank'"),
        (GPT, {}, "grpo", "'grpo' is not STEP.FIELD=VALUE"),
        (GPT, {}, "eval.persona='unclosed", "overrides: No closing quotation"),
        (GPT, {}, "megatron_layout.tp=2", "megatron_layout.tp: applies to the Megatron branch"),
        (GPT, {}, "backend=megatron", "holds one GRPO branch"),
        (GPT, {"backend": "megatron"}, "", "parameter(s) backend: not in the form"),
        (GPT, {"sft_max_steps": 9}, "sft.max_steps=5", "also set by parameter sft_max_steps"),
        (GPT, {}, "model.tiny.num_hidden_layers=4", "model.tiny.* configures the tiny model"),
        (GPT, {}, "hardware.node_type=p5en.48xlarge", "compiled for g5.12xlarge"),
        (GPT, {}, "grpo.reward_weights='{\"no_such_term\": 1}'", "grpo.reward_weights"),
        (VERL, {"backend": "tpu"}, "", "backend"),
        # megatron_optim replaces grpo.optim on the Megatron branch: the rate would be ignored
        (VERL, {"backend": "megatron", "grpo_learning_rate": 1e-6}, "", "megatron_optim."),
        # the Megatron branch's layout, read by the run's plan (before 2026-12-08 the convert
        # task refused it, after SFT)
        (VERL, {"backend": "megatron"}, "megatron_layout.pp=0", "megatron_layout: pp=0 must"),
        (VERL, {"backend": "megatron"}, "megatron_layout.preset=nope", "megatron_layout: preset"),
    ],
)
def test_a_value_that_does_not_hold_stops_the_configure_step_naming_the_field(
    path, form, overrides, named
):
    with pytest.raises(RunFormError) as error:
        configure_run(path, overrides, **form)
    assert named in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", PRESETS)
def test_the_carried_preset_reads_back_equal_and_derives_as_the_original(name):
    preset = PRESETS[name]
    again = preset_from_json(preset_json(preset))
    assert again == preset
    for step in TRAINING_STEPS:
        stated = "nproc" in getattr(preset, step).model_fields_set
        assert ("nproc" in getattr(again, step).model_fields_set) == stated, step
    # a run's hardware override derives the training processes again, as on the CLI
    change = {"hardware.grpo_nodes": "1"} if preset.hardware.node_type != "local" else {}
    assert step_configs(apply_overrides(again, change)) == step_configs(
        apply_overrides(preset, change)
    )


def test_the_configure_component_takes_the_form_and_gives_every_step_config():
    spec = configure.component_spec
    run = {"preset", "overrides", "job_platform", "export_uri"}
    assert set(spec.inputs) == {f.name for f in FORM_FIELDS} | run
    assert list(spec.outputs) == list(step_configs(PRESETS["tiny-cpu"]))


_KEYS = st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){1,2}", fullmatch=True)
_VALUES = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=20)


@given(st.dictionaries(_KEYS, _VALUES, max_size=5))
def test_overrides_read_as_the_cli_reads_its_set_items(assignments):
    items = [f"{key}={value}" for key, value in assignments.items()]
    text = " ".join(shlex.quote(item) for item in items)
    assert parse_overrides(text) == parse_assignments(items) == assignments
    assert parse_overrides("\n".join(shlex.quote(item) for item in items)) == assignments


def test_an_item_without_a_value_is_refused_by_both_readers():
    for read in (lambda: parse_assignments(["sft.max_steps"]), lambda: parse_overrides("=3")):
        with pytest.raises(AssignmentError, match="is not STEP.FIELD=VALUE"):
            read()


def test_docs_run_form_describes_every_parameter():
    from pathlib import Path

    from pipelines.pipeline import IMAGES
    from pipelines.run_form import RUN_FIELDS

    text = (Path(__file__).resolve().parents[2] / "docs" / "run-form.md").read_text()
    names = [f.name for f in FORM_FIELDS] + [f.name for f in RUN_FIELDS] + list(IMAGES)
    assert [name for name in names if f"| `{name}` |" not in text] == []


@pytest.mark.parametrize("uri", ["ftp://bucket/x", "bucket/prefix", "s3://", "s3:// b/x"])
def test_an_export_uri_publish_could_not_use_is_refused_naming_the_field(uri):
    """Issue #44 item 7: ``export_uri`` is read only by ``publish``, after SFT and GRPO; the
    ``configure`` step checks it first."""
    with pytest.raises(
        ValueError, match=r"^export_uri: .*(expected s3://bucket|whitespace)"
    ) as raised:
        check_export_uri(uri)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("uri", ["", "s3://bucket", "s3://bucket/runs/"])
def test_an_export_uri_publish_can_use_passes(uri):
    check_export_uri(uri)


@pytest.mark.parametrize("name", PRESETS)
def test_the_compiled_configure_step_receives_the_runs_export_uri(name):
    spec = next(yaml.safe_load_all(compiled_path(name).read_text()))
    configure_task = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["configure"]
    given = configure_task["inputs"]["parameters"]["export_uri"]
    assert given == {"componentInputParameter": "pipelinechannel--export_uri"}
