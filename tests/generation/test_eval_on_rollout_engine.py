"""The eval runs on GRPO's rollout engine (``generation.engines.TokenEngineText``), as verl and
OpenRLHF validate with theirs: the same responses as the engine draws for the same seeds."""

from __future__ import annotations

import pytest
import torch

from core.modeling import load_causal_lm, load_tokenizer
from eval.eval_config import EvalConfig, SamplingSettings
from eval.report import load_results
from eval.runner import run_eval
from generation.engines import TokenEngineText
from generation.requests import GenerationRequest, SamplingParams
from trainer.grpo.config import RolloutConfig
from trainer.grpo.rollout import HFRolloutEngine

SETTINGS = SamplingSettings(temperature=0.7, top_p=0.95, max_tokens=12, seed=5)


@pytest.fixture(scope="module")
def rollout_engine(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, torch.float32)
    cfg = RolloutConfig(temperature=0.7, top_p=0.95, max_new_tokens=12)
    return HFRolloutEngine(model, tokenizer, cfg, batch_size=8), tokenizer


def test_the_eval_runs_on_the_rollout_engine(tmp_path, rollout_engine):
    engine, tokenizer = rollout_engine
    config = EvalConfig(limit=4, sampling=SETTINGS.model_copy(update={"n": 2}))
    wrapped = TokenEngineText(engine, tokenizer, "rollout:hf")
    run_eval(["tiny=rollout"], config, tmp_path, engine_factory=lambda spec, cfg: wrapped)
    responses = load_results(tmp_path)["responses"]
    assert len(responses) == 8 and not [r for r in responses if r["error"]]
    assert {r["finish_reason"] for r in responses} <= {"stop", "length"}


def test_a_request_gets_what_the_engine_draws_for_its_seed(rollout_engine):
    engine, tokenizer = rollout_engine
    prompt = "<|start|>user<|message|>Wie viel ist 2 + 3?<|end|><|start|>assistant"
    requests = [GenerationRequest(f"q#{k}", prompt, (), seed) for k, seed in enumerate((11, 12))]
    texts = [g.text for g in TokenEngineText(engine, tokenizer, "hf").generate(requests, SETTINGS)]
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    drawn = engine.generate([ids], [[11, 12]])
    assert texts == [tokenizer.decode(r.response_ids, skip_special_tokens=False) for r in drawn]
    assert texts[0] != texts[1]  # each request its own seed


def test_sampling_other_than_the_engines_is_refused(rollout_engine):
    engine, tokenizer = rollout_engine
    request = GenerationRequest("q#0", "<|start|>assistant", (), 0)
    with pytest.raises(ValueError, match="samples with"):
        TokenEngineText(engine, tokenizer, "hf").generate(
            [request], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12)
        )
