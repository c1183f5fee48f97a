import json

import torch
from tests_helpers_trainer import SMALL_CORPUS, SMALL_CORPUS_MODEL
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.harmony import HARMONY_SPECIAL_TOKENS
from trainer.tiny_model import build_tiny_model, train_tokenizer


def test_model_and_tokenizer_round_trip_through_from_pretrained(tiny_model_dir, prepared_data):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "gpt_oss"
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert model.config.num_local_experts == 4 and model.config.num_experts_per_tok == 2
    for token in HARMONY_SPECIAL_TOKENS:  # each special token is one id
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
    record = json.loads((prepared_data / "train.jsonl").read_text().splitlines()[0])
    text = record["prompt"] + record["completion"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    # the chat template renders messages exactly like data prep
    assert tokenizer.apply_chat_template(record["messages"], tokenize=False) == text
    prompt = tokenizer.apply_chat_template(
        record["messages"][:2], tokenize=False, add_generation_prompt=True
    )
    assert prompt == record["prompt"]
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_same_seed_and_corpus_give_identical_files(tmp_path):
    cfg = SMALL_CORPUS_MODEL.model_copy(update={"seed": 3})
    a = build_tiny_model(tmp_path / "a", cfg, SMALL_CORPUS)
    b = build_tiny_model(tmp_path / "b", cfg, SMALL_CORPUS)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = build_tiny_model(tmp_path / "c", cfg.model_copy(update={"seed": 4}), SMALL_CORPUS)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_tokenizer_keeps_special_tokens_whole():
    tokenizer = train_tokenizer(SMALL_CORPUS, 400)
    ids = tokenizer("<|start|>user<|message|>Hallo<|end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids)[0] == "<|start|>"
    assert tokenizer.eos_token == "<|return|>"
