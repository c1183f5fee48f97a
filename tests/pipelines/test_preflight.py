"""Every input is checked before work starts (issue #32 item 14): eval questions, question
sets, model directories and output paths are validated when the pipeline is compiled or the
local run starts, not when their step starts (after SFT and GRPO, on a cluster)."""

import json
import shutil
import subprocess
import sys
import time

import pytest
from conftest import write_jsonl
from typer.testing import CliRunner

from eval.runner import BUNDLED_QUESTIONS
from pipelines.cli import app
from pipelines.overrides import apply_overrides
from pipelines.presets import DEFAULT_PRESET, get_preset

runner = CliRunner()


def _bad_questions(tmp_path):
    lines = BUNDLED_QUESTIONS.read_text(encoding="utf-8").splitlines()
    row = json.loads(lines[2])
    del row["language"]
    lines[2] = json.dumps(row)
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


def test_compile_refuses_eval_questions_with_a_bad_row(tmp_path):
    # on main the pipeline compiled, and the bad row stopped the evaluate step after SFT and GRPO
    questions = _bad_questions(tmp_path)
    out = tmp_path / "p.yaml"
    result = runner.invoke(app, ["compile", "-o", str(out), "--set", f"eval.questions={questions}"])
    error = _one_line_error(result)
    assert f"eval.questions: {questions}:3: not a valid eval question" in error
    assert not out.exists()


def test_compile_refuses_a_question_set_column_that_does_not_exist(tmp_path):
    source = write_jsonl(tmp_path / "q.jsonl", [{"q": "Combien de jours dans une année ?"}])
    sets = json.dumps([{"source": str(source), "question_column": "question"}])
    result = runner.invoke(
        app, ["compile", "-o", str(tmp_path / "p.yaml"), "--set", f"data_prep.question_sets={sets}"]
    )
    error = _one_line_error(result)
    assert "question_sets[0]" in error and "no row has the column 'question'" in error
    assert "the columns are: q" in error


def test_compile_refuses_a_model_directory_without_its_tokenizer(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").unlink()
    result = runner.invoke(
        app, ["compile", "-o", str(tmp_path / "p.yaml"), "--set", f"model.source={model}"]
    )
    error = _one_line_error(result)
    assert f"model.source: {model} has no tokenizer files (tokenizer.json or" in error


def test_compile_leaves_paths_of_the_cluster_to_the_steps(tmp_path, caplog):
    from pipelines.preflight import RunInputError, check_run_inputs

    # a path that is not on this machine may be on the cluster's volume: logged, not refused
    preset = apply_overrides(
        get_preset(DEFAULT_PRESET),
        {"eval.questions": "/mnt/data/questions.jsonl", "model.source": "/mnt/models/base"},
    )
    check_run_inputs(preset, local=False)
    assert "eval.questions: /mnt/data/questions.jsonl is not on this machine" in caplog.text
    with pytest.raises(RunInputError, match=r"2 problem\(s\).*eval\.questions.*model\.source"):
        check_run_inputs(preset, local=True)


def test_output_paths_are_checked(tmp_path):
    from pipelines.preflight import output_dir_problems

    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "is a file, not a directory" in output_dir_problems(a_file)[0]
    assert "more than the file system's 255" in output_dir_problems(tmp_path / ("n" * 300))[0]
    deep = tmp_path / "/".join(["d" * 50] * 9)
    assert "SQLite" in output_dir_problems(deep)[0]
    assert output_dir_problems(tmp_path / "new" / "runs") == []
    result = runner.invoke(app, ["compile", "-o", str(tmp_path)])
    assert "is a directory; give a file name" in _one_line_error(result)


def test_a_local_run_with_bad_inputs_stops_before_any_step(tmp_path):
    # on main the run started data prep, the base model, SFT and GRPO before the eval failed
    questions = _bad_questions(tmp_path)
    out = tmp_path / "runs"
    started = time.monotonic()
    command = [sys.executable, "-m", "pipelines", "run", "--local", "-o", str(out)]
    result = subprocess.run(
        [*command, "--set", f"eval.questions={questions}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{questions}:3: not a valid eval question" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60
    assert not out.exists()  # nothing written: no step ran


def test_compile_refuses_reward_weights_grpo_would_refuse(tmp_path):
    # on main the pipeline compiled, and GRPO refused the weights when it started, after SFT
    out = tmp_path / "p.yaml"
    weights = '{"answer_language_neutral": 9}'
    result = runner.invoke(
        app, ["compile", "-o", str(out), "--set", f"grpo.reward_weights={weights}"]
    )
    error = _one_line_error(result)
    assert "grpo.reward_weights: RewardWeights.answer_language_neutral=9.0 must lie" in error
    assert not out.exists()


@pytest.mark.parametrize(
    ("preset", "update", "expected"),
    [
        # the GRPO step built its scorer from them when it started (after SFT)
        ("tiny-cpu", {"grpo.reward_weights": '{"no_such": 1}'}, "unknown weight(s) ['no_such']"),
        # the SFT step's launch refused several processes of the torch backend
        ("tiny-cpu", {"sft.nproc": "2"}, "sft: nproc=2 needs optim.backend=deepspeed"),
        # the capacity-check step and GRPO's start refused a plan that cannot exist
        (
            "gpt-oss-20b",
            {"grpo.rollout.tensor_parallel_size": "8"},
            "grpo: the placement plan: cannot place the run: rollout TP 8 does not divide "
            "gpus_per_node 4",
        ),
    ],
)
def test_config_values_a_step_would_refuse_are_found_before_it(preset, update, expected):
    from pipelines.preflight import config_value_problems

    problems = config_value_problems(apply_overrides(get_preset(preset), update))
    assert len(problems) == 1 and expected in problems[0], problems


def test_layout_overrides_and_the_megatron_layout_are_checked_before_their_steps():
    from pipelines.preflight import config_value_problems

    tiny = get_preset(DEFAULT_PRESET)
    # the capacity-check step refused them after data prep and the base model's download
    (problem,) = config_value_problems(
        tiny.model_copy(update={"layout_overrides": {"zero_stage": "7"}})
    )
    assert "layout_overrides" in problem and "zero_stage" in problem and "\n" not in problem
    # convert_megatron refused the layout after SFT
    megatron = tiny.model_copy(
        update={"backend": "megatron", "megatron_layout": {"preset": "tiny-cpu", "tp": 0}}
    )
    (problem,) = config_value_problems(megatron)
    assert problem.startswith("megatron_layout: ") and "tp" in problem
    assert config_value_problems(megatron.model_copy(update={"backend": "hf"})) == []
    for preset in ("tiny-cpu", "gpt-oss-20b", "gpt-oss-20b-verl"):
        assert config_value_problems(get_preset(preset)) == [], preset
    # a Megatron branch that -p backend=megatron would start and its GRPO step refuse: found
    # at compile time, though the preset's default branch is hf
    verl = get_preset("gpt-oss-20b-verl")
    offloading = {**verl.megatron_optim, "offload_optimizer": True}  # DeepSpeed's flag
    (problem,) = config_value_problems(verl.model_copy(update={"megatron_optim": offloading}))
    assert problem.startswith("the megatron branch's grpo config: ") and "offload" in problem
    assert "\n" not in problem
    # without its optim block the branch keeps grpo.optim, whose ZeRO-3 offload and gradient
    # checkpointing Megatron refuses: the preset needs it
    (problem,) = config_value_problems(
        verl.model_copy(update={"megatron_optim": {}, "backend": "megatron"})
    )
    assert "offload" in problem
