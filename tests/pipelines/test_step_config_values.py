"""The last steps' configs are checked when the pipeline is compiled and again at its first
step, ``configure`` (issue #44, item 7).

On main ``gate.candidate=grpoo`` compiled and the gate said "skipped", green;
``gate.baseline=sfft`` promoted a 0.000 model with no comparison; ``gate.registered_model=''``
failed at the gate with an MLflow error; ``gate.alias=v2`` compiled, then register made
version 1 and failed ("alias reserved"), leaving a version without an alias. Each is now one
line naming the field, from the config model both paths share (``eval.gate.GateConfig``).
"""

from __future__ import annotations

import logging
import shlex

import pytest
from typer.testing import CliRunner

from eval.gate import GateConfig
from pipelines import cli
from pipelines.presets import get_preset, preset_json
from pipelines.run_form import RunFormError, resolve_run

BAD = [
    ("gate.metric", "mean_rewards", "gate metric must be one of"),
    ("gate.candidate", "grpoo", "'grpoo' is not a model the pipeline's eval compares"),
    ("gate.baseline", "sfft", "'sfft' is not a model the pipeline's eval compares"),
    ("gate.baseline", "grpo", "candidate and baseline are both 'grpo'"),
    ("gate.registered_model", "", "the registered model's name is empty"),
    ("gate.registered_model", "a/b", "cannot contain '/' or ':'"),
    ("gate.alias", "v2", "MLflow reserves 'latest' and v<number>"),
    ("gate.alias", "Latest", "MLflow reserves 'latest' and v<number>"),
    ("gate.alias", "my alias", "letters, digits, '_' or '-'"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD)
def test_a_bad_gate_value_is_refused_when_the_pipeline_is_compiled(field, value, message, tmp_path):
    result = CliRunner().invoke(
        cli.app,
        ["compile", "-o", str(tmp_path / "p.yaml"), "--set", f"{field}={value}"],
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and field.split(".")[1] in lines[0], lines
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize(("field", "value", "message"), BAD)
def test_a_bad_gate_value_fails_the_configure_step(field, value, message):
    """What the first step does with the compiled preset and the run's overrides."""
    with pytest.raises(RunFormError, match="gate") as error:
        resolve_run(preset_json(get_preset("tiny-cpu")), {}, f"{field}={shlex.quote(value)}")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_gate_rules_are_mlflows_own():
    """The alias and name rules match the installed MLflow's validators."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils import validation

    # MLflow 3.18 renamed the alias validators (_validate_model_alias_name{,_reserved} ->
    # _validate_alias_name{,_reserved}); the install takes the newest in pyproject's range
    alias_name = _either(validation, "_validate_alias_name", "_validate_model_alias_name")
    alias_reserved = _either(
        validation, "_validate_alias_name_reserved", "_validate_model_alias_name_reserved"
    )

    def mlflow_accepts(check, *values) -> bool:
        try:
            for value in values:
                check(value)
        except MlflowException:
            return False
        return True

    for alias in ["champion", "v2", "V10", "latest", "LATEST", "prod-1", "a b", "x.y", "é", "v"]:
        ours = _accepts(alias=alias)
        theirs = mlflow_accepts(alias_name, alias) and mlflow_accepts(alias_reserved, alias)
        assert ours == theirs, alias
    for name in ["lingo-gpt-oss", " ", "a/b", "a:b", "ok name"]:
        assert _accepts(registered_model=name) == mlflow_accepts(
            validation._validate_model_name, name
        ), name


def _either(module, *names):
    """The first of ``names`` that ``module`` defines; fails naming all of them."""
    for name in names:
        if hasattr(module, name):
            return getattr(module, name)
    raise AssertionError(f"{module.__name__} defines none of {names}")


def _accepts(**field) -> bool:
    try:
        GateConfig(**field)
    except ValueError:
        return False
    return True


def test_a_local_eval_questions_path_compiled_in_is_one_warning(tmp_path, caplog):
    questions = tmp_path / "q.jsonl"
    from eval.runner import BUNDLED_QUESTIONS

    questions.write_bytes(BUNDLED_QUESTIONS.read_bytes())
    from pipelines.compile import compile_pipeline
    from pipelines.overrides import apply_overrides

    preset = apply_overrides(get_preset("tiny-cpu"), {"eval.questions": str(questions)})
    with caplog.at_level(logging.WARNING, logger="pipelines.preflight"):
        compile_pipeline(tmp_path / "p.yaml", preset)
    warned = [r.getMessage() for r in caplog.records if "compiled into the pipeline" in r.message]
    assert warned == [
        f"eval.questions={questions} is a file path, compiled into the pipeline as it is: the "
        "step reads it inside its pod, where only the image's files and mounted volumes are"
    ]
