import json

import pytest
from transformers import AutoTokenizer

from trainer.sft.data import (
    IGNORE_INDEX,
    EmptyDatasetError,
    collate,
    encode_record,
    load_examples,
    micro_batches,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _first_record(prepared_data):
    return json.loads((prepared_data / "train.jsonl").read_text().splitlines()[0])


def test_loss_mask_covers_exactly_the_assistant_tokens(tokenizer, prepared_data):
    record = _first_record(prepared_data)
    example = encode_record(record, tokenizer)
    whole = tokenizer(record["prompt"] + record["completion"], add_special_tokens=False)[
        "input_ids"
    ]
    assert example.input_ids == whole  # no merge across the prompt/completion boundary
    learned = [t for t in example.labels if t != IGNORE_INDEX]
    masked = example.labels.index(learned[0])
    # every prompt token is masked, every completion token is learned, token by token
    assert all(label == IGNORE_INDEX for label in example.labels[:masked])
    assert example.labels[masked:] == example.input_ids[masked:]
    assert tokenizer.decode(example.input_ids[:masked]) == record["prompt"]
    assert tokenizer.decode(learned) == record["completion"]
    tokens = tokenizer.convert_ids_to_tokens(learned)
    assert tokens[0] == "<|channel|>" and tokens[-1] == "<|return|>"
    assert tokenizer.convert_ids_to_tokens(example.input_ids[masked - 1]) == "assistant"


def test_overlong_examples_are_dropped_or_truncated_and_counted(tokenizer, prepared_data):
    path = prepared_data / "train.jsonl"
    full, _ = load_examples(path, tokenizer, 4096)
    limit = sorted(len(e.input_ids) for e in full)[len(full) // 2]
    kept, stats = load_examples(path, tokenizer, limit, "drop")
    assert stats.dropped_overlong == sum(1 for e in full if len(e.input_ids) > limit) > 0
    assert len(kept) == len(full) - stats.dropped_overlong
    cut, stats = load_examples(path, tokenizer, limit, "truncate")
    assert len(cut) == len(full) and stats.truncated > 0
    assert max(len(e.input_ids) for e in cut) == limit
    with pytest.raises(EmptyDatasetError, match="no usable example"):
        load_examples(path, tokenizer, 20, "drop")


def test_empty_or_wrong_files_are_clear_errors(tokenizer, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(EmptyDatasetError, match="empty.jsonl"):
        load_examples(tmp_path / "empty.jsonl", tokenizer, 512)
    (tmp_path / "raw.jsonl").write_text(json.dumps({"user": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"raw.jsonl:1: not a data-prep record"):
        load_examples(tmp_path / "raw.jsonl", tokenizer, 512)


def test_micro_batches_are_deterministic_bucketed_and_change_per_epoch():
    lengths = [((i * 37) % 200) + 10 for i in range(500)]
    a = micro_batches(lengths, 4, seed=1, epoch=0)
    assert a == micro_batches(lengths, 4, seed=1, epoch=0)
    assert a != micro_batches(lengths, 4, seed=1, epoch=1)
    assert all(len(b) == 4 for b in a) and len(a) == 125
    assert sorted(i for b in a for i in b) == list(range(500))
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in a) / len(a)
    assert spread < 20  # bucketing: lengths inside a micro-batch are close


def test_collate_pads_right_and_masks_padding(tokenizer, prepared_data):
    record = _first_record(prepared_data)
    short = encode_record(record, tokenizer)
    batch = collate([short, type(short)(short.input_ids[:5], short.labels[:5])], pad_token_id=9)
    assert batch["input_ids"].shape == (2, len(short.input_ids))
    assert batch["attention_mask"][1].sum() == 5
    assert (batch["labels"][1, 5:] == IGNORE_INDEX).all() and (batch["input_ids"][1, 5:] == 9).all()
