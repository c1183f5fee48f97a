"""SFT's resume state is typed (``SFTState``) and its checkpoints keep the format they always
had on disk: ``trainer_state.json`` is ``{"epoch": ..., "step": ...}``, so a checkpoint an
earlier version wrote resumes."""

import json
import logging

import pytest

from trainer.metrics import read_metrics
from trainer.sft.config import SFTConfig
from trainer.sft.recipe import SFTState, run_sft

# what every earlier version wrote: save_checkpoint's {**{"epoch": epoch}, "step": step}
EARLIER_STATE = '{\n  "epoch": 0,\n  "step": 1\n}'


def _run(tmp_path, model, data, max_steps):
    fast = dict(micro_batch_size=2, gradient_accumulation_steps=1, max_seq_len=512)
    config = SFTConfig(**fast, merge_check_prompts=1, max_steps=max_steps, checkpoint_every=1)
    work = tmp_path / "work"
    run_sft(config, model, data / "train.jsonl", data / "eval.jsonl", tmp_path / "model", work)
    return work


def test_a_checkpoint_in_the_earlier_format_resumes(
    tmp_path, tiny_model_dir, prepared_data, caplog
):
    work = _run(tmp_path, tiny_model_dir, prepared_data, max_steps=2)  # leaves step-1
    state_file = work / "checkpoints" / "step-1" / "trainer_state.json"
    assert state_file.read_text() == EARLIER_STATE  # byte for byte what was written before
    caplog.set_level(logging.INFO, logger="trainer.checkpoint")
    _run(tmp_path, tiny_model_dir, prepared_data, max_steps=3)
    assert "(step 1)" in caplog.text and "resumed from" in caplog.text
    steps = [m["step"] for m in read_metrics(work / "training_metrics.jsonl") if "loss" in m]
    assert steps == [1, 2, 3]  # the resumed run went on from step 2, it did not start over


def test_the_state_reads_what_resume_returns():
    assert SFTState.from_json(None) == SFTState(epoch=0, step=0)
    assert SFTState.from_json(json.loads(EARLIER_STATE)) == SFTState(epoch=0, step=1)
    assert SFTState(epoch=2, step=7).to_json() == {"epoch": 2, "step": 7}
    with pytest.raises(ValueError, match="trainer_state.json has no integer 'step'"):
        SFTState.from_json({"epoch": 1})
