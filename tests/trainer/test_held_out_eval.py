"""GRPO's held-out eval runs on the rollout engine (``trainer.grpo.held_out.evaluate_policy``), as
verl and OpenRLHF validate with theirs: what it scores is what the engine draws for each
(prompt, sample) seed, decoded with its special tokens, and every evaluation draws the same
seeds (common random numbers)."""

from __future__ import annotations

import pytest
import torch

from core.modeling import load_causal_lm, load_tokenizer
from core.seeds import group_seeds
from reward.scoring import ComplianceScorer
from trainer.grpo.config import RolloutConfig
from trainer.grpo.held_out import evaluate_policy
from trainer.grpo.prompts import Prompt
from trainer.grpo.rollout import HFRolloutEngine

QUESTIONS = {
    "de": "<|start|>user<|message|>Wie viel ist 2 + 3?<|end|><|start|>assistant",
    "fr": "<|start|>user<|message|>Combien font 2 + 3 ?<|end|><|start|>assistant",
}


class RecordingScorer(ComplianceScorer):
    """The product's scorer, keeping the texts it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def score_batch(self, responses, labels, *args, **kwargs):
        self.texts += list(responses)
        return super().score_batch(responses, labels, *args, **kwargs)


@pytest.fixture(scope="module")
def rollout_engine(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, torch.float32)
    cfg = RolloutConfig(temperature=0.7, top_p=0.95, max_new_tokens=12)
    prompts = [
        Prompt(tokenizer.encode(text, add_special_tokens=False), language, text)
        for language, text in QUESTIONS.items()
    ]
    return HFRolloutEngine(model, tokenizer, cfg, batch_size=8), tokenizer, prompts


def test_the_held_out_eval_scores_what_the_engine_draws_for_its_seeds(rollout_engine):
    engine, tokenizer, prompts = rollout_engine
    scorer = RecordingScorer()
    result = evaluate_policy(engine, tokenizer, prompts, scorer, samples=2, seed=5)
    drawn = engine.generate([p.ids for p in prompts], group_seeds(5, "held-out", range(2), 2))
    assert scorer.texts == [
        tokenizer.decode(r.response_ids, skip_special_tokens=False) for r in drawn
    ]
    assert len(set(scorer.texts)) == 4  # each (prompt, sample) its own seed
    assert result.finished_fraction == sum(r.finished for r in drawn) / 4
    # common random numbers: the same policy, the same draws, the same result
    again = RecordingScorer()
    assert evaluate_policy(engine, tokenizer, prompts, again, samples=2, seed=5) == result
    assert again.texts == scorer.texts
    other = RecordingScorer()
    evaluate_policy(engine, tokenizer, prompts, other, samples=2, seed=6)
    assert other.texts != scorer.texts
