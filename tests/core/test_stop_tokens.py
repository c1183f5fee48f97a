"""One stop-token convention for every engine: GRPO's rollouts and the eval's, HF and vLLM."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from core.harmony import STOP_TOKENS, stop_token_ids
from core.modeling import load_generation_config
from generation.engines import HFEngine
from trainer.grpo.config import RolloutConfig
from trainer.grpo.rollout import HFRolloutEngine


class _Tokenizer:
    def __init__(self, vocab: dict[str, int], eos: int | None) -> None:
        self.vocab, self.eos_token_id = vocab, eos

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


GPT_OSS = {"<|return|>": 200002, "<|endoftext|>": 199999, "<|call|>": 200012, "<|end|>": 200007}


def test_harmony_stops_the_eos_and_the_generation_configs_eos():
    tokenizer = _Tokenizer(GPT_OSS, eos=200002)
    # gpt-oss-20b's generation config ends on <|return|>, <|endoftext|> and <|call|>
    config = GenerationConfig(eos_token_id=[200002, 199999, 200012])
    assert stop_token_ids(tokenizer, config) == [199999, 200002, 200012]
    assert stop_token_ids(tokenizer) == [200002, 200012]  # harmony's own, eos among them
    assert stop_token_ids(tokenizer, GenerationConfig(eos_token_id=5)) == [5, 200002, 200012]
    # <|end|> ends a message, not the turn: never a stop
    assert GPT_OSS["<|end|>"] not in stop_token_ids(tokenizer, config)
    assert set(STOP_TOKENS) == {"<|return|>", "<|call|>"}


def test_a_tokenizer_with_no_stop_token_is_refused():
    with pytest.raises(ValueError, match="no stop token"):
        stop_token_ids(_Tokenizer({"a": 0}, eos=None))


def test_every_engine_stops_on_the_same_tokens(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    want = stop_token_ids(tokenizer, load_generation_config(tiny_model_dir))
    assert want == stop_token_ids(tokenizer, model.generation_config)
    vocab = tokenizer.get_vocab()
    assert {vocab["<|return|>"], vocab["<|call|>"]} <= set(want)
    assert sorted(HFRolloutEngine(model, tokenizer, RolloutConfig()).stop_ids) == want
    assert HFEngine(tiny_model_dir, device="cpu").stop_ids == want


def test_a_model_without_a_generation_config_stops_as_transformers_loads_it(
    tmp_path, tiny_model_dir
):
    """No generation_config.json: the eos ids of config.json, as the loaded model has them."""
    bare = tmp_path / "model"
    shutil.copytree(tiny_model_dir, bare, ignore=shutil.ignore_patterns("generation_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(bare)
    model = AutoModelForCausalLM.from_pretrained(bare, dtype=torch.float32)
    loaded = load_generation_config(bare)
    assert loaded is not None and loaded.eos_token_id == model.generation_config.eos_token_id
    assert stop_token_ids(tokenizer, loaded) == stop_token_ids(tokenizer, model.generation_config)


def test_a_directory_without_any_config_has_no_generation_config(tmp_path):
    assert load_generation_config(tmp_path) is None
