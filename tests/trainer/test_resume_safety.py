"""Resume is safe (issue #17): a changed config is applied or refused, a damaged newest
checkpoint falls back to the previous one, a torn metrics line is repaired."""

import json
import logging
import shutil

import pytest
from tests_helpers_trainer import small_grpo_config

from trainer.checkpoint import ResumeConfigError, config_changes
from trainer.grpo.config import GRPOConfig
from trainer.grpo.recipe import run_grpo
from trainer.metrics import MetricsFileError, read_metrics

BASE = small_grpo_config(
    rollout={"n_samples": 4, "max_new_tokens": 8},
    max_steps=3,
    max_ckpt_num=3,
    optim={"learning_rate": 1e-3, "lr_scheduler": "constant"},
)


def _run(tmp_path, model, data, **overrides):
    cfg = GRPOConfig.model_validate({**BASE, **overrides})
    return run_grpo(
        cfg, model, data / "train.jsonl", data / "eval.jsonl", tmp_path / "model", tmp_path / "work"
    )


def _steps(tmp_path):
    lines = read_metrics(tmp_path / "work" / "training_metrics.jsonl")
    return {m["step"]: m for m in lines if "loss" in m}


def test_resume_applies_a_changed_learning_rate_and_says_so(
    tmp_path, tiny_model_dir, prepared_data, caplog
):
    _run(tmp_path, tiny_model_dir, prepared_data, max_steps=2)  # leaves step-1
    caplog.set_level(logging.WARNING, logger="trainer.checkpoint")
    _run(
        tmp_path,
        tiny_model_dir,
        prepared_data,
        max_steps=3,
        optim={"learning_rate": 5e-4, "lr_scheduler": "constant"},
    )
    steps = _steps(tmp_path)
    assert steps[1]["learning_rate"] == pytest.approx(1e-3)
    # on main the checkpoint's 1e-3 silently went on
    assert steps[2]["learning_rate"] == pytest.approx(5e-4)
    assert steps[3]["learning_rate"] == pytest.approx(5e-4)
    assert "RESUME WITH A CHANGED CONFIG: optim.learning_rate" in caplog.text
    assert "RESUME WITH A CHANGED CONFIG: max_steps 2 → 3" in caplog.text


def test_resume_with_a_changed_group_size_is_refused_with_the_differences(
    tmp_path, tiny_model_dir, prepared_data
):
    _run(tmp_path, tiny_model_dir, prepared_data, max_steps=2)
    with pytest.raises(ResumeConfigError, match=r"rollout\.n_samples: 4 → 8") as e:
        _run(
            tmp_path,
            tiny_model_dir,
            prepared_data,
            rollout={"n_samples": 8, "max_new_tokens": 8},
            mini_batch_size=32,
        )
    assert "mini_batch_size: 16 → 32" in str(e.value) and "step-1" in str(e.value)


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous(
    tmp_path, tiny_model_dir, prepared_data, caplog
):
    _run(tmp_path, tiny_model_dir, prepared_data, max_steps=3)  # leaves step-1 and step-2
    work = tmp_path / "work"
    newest = work / "checkpoints" / "step-2" / "backend.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    caplog.set_level(logging.WARNING, logger="trainer.checkpoint")
    result = _run(tmp_path, tiny_model_dir, prepared_data, max_steps=3)
    assert result.steps == 3
    assert "step-2 is damaged" in caplog.text and "backend.pt" in caplog.text
    assert (work / "checkpoints" / ".corrupt-step-2").is_dir()
    assert sorted(_steps(tmp_path)) == [1, 2, 3]


def test_a_torn_metrics_line_is_repaired_on_resume(tmp_path, tiny_model_dir, prepared_data, caplog):
    _run(tmp_path, tiny_model_dir, prepared_data, max_steps=2)
    metrics = tmp_path / "work" / "training_metrics.jsonl"
    with metrics.open("a") as fh:
        fh.write('{"step": 2, "max_steps": 3, "lo')  # the writer was killed mid-line
    caplog.set_level(logging.WARNING, logger="trainer.metrics")
    _run(tmp_path, tiny_model_dir, prepared_data, max_steps=3)
    assert "torn last line" in caplog.text and str(metrics) in caplog.text
    for line in metrics.read_text().splitlines():
        json.loads(line)
    assert sorted(_steps(tmp_path)) == [1, 2, 3]


def test_a_bad_metrics_line_in_the_middle_names_the_file_and_line(tmp_path):
    path = tmp_path / "training_metrics.jsonl"
    path.write_text('{"step": 1}\n{oops\n{"step": 2}\n')
    with pytest.raises(MetricsFileError, match=r"training_metrics.jsonl:2: not a JSON"):
        read_metrics(path)


def test_config_changes_lists_nested_fields():
    assert config_changes({"a": 1, "o": {"lr": 1}}, {"a": 1, "o": {"lr": 2}, "n": 3}) == {
        "n": (None, 3),
        "o.lr": (1, 2),
    }


def test_resume_with_a_changed_train_file_is_refused(tmp_path, tiny_model_dir, prepared_data):
    # issue #32 item 7: on main a resume trained on whatever file --train named now
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "eval.jsonl"):
        shutil.copyfile(prepared_data / name, data / name)
    _run(tmp_path, tiny_model_dir, data, max_steps=2)  # leaves step-1
    moved = tmp_path / "moved"  # the same content elsewhere is the same data
    shutil.copytree(data, moved)
    _run(tmp_path, tiny_model_dir, moved, max_steps=2)
    lines = (data / "train.jsonl").read_text().splitlines(keepends=True)
    (data / "train.jsonl").write_text("".join(lines[:-1]))  # one row fewer
    with pytest.raises(ResumeConfigError, match=r"the data differs in train_data: 'sha256 ") as e:
        _run(tmp_path, tiny_model_dir, data, max_steps=3)
    assert "the content of the train file is not the one the checkpoint trained on" in str(e.value)


def test_a_checkpoint_damaged_without_changing_its_size_falls_back_to_the_previous(
    tmp_path, tiny_model_dir, prepared_data, caplog
):
    # issue #32 item 9: NaN bytes of the same size passed the size-only manifest on main, and
    # every rerun reported a divergence
    _run(tmp_path, tiny_model_dir, prepared_data, max_steps=3)  # leaves step-1 and step-2
    work = tmp_path / "work"
    newest = work / "checkpoints" / "step-2" / "backend.pt"
    data = bytearray(newest.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = b"\xff\xff\xc0\x7f" * 16  # float32 NaNs, same size
    newest.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="trainer.checkpoint")
    result = _run(tmp_path, tiny_model_dir, prepared_data, max_steps=3)
    assert result.steps == 3
    assert "step-2 is damaged (backend.pt does not hold what was written" in caplog.text
    assert (work / "checkpoints" / ".corrupt-step-2").is_dir()
    manifest = json.loads((work / "checkpoints" / "step-1" / "manifest.json").read_text())
    assert len(manifest["files"]["backend.pt"]["sha256"]) == 64
