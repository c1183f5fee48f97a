import pytest
from conftest import make_rows, read_jsonl, write_jsonl
from typer.testing import CliRunner

from pipelines.cli import app

runner = CliRunner()


def test_version_and_help_teach_the_commands():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("lingo-rl ")
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in (
        "run",
        "compile",
        "data-prep",
        "presets",
        "estimate",
        "eval",
        "submit",
        "schedule",
        "status",
        "cluster",
    ):
        assert command in result.output
    assert "lingo run --local" in result.output


def test_presets_lists_the_default():
    result = runner.invoke(app, ["presets"])
    assert result.exit_code == 0 and "tiny-cpu" in result.output


def test_data_prep_alone_with_overrides(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", make_rows(10))
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        ["data-prep", "--source", str(src), "-o", str(out), "--set", "data_prep.eval_fraction=0.2"],
    )
    assert result.exit_code == 0, result.output
    assert "50 rows: 40 train, 10 eval, 0 quarantined" in result.output
    assert len(read_jsonl(out / "eval.jsonl")) == 10
    assert (out / "dataset_card.md").exists()


@pytest.mark.parametrize(
    ("args", "exit_code", "message"),
    [
        # a bad override or preset is a usage error
        (["compile", "--set", "data_prep.nope=1"], 2, "no field 'nope'"),
        (["compile", "--preset", "huge"], 2, "unknown preset"),
        (["compile", "--set", "data_prep.eval_fraction=2"], 2, "eval_fraction"),
        (["estimate", "--layout", "no-such-layout"], 2, "no-such-layout"),
        # an estimate that does not fit fails
        (["estimate", "--set", "micro_train_batch_size=64"], 1, "does not fit"),
    ],
)
def test_bad_input_exits_with_what_is_wrong(args, exit_code, message):
    result = runner.invoke(app, args)
    assert result.exit_code == exit_code and message in result.output, result.output


def test_run_without_local_explains_what_to_do():
    result = runner.invoke(app, ["run"])
    assert result.exit_code == 2 and "lingo submit" in result.output


def test_compile_writes_yaml(tmp_path):
    result = runner.invoke(app, ["compile", "-o", str(tmp_path / "p.yaml")])
    assert result.exit_code == 0 and (tmp_path / "p.yaml").read_text().startswith(
        "# PIPELINE DEFINITION"
    )


def test_estimate_prints_the_table():
    result = runner.invoke(app, ["estimate", "--model", "tiny-gpt-oss", "--layout", "tiny-cpu"])
    assert result.exit_code == 0, result.output
    assert "verdict: fits" in result.output


def test_estimate_of_a_preset_prints_its_placement_plan_and_the_run_as_configured():
    result = runner.invoke(app, ["estimate", "--preset", "gpt-oss-20b-verl"])
    assert result.exit_code == 0, result.output
    assert "2 vllm rollout engine(s) of TP 4, dedicated GPUs" in result.output
    assert "engine 1: ranks 12-15 on node 1 gpus 4,5,6,7" in result.output
    assert "\nSFT\n" in result.output and "\nGRPO\n" in result.output
    assert "micro-batch 1 × 1280 tokens" in result.output  # 1,024 prompt + 256 new tokens
    result = runner.invoke(
        app, ["estimate", "--preset", "tiny-cpu", "--set", "host_memory_gib=2.5"]
    )
    assert result.exit_code == 1 and "does not fit" in result.output
    result = runner.invoke(app, ["estimate", "--preset", "no-such-preset"])
    assert result.exit_code == 2 and "no-such-preset" in result.output


def test_data_prep_of_a_users_file_adds_no_synthetic_rows_unless_asked(tmp_path):
    # issue #17: on main the default preset's augment_factor=9 (for the bundled demo data)
    # multiplied a user's file tenfold with synthetic rows while the summary said "N train"
    src = write_jsonl(tmp_path / "in.jsonl", make_rows(10))
    result = runner.invoke(app, ["data-prep", "--source", str(src), "-o", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "50 rows: 45 train, 5 eval" in result.output and "synthetic" not in result.output
    assert len(read_jsonl(tmp_path / "a" / "train.jsonl")) == 45
    asked = ["--set", "data_prep.augment_factor=2", "-o", str(tmp_path / "b")]
    result = runner.invoke(app, ["data-prep", "--source", str(src), *asked])
    assert result.exit_code == 0, result.output
    train = read_jsonl(tmp_path / "b" / "train.jsonl")
    synthetic = len(train) - 45
    assert synthetic > 0 and f"45 train (+{synthetic} synthetic)" in result.output


def test_a_missing_relative_source_is_one_clear_error_not_a_hub_lookup(tmp_path, monkeypatch):
    # issue #17: on main a Python traceback after 32 s of hub retries
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["data-prep", "--source", "mydata/rows.jsonl", "-o", "out"])
    assert result.exit_code == 1
    assert "error: mydata/rows.jsonl: no such file or directory" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out" / "train.jsonl").exists()
    verbose = runner.invoke(
        app, ["--verbose", "data-prep", "--source", "mydata/rows.jsonl", "-o", "out"]
    )
    assert verbose.exit_code == 1 and "Traceback" in verbose.output


def test_eval_of_a_missing_model_is_one_clear_error(tmp_path):
    result = runner.invoke(app, ["eval", "-m", f"gone={tmp_path / 'nope'}", "-o", str(tmp_path)])
    assert result.exit_code == 1
    assert "error: gone: model directory" in result.output and "Traceback" not in result.output


def test_compile_into_a_missing_directory_is_refused(tmp_path):
    # issue #17: on main the directory tree was created silently
    result = runner.invoke(app, ["compile", "-o", str(tmp_path / "no" / "dir" / "x.yaml")])
    assert result.exit_code == 2
    assert "does not exist" in " ".join(result.output.replace("│", " ").split())
    assert not (tmp_path / "no").exists()
