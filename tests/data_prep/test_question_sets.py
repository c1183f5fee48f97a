"""Question sets mixed into GRPO's prompts (data_prep/question_sets.py)."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import read_jsonl

from data_prep.config import DataPrepConfig, QuestionSetConfig
from data_prep.prepare import prepare_dataset
from trainer.grpo.prompts import Prompt, load_prompts, step_prompts
from trainer.sft.data import load_examples

QUESTIONS = [
    {"q": "Combien de jours y a-t-il dans une année bissextile ?", "lang": "fr"},
    {"q": "Wie viele Beine hat eine Spinne normalerweise?", "lang": "German"},
    {"q": "¿Cuántos minutos tiene un día completo?", "lang": "es"},
    {"q": "Quanti secondi ci sono in un'ora?", "lang": "it"},
    {"q": "How many sides does a hexagon have?", "lang": "en"},
    {"q": "Combien de jours y a-t-il dans une année bissextile ?", "lang": "fr"},  # repeat
    {"q": "Quantos dias tem uma semana?", "lang": "pt"},  # not a trained language
    {"other": "no question column"},
]


def _prepare(tmp_path, sets: list[QuestionSetConfig]):
    out = tmp_path / "out"
    report = prepare_dataset(
        DataPrepConfig(workers=1, question_sets=sets),
        out / "train.jsonl",
        out / "eval.jsonl",
        out / "quarantine.jsonl",
        out / "card.md",
    )
    return report, out


def test_questions_become_prompt_only_train_rows_labelled_by_language(tmp_path) -> None:
    source = tmp_path / "questions.jsonl"
    source.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in QUESTIONS))
    # two of eight rows are bad on purpose (a repeat is not counted as lost)
    sets = [
        QuestionSetConfig(
            source=str(source), question_column="q", language_column="lang", max_bad_fraction=0.25
        )
    ]
    report, out = _prepare(tmp_path, sets)

    train = read_jsonl(out / "train.jsonl")
    prompt_only = [r for r in train if r.get("prompt_only")]
    assert report.prompt_only_rows == len(prompt_only) == 5
    assert [r["label"] for r in prompt_only] == ["fr", "de", "es", "it", "en"]
    assert all("answer language: " in r["prompt"] for r in prompt_only)
    assert not any(r.get("prompt_only") for r in read_jsonl(out / "eval.jsonl"))
    # the three bad rows are quarantined with their reason; nothing is lost
    quarantine = [r for r in read_jsonl(out / "quarantine.jsonl") if "questions[0]" in r["origin"]]
    assert Counter(r["reason"] for r in quarantine) == {
        "duplicate": 1,
        "unknown_language": 1,
        "missing_field": 1,
    }
    assert report.question_rows_bad == 3
    assert "prompt-only train rows (question sets, GRPO only): 5" in (out / "card.md").read_text()


def test_detected_language_and_parquet_and_max_rows(tmp_path) -> None:
    table = pa.table({"text": [q["q"] for q in QUESTIONS[:5]]})
    pq.write_table(table, tmp_path / "questions.parquet")
    sets = [QuestionSetConfig(source=str(tmp_path / "questions.parquet"), question_column="text")]
    report, out = _prepare(tmp_path, sets)
    labels = [r["label"] for r in read_jsonl(out / "train.jsonl") if r.get("prompt_only")]
    assert labels == ["fr", "de", "es", "it", "en"]
    capped = [
        QuestionSetConfig(
            source=str(tmp_path / "questions.parquet"), question_column="text", max_rows=2
        )
    ]
    report, _ = _prepare(tmp_path / "capped", capped)
    assert report.prompt_only_rows == 2


def test_sft_skips_prompt_only_rows_and_grpo_reads_their_weight(tmp_path) -> None:
    source = tmp_path / "questions.jsonl"
    source.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in QUESTIONS[:5]))
    sets = [QuestionSetConfig(source=str(source), question_column="q", weight=3.0)]
    report, out = _prepare(tmp_path, sets)

    class Chars:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    examples, stats = load_examples(out / "train.jsonl", Chars(), max_seq_len=100_000)
    assert stats.prompt_only == 5 and len(examples) == report.train_rows + report.synthetic_rows
    prompts = load_prompts(out / "train.jsonl", Chars(), max_prompt_tokens=100_000)
    weights = Counter(p.weight for p in prompts)
    assert weights[3.0] == 5 and weights[1.0] == report.train_rows


def _prompts(weights: list[float]) -> list[Prompt]:
    return [Prompt([i], "en", str(i), w) for i, w in enumerate(weights)]


def test_equal_weights_walk_epochs_covering_every_prompt() -> None:
    prompts = _prompts([1.0] * 12)
    first_epoch = [i for step in range(3) for i in step_prompts(prompts, step, 4, seed=7)]
    assert sorted(first_epoch) == list(range(12))
    assert step_prompts(prompts, 5, 4, 7) == step_prompts(prompts, 5, 4, 7)  # resumable


def test_weights_set_how_often_prompts_are_drawn() -> None:
    prompts = _prompts([1.0] * 20 + [4.0] * 20)
    drawn = Counter(i for step in range(400) for i in step_prompts(prompts, step, 4, seed=1))
    light = sum(drawn[i] for i in range(20))
    heavy = sum(drawn[i] for i in range(20, 40))
    assert all(len(set(step_prompts(prompts, s, 4, 1))) == 4 for s in range(50))  # distinct
    assert 3.0 < heavy / light < 5.5  # ~4x, less at the top end (without replacement)


def test_bad_weight_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "p", "label": "en", "prompt_weight": -1}) + "\n")
    with pytest.raises(ValueError, match="train.jsonl:1: prompt_weight"):
        load_prompts(path, lambda t, add_special_tokens=False: {"input_ids": [1]}, 10)


def test_in_language_filter_keeps_only_the_deployed_task(tmp_path) -> None:
    rows = [
        {"prompt": "a", "label": "fr", "user_language": "fr", "reasoning_language": "fr",
         "answer_language": "fr"},
        {"prompt": "b", "label": "fr/en", "user_language": "en", "reasoning_language": "fr",
         "answer_language": "en"},
        {"prompt": "c", "label": "de", "user_language": "en", "reasoning_language": "de",
         "answer_language": "de"},
    ]  # fmt: skip
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = lambda t, add_special_tokens=False: {"input_ids": [1]}  # noqa: E731
    assert [p.text for p in load_prompts(path, tokenizer, 10)] == ["a", "b", "c"]
    assert [p.text for p in load_prompts(path, tokenizer, 10, "in-language")] == ["a"]
    path.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="1 left out by prompt_filter=in-language"):
        load_prompts(path, tokenizer, 10, "in-language")


def _write_questions(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("columns", "named"),
    [
        ({"question_column": "question", "language_column": "lang"}, "'question' (question_"),
        ({"question_column": "q", "language_column": "language"}, "'language' (language_"),
    ],
)
def test_a_column_that_does_not_exist_fails_naming_it_and_the_columns_there_are(
    tmp_path, columns, named
) -> None:
    from core.atomic import record_output_files
    from data_prep.question_sets import QuestionSetError

    # issue #32 item 6: on main every row was quarantined and the step exited 0
    source = _write_questions(tmp_path / "questions.jsonl", QUESTIONS[:5])
    out = tmp_path / "out"
    (out / "train.jsonl").parent.mkdir()
    (out / "train.jsonl").write_text("an earlier run's\n")
    record_output_files([out / "train.jsonl"])  # an earlier prep's own output
    with pytest.raises(QuestionSetError) as e:
        _prepare(tmp_path, [QuestionSetConfig(source=str(source), **columns)])
    message = str(e.value)
    assert f"question_sets[0] ({source})" in message and f"no row has the column {named}" in message
    assert "the columns are: lang, q" in message
    # the rejected rows can be inspected; nothing complete-looking is left beside them
    assert len(read_jsonl(out / "quarantine.jsonl")) == 5
    assert not (out / "train.jsonl").exists() and not (out / "eval.jsonl").exists()


def test_a_set_that_loses_more_than_its_share_or_gives_nothing_fails(tmp_path) -> None:
    from data_prep.question_sets import QuestionSetError

    rows = QUESTIONS[:5] + [{"q": "Quantos dias tem uma semana?", "lang": "pt"}]  # 1 of 6 lost
    source = _write_questions(tmp_path / "questions.jsonl", rows)
    sets = [QuestionSetConfig(source=str(source), question_column="q", language_column="lang")]
    with pytest.raises(QuestionSetError, match=r"1 of 6 rows quarantined \(16.7% > max_bad"):
        _prepare(tmp_path / "a", sets)
    allowed = [sets[0].model_copy(update={"max_bad_fraction": 0.2})]
    assert _prepare(tmp_path / "b", allowed)[0].prompt_only_rows == 5
    empty = _write_questions(tmp_path / "empty.jsonl", [])
    with pytest.raises(QuestionSetError, match=r"no usable question in 0 rows"):
        _prepare(tmp_path / "c", [QuestionSetConfig(source=str(empty), question_column="q")])


def test_the_cli_summary_counts_the_quarantined_question_rows(tmp_path) -> None:
    # on main the summary said "0 quarantined" with question rows in the quarantine file
    from typer.testing import CliRunner

    from pipelines.cli import app

    source = _write_questions(tmp_path / "questions.jsonl", QUESTIONS)
    question_set = json.dumps(
        [
            {
                "source": str(source),
                "question_column": "q",
                "language_column": "lang",
                "max_bad_fraction": 0.5,
            }
        ]
    )
    result = CliRunner().invoke(
        app,
        [
            "data-prep",
            "-o",
            str(tmp_path / "out"),
            "--set",
            "data_prep.augment_factor=0",
            "--set",
            f"data_prep.question_sets={question_set}",
        ],
    )
    assert result.exit_code == 0, result.output
    quarantined = len(read_jsonl(tmp_path / "out" / "quarantine.jsonl"))
    assert quarantined == 3
    assert "(+5 question-set prompts)" in result.output
    assert f" eval, {quarantined} quarantined" in result.output
