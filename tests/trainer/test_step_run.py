"""A training step run the way the pipeline runs SFT and GRPO (``trainer/step_run.py``): in
this process, or on N processes under a real torchrun with the config written to a file."""

import json
from pathlib import Path

import pytest
from tests_helpers_trainer import subprocess_env

from trainer.sft.config import SFTConfig
from trainer.step_run import RecipePaths, TrainingStep, run_training_step


def _read_echo(work_dir: Path) -> dict:
    return json.loads((work_dir / "echo_summary.json").read_text())


def _recipe_never_runs(*args):
    raise AssertionError("several processes: the recipe runs under torchrun, not here")


ECHO = TrainingStep("echo", "echo_step", "base-model", _recipe_never_runs, _read_echo)


@pytest.mark.parametrize("eval_split", ["eval.jsonl", None])
def test_several_processes_run_under_torchrun_with_the_config_in_a_file(
    tmp_path, monkeypatch, eval_split
):
    # torchrun's processes import echo_step from the tests' folder
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    cfg = SFTConfig.model_validate({"nproc": 2, "optim": {"backend": "deepspeed"}})
    paths = RecipePaths(
        tmp_path / "base",
        tmp_path / "train.jsonl",
        tmp_path / eval_split if eval_split else None,
        tmp_path / "out",
        tmp_path / "work",
    )
    result = run_training_step(ECHO, cfg, paths)
    assert result["world"] == result["ranks"] == 2 and result["same_argv"]
    argv = result["argv"]
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    config = tmp_path / "work" / "echo_config.json"
    assert flags == {
        "--config": str(config),
        "--base-model": str(tmp_path / "base"),
        "--train": str(tmp_path / "train.jsonl"),
        "--model-output": str(tmp_path / "out"),
        "--work-dir": str(tmp_path / "work"),
        **({"--eval": str(tmp_path / eval_split)} if eval_split else {}),
    }
    assert SFTConfig.model_validate_json(config.read_text()) == cfg


def test_one_process_runs_the_recipe_here_with_the_paths_in_order(tmp_path):
    calls = []

    def recipe(*args):
        calls.append(args)
        return "rank 0's result"

    step = TrainingStep("echo", "echo_step", "base-model", recipe, _read_echo)
    cfg = SFTConfig()
    paths = RecipePaths("base", "train", None, "out", tmp_path / "work")
    assert run_training_step(step, cfg, paths) == "rank 0's result"
    assert calls == [(cfg, "base", "train", None, "out", tmp_path / "work")]
    assert (tmp_path / "work").is_dir() and not list((tmp_path / "work").iterdir())


def test_several_processes_with_the_single_process_backend_are_refused(tmp_path):
    cfg = SFTConfig.model_validate({"nproc": 2, "optim": {"backend": "torch"}})
    paths = RecipePaths("base", "train", None, "out", tmp_path / "work")
    with pytest.raises(ValueError, match="nproc=2 needs optim.backend=deepspeed"):
        run_training_step(ECHO, cfg, paths)
