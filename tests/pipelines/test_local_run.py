"""The whole pipeline under kfp.local, as `lingo run --local` runs it."""

from conftest import read_jsonl, write_jsonl

from pipelines.local_run import run_local
from pipelines.presets import apply_overrides, get_preset


def test_local_pipeline_run_writes_the_step_outputs(tmp_path):
    result = run_local(get_preset("tiny-cpu"), tmp_path / "runs")
    train = read_jsonl(result.outputs["train_data"])
    evaluation = read_jsonl(result.outputs["eval_data"])
    assert len(train) >= 250 and len(evaluation) >= 25
    assert {r["reasoning_language"] for r in evaluation} == {"en", "fr", "de", "es", "it"}
    assert "Dataset card" in result.outputs["dataset_card"].read_text()
    assert result.pipeline_root == (tmp_path / "runs").resolve()


def test_local_pipeline_run_fails_on_bad_data_and_says_why(tmp_path, capfd):
    src = write_jsonl(tmp_path / "bad.jsonl", ["{nope"] * 3)
    preset = apply_overrides(get_preset("tiny-cpu"), {"data_prep.source": str(src)})
    try:
        run_local(preset, tmp_path / "runs")
    except RuntimeError as exc:
        assert "data-prep" in str(exc)
    else:
        raise AssertionError("the run should fail")
    out = capfd.readouterr()
    assert "TooManyBadRowsError" in out.out + out.err
    assert "bad.jsonl:1" in out.out + out.err
