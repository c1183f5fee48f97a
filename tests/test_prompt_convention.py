"""One prompt convention: data prep, GRPO rollouts and the eval render the same prompt for the
same (question, language) — the prompts a model trains on are the prompts it is judged on."""

from __future__ import annotations

import json

import pytest

from core.harmony import task_instructions
from core.languages import LANGUAGE_NAMES, LanguageLabels
from data_prep.labels import RowLabels
from data_prep.records import build_record, content_key
from data_prep.validate import ValidRow
from eval.eval_config import DEFAULT_PERSONA, EvalConfig
from eval.runner import load_questions, question_prompt
from trainer.grpo.prompts import load_prompts


class _CharTokenizer:
    """Enough of a tokenizer for load_prompts: one id per character."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(ch) for ch in text]}


@pytest.mark.parametrize("language", ["en", "fr", "de", "es", "it"])
def test_data_prep_grpo_and_eval_render_the_same_prompt(tmp_path, language: str) -> None:
    question = next(q for q in load_questions() if q.language == language)
    name = LANGUAGE_NAMES[language]
    row = ValidRow(name, DEFAULT_PERSONA, question.question, "…", "…")
    labels = RowLabels(LanguageLabels(language, language), language, "user")
    record = build_record(row, labels, "test:1", content_key(row), "medium")
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps(record) + "\n", encoding="utf-8")
    (grpo_prompt,) = load_prompts(train, _CharTokenizer(), max_prompt_tokens=10_000)

    instructions, eval_prompt = question_prompt(question, EvalConfig())

    assert record["prompt"] == grpo_prompt.text == eval_prompt
    assert record["messages"][0]["content"] == instructions
    assert grpo_prompt.label == language
    # both languages are always named (the reference recipe's convention)
    assert instructions.startswith(f"reasoning language: {name}\nanswer language: {name}\n\n")


def test_answer_language_is_named_when_it_differs_from_the_reasoning() -> None:
    text = task_instructions("French", "English", "You are terse.")
    assert text == "reasoning language: French\nanswer language: English\n\nYou are terse."
