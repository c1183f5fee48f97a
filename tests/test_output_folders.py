"""We delete only what we wrote (issue #32 item 1), for every writer: SFT, merge, GRPO,
export, eval, data prep.

On main ``python -m trainer.sft`` / ``python -m trainer.grpo`` with ``--model-output`` naming a
folder that held other files removed it (``shutil.rmtree`` before the rename) and exited 0; with
``--work-dir`` inside it the run's own checkpoints went too. Now an output folder that holds
anything this project did not write is refused before any work, nothing is removed; our own
earlier outputs (listed in the folder's ``.lingo-output.json``) are replaced atomically.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import make_rows, write_jsonl
from tests_helpers_trainer import grpo_cli_args, small_grpo_config, subprocess_env

from core import atomic  # its output-folder helpers: tests/core/test_atomic.py


def _users_folder(path):
    """A folder of the user's: a notes file and a sub-folder with a file."""
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "sub" / "data.csv").write_text("a,b")
    return path


def _intact(path) -> bool:
    return (path / "notes.txt").read_text() == "mine" and (path / "sub" / "data.csv").exists()


def _run_module(module: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=subprocess_env(),
    )


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return errors[0]


# --- every writer ---------------------------------------------------------------------------


def test_sft_refuses_a_model_output_folder_holding_the_users_files(
    tmp_path, tiny_model_dir, prepared_data
):
    # on main: 2 steps trained, the folder removed, exit 0
    out = _users_folder(tmp_path / "mine")
    config = tmp_path / "sft.json"
    config.write_text(json.dumps({"max_steps": 2, "micro_batch_size": 2, "eval_every": 0}))
    args = ["--config", str(config), "--base-model", str(tiny_model_dir)]
    args += ["--train", str(prepared_data / "train.jsonl"), "--model-output", str(out)]
    result = _run_module("trainer.sft", [*args, "--work-dir", str(tmp_path / "work")])
    line = _one_error_line(result)
    assert "--model-output" in line and "notes.txt" in line and "nothing was removed" in line
    assert _intact(out) and not (tmp_path / "work" / "checkpoints").exists()
    # a work folder inside the output: its checkpoints would be removed with it
    inside = _run_module("trainer.sft", [*args[:-1], str(tmp_path / "new"), "--work-dir",
                                         str(tmp_path / "new" / "work")])  # fmt: skip
    assert "lies inside --model-output" in _one_error_line(inside)


def test_grpo_refuses_a_model_output_folder_holding_the_users_files(
    tmp_path, tiny_model_dir, prepared_data
):
    args = grpo_cli_args(tmp_path, "run", small_grpo_config(max_steps=1), tiny_model_dir,
                         prepared_data)  # fmt: skip
    _users_folder(tmp_path / "run" / "model")
    line = _one_error_line(_run_module("trainer.grpo", args))
    assert "--model-output" in line and "notes.txt" in line
    assert _intact(tmp_path / "run" / "model")


def test_merge_replaces_its_own_output_and_refuses_the_users(tmp_path, tiny_model_dir):
    from core.modeling import load_causal_lm, load_tokenizer
    from trainer.sft.merge import merge_and_save

    model = load_causal_lm(tiny_model_dir, torch.float32)
    tokenizer = load_tokenizer(tiny_model_dir)
    out = tmp_path / "merged"
    merge_and_save(model, tokenizer, [[5, 6, 7]], out)
    first = (out / "model.safetensors").stat().st_ino
    merge_and_save(model, tokenizer, [[5, 6, 7]], out)  # our output: replaced
    assert (out / "model.safetensors").stat().st_ino != first
    assert json.loads((out / "merge_report.json").read_text())["max_abs_diff_after_reload"] == 0
    mine = _users_folder(tmp_path / "mine")
    with pytest.raises(atomic.OutputNotOursError, match="notes.txt"):
        merge_and_save(model, tokenizer, [[5, 6, 7]], mine)
    assert _intact(mine)


def test_export_replaces_its_own_output_and_refuses_the_users(tmp_path, tiny_model_dir):
    from trainer.export_hf import export_hf_directory

    out = tmp_path / "export"
    export_hf_directory(tiny_model_dir, tiny_model_dir, out, "float32")
    export_hf_directory(tiny_model_dir, tiny_model_dir, out, "bfloat16")  # replaced
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    mine = _users_folder(tmp_path / "mine")
    with pytest.raises(atomic.OutputNotOursError, match="notes.txt"):
        export_hf_directory(tiny_model_dir, tiny_model_dir, mine, "float32")
    assert _intact(mine) and not list(tmp_path.glob(".mine.partial"))  # refused before work


def test_eval_refuses_a_report_it_did_not_write(tmp_path, tiny_model_dir):
    from eval.eval_config import EvalConfig, SamplingSettings
    from eval.runner import run_eval

    config = EvalConfig(limit=1, device="cpu", sampling=SamplingSettings(max_tokens=2))
    out = tmp_path / "eval"
    run_eval([f"tiny={tiny_model_dir}"], config, out)
    run_eval([f"tiny={tiny_model_dir}"], config, out)  # our own results: replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "report.md").write_text("my report")
    with pytest.raises(atomic.OutputNotOursError, match=r"report.md"):
        run_eval([f"tiny={tiny_model_dir}"], config, tmp_path / "mine")
    assert (tmp_path / "mine" / "report.md").read_text() == "my report"
    assert not (tmp_path / "mine" / "results.json").exists()


def test_data_prep_refuses_outputs_it_did_not_write(tmp_path):
    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare_dataset

    source = write_jsonl(tmp_path / "in.jsonl", make_rows(4))
    out = tmp_path / "out"

    def prepare():
        return prepare_dataset(
            DataPrepConfig(source=str(source), workers=1),
            out / "train.jsonl", out / "eval.jsonl", out / "quarantine.jsonl",
        )  # fmt: skip

    prepare()
    prepare()  # our own outputs: replaced
    (out / "train.jsonl").unlink()
    (out / "train.jsonl").write_text("the user's rows\n")
    record = json.loads((out / atomic.OUTPUT_RECORD).read_text())
    record["entries"].remove("train.jsonl")  # as if another program wrote it
    (out / atomic.OUTPUT_RECORD).write_text(json.dumps(record))
    with pytest.raises(atomic.OutputNotOursError, match="train.jsonl"):
        prepare()
    assert (out / "train.jsonl").read_text() == "the user's rows\n"
