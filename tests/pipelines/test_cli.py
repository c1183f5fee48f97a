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


def test_bad_override_is_a_usage_error():
    result = runner.invoke(app, ["compile", "--set", "data_prep.nope=1"])
    assert result.exit_code == 2
    assert "no field 'nope'" in result.output
    result = runner.invoke(app, ["compile", "--preset", "huge"])
    assert result.exit_code == 2 and "unknown preset" in result.output
    result = runner.invoke(app, ["compile", "--set", "data_prep.eval_fraction=2"])
    assert result.exit_code == 2 and "eval_fraction" in result.output


def test_run_without_local_explains_what_to_do():
    result = runner.invoke(app, ["run"])
    assert result.exit_code == 2 and "lingo submit" in result.output


def test_compile_writes_yaml(tmp_path):
    result = runner.invoke(app, ["compile", "-o", str(tmp_path / "p.yaml")])
    assert result.exit_code == 0 and (tmp_path / "p.yaml").read_text().startswith(
        "# PIPELINE DEFINITION"
    )


def test_estimate_prints_the_table_and_fails_when_it_does_not_fit():
    result = runner.invoke(app, ["estimate", "--model", "tiny-gpt-oss", "--layout", "tiny-cpu"])
    assert result.exit_code == 0, result.output
    assert "verdict: fits" in result.output
    result = runner.invoke(app, ["estimate", "--set", "micro_train_batch_size=64"])
    assert result.exit_code == 1 and "does not fit" in result.output
    result = runner.invoke(app, ["estimate", "--layout", "no-such-layout"])
    assert result.exit_code == 2 and "no-such-layout" in result.output
