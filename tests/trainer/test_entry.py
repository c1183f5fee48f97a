"""The training processes' entry point: arguments, and the process group's shutdown."""

from __future__ import annotations

import json
import socket

import pytest
import torch.distributed as dist
from pydantic import BaseModel

from trainer.entry import step_main


class _Config(BaseModel):
    steps: int


def _argv(tmp_path) -> list[str]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"steps": 3}))
    return [
        "--config", str(config), "--model", "m", "--train", "t.jsonl",
        "--model-output", "out", "--work-dir", "work",
    ]  # fmt: skip


def _join_group_of_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)


def test_a_successful_run_destroys_the_process_group(tmp_path):
    seen = []

    def run(config, model, train, eval_path, model_output, work_dir):
        _join_group_of_one()  # what init_distributed does under torchrun
        seen.append((config.steps, model, train, eval_path, model_output, work_dir))

    try:
        step_main("trainer.test", _Config, run, "model", False, _argv(tmp_path))
        assert seen == [(3, "m", "t.jsonl", None, "out", "work")]
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_failed_run_leaves_the_process_group_to_torchrun(tmp_path):
    def run(*_):
        _join_group_of_one()
        raise RuntimeError("step 7 failed")

    try:
        with pytest.raises(RuntimeError, match="step 7"):
            step_main("trainer.test", _Config, run, "model", False, _argv(tmp_path))
        assert dist.is_initialized()  # a destroy here could hang on the other ranks
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_run_without_a_process_group_is_left_alone(tmp_path):
    step_main("trainer.test", _Config, lambda *_: None, "model", False, _argv(tmp_path))
    assert not dist.is_initialized()
