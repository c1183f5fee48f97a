"""The lingo-rl pipeline: the DAG of components.

Parameters default to the typed step configs (``DataPrepConfig()`` …); a preset's values are
passed as arguments by ``lingo run --local`` and ``lingo compile --preset``.
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Markdown

from components.data_prep import data_prep
from data_prep.config import DataPrepConfig

PIPELINE_NAME = "lingo-rl"
_DATA = DataPrepConfig()


class PipelineOutputs(NamedTuple):
    """What a run hands back (the artifacts a user opens first)."""

    train_data: Dataset
    eval_data: Dataset
    dataset_card: Markdown


@dsl.pipeline(
    name=PIPELINE_NAME,
    description=(
        "GRPO post-training of gpt-oss to reason and answer in the user's language: "
        "data prep → SFT → GRPO → eval."
    ),
)
def lingo_pipeline(
    data_source: str = _DATA.source,
    data_hub_split: str = _DATA.hub_split,
    data_eval_fraction: float = _DATA.eval_fraction,
    data_seed: int = _DATA.seed,
    data_max_bad_fraction: float = _DATA.max_bad_fraction,
    data_answer_language_policy: str = _DATA.answer_language_policy,
    data_max_field_chars: int = _DATA.max_field_chars,
    data_reasoning_effort: str = _DATA.reasoning_effort,
    data_workers: int = _DATA.workers,
) -> PipelineOutputs:
    prep = data_prep(
        source=data_source,
        hub_split=data_hub_split,
        eval_fraction=data_eval_fraction,
        seed=data_seed,
        max_bad_fraction=data_max_bad_fraction,
        answer_language_policy=data_answer_language_policy,
        max_field_chars=data_max_field_chars,
        reasoning_effort=data_reasoning_effort,
        workers=data_workers,
    )
    prep.set_display_name("data prep")
    return PipelineOutputs(
        train_data=prep.outputs["train_data"],
        eval_data=prep.outputs["eval_data"],
        dataset_card=prep.outputs["card"],
    )
