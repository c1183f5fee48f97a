"""Plug the language-compliance scorer into the RL engines people use.

One scorer (``reward.scoring.ComplianceScorer``), four call conventions:

* our GRPO trainer: ``LanguageComplianceReward()(responses, labels, expected_answers)``
  returns a ``RewardBatch`` (rewards + per-response results);
* OpenRLHF: ``--remote_rm_url <path of this file>`` picks up :func:`reward_func`
  (``reward_func(queries, prompts, labels, **kwargs)``), with ``--label_key`` naming the
  column that holds the label string;
* verl: ``custom_reward_function.path=<path of this file>`` and
  ``custom_reward_function.name=compute_score`` (``compute_score(data_source, solution_str,
  ground_truth, extra_info=None)``), with the label string as ``ground_truth``;
* TRL: ``GRPOTrainer(reward_funcs=[language_compliance_reward], ...)`` with a ``label``
  column (or ``reasoning_language`` and ``answer_language`` columns) in the dataset.

Labels are ``"fr"`` (reasoning and answer both French) or ``"fr/en"`` (reasoning French,
answer English), as written by ``LanguageLabels.to_label()``. A label may also be a mapping
``{"label": "fr/en", "expected_answer": 42}`` where an engine carries one label object.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.parsing import ParsedResponse, ResponseFormat, parse_response
from reward.labels import LabelsLike
from reward.scoring import ComplianceResult, ComplianceScorer

_scorer: ComplianceScorer | None = None


def default_scorer() -> ComplianceScorer:
    """The process-wide scorer with the reference weights (built on first use)."""
    global _scorer
    if _scorer is None:
        _scorer = ComplianceScorer()
    return _scorer


# -- our GRPO trainer ------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardBatch:
    """Rewards of one rollout batch, with what was found in each response."""

    rewards: list[float]
    results: list[ComplianceResult]


@dataclass
class LanguageComplianceReward:
    """The GRPO trainer's reward: a batched call over responses and their labels.

    Args:
        scorer: The scorer; default: the reference weights.
    """

    scorer: ComplianceScorer = field(default_factory=default_scorer)

    @property
    def bounds(self) -> tuple[float, float]:
        """Smallest and largest reward."""
        return self.scorer.bounds

    def __call__(
        self,
        responses: Sequence[str | ParsedResponse | None],
        labels: LabelsLike | Sequence[LabelsLike],
        expected_answers: Sequence[float | str | None] | None = None,
        prompts: Sequence[str | None] | None = None,
    ) -> RewardBatch:
        """Score a rollout batch; see ``ComplianceScorer.score_batch``."""
        results = self.scorer.score_batch(responses, labels, expected_answers, prompts)
        return RewardBatch([r.reward for r in results], results)


# -- OpenRLHF --------------------------------------------------------------------------------


def _split_label(label: object) -> tuple[object, object]:
    """(labels, expected answer) from a label string or a ``{"label", "expected_answer"}``."""
    if isinstance(label, Mapping):
        return label, label.get("expected_answer")
    return label, None


def openrlhf_reward_func(
    queries: Sequence[str], prompts: Sequence[str], labels: Sequence[object], **kwargs: Any
) -> dict[str, Any]:
    """OpenRLHF remote reward function.

    Args:
        queries: Prompt + response texts (decoded as OpenRLHF decodes them).
        prompts: The prompts; stripped from the front of each query when they match.
        labels: One label per query (the ``--label_key`` column).
        **kwargs: Ignored (newer OpenRLHF versions pass more).

    Returns:
        ``{"rewards": 1-d float tensor, "scores": 1-d tensor of rewards scaled to [0, 1],
        "extra_logs": {metric: 1-d tensor}}``. Every tensor is 1-d (OpenRLHF ``torch.cat``s
        them), even for a batch of one.
    """
    try:
        import torch
    except ImportError as err:  # pragma: no cover - torch is a base dependency
        raise ImportError("the OpenRLHF adapter needs torch (a base dependency)") from err
    scorer = default_scorer()
    responses: list[str] = []
    for index, query in enumerate(queries):
        prompt = prompts[index] if index < len(prompts) else None
        if isinstance(query, str) and isinstance(prompt, str) and query.startswith(prompt):
            query = query[len(prompt) :]
        responses.append(query)
    pairs = [_split_label(label) for label in labels]
    asked = [prompts[i] if i < len(prompts) else None for i in range(len(responses))]
    results = scorer.score_batch(
        responses,
        [p[0] for p in pairs],  # type: ignore[misc]
        [p[1] for p in pairs],  # type: ignore[misc]
        asked,
    )
    low, high = scorer.bounds
    span = (high - low) or 1.0
    rewards = torch.tensor([r.reward for r in results], dtype=torch.float32).reshape(-1)
    scores = ((rewards - low) / span).clamp(0.0, 1.0).reshape(-1)
    rows = [r.metrics() for r in results]
    keys = [k for k in (rows[0] if rows else {}) if k != "reward"]
    extra_logs = {
        k: torch.tensor([row[k] for row in rows], dtype=torch.float32).reshape(-1)
        for k in keys
        if not any(math.isnan(row[k]) for row in rows)
    }
    return {"rewards": rewards, "scores": scores, "extra_logs": extra_logs}


reward_func = openrlhf_reward_func
"""The name OpenRLHF looks up in the file given to ``--remote_rm_url``."""


# -- verl ------------------------------------------------------------------------------------


def verl_compute_score(
    data_source: str | None,
    solution_str: str,
    ground_truth: object,
    extra_info: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    """verl custom reward function.

    Args:
        data_source: Ignored (the same rules apply to every source).
        solution_str: The decoded response.
        ground_truth: The label string (``"fr"`` / ``"fr/en"``) or a label mapping.
        extra_info: May hold ``expected_answer``.
        **kwargs: Ignored.

    Returns:
        ``{"score": reward, ...}`` plus the same float metrics for every call (verl
        collects the extra keys across the batch): ``correct`` is 0.0 when not judged, and
        ``answer_judged`` says whether it was.
    """
    label, expected = _split_label(ground_truth)
    if expected is None and isinstance(extra_info, Mapping):
        expected = extra_info.get("expected_answer")
    result = default_scorer().score(solution_str, label, expected)  # type: ignore[arg-type]
    metrics = result.metrics()
    judged = not math.isnan(metrics["correct"])
    metrics["correct"] = metrics["correct"] if judged else 0.0
    metrics["answer_judged"] = float(judged)
    score = metrics.pop("reward")
    return {"score": score, **metrics}


compute_score = verl_compute_score
"""The default name verl's ``custom_reward_function.name`` looks up."""


# -- TRL -------------------------------------------------------------------------------------


def _completion_to_response(completion: object) -> str | ParsedResponse | None:
    """A TRL completion (a string, or a list of message dicts) as something to score."""
    if isinstance(completion, str) or completion is None:
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    if not isinstance(completion, Sequence):
        return None
    messages = [m for m in completion if isinstance(m, Mapping)]
    assistant = [m for m in messages if m.get("role", "assistant") == "assistant"]
    if not assistant:
        return None
    last = assistant[-1]
    content = last.get("content")
    content = content if isinstance(content, str) else ""
    thinking = next(
        (last[k] for k in ("thinking", "reasoning_content", "reasoning") if last.get(k)), None
    )
    if isinstance(thinking, str):
        final = parse_response(content).final if content else None
        return ParsedResponse(
            ResponseFormat.HARMONY,
            reasoning=thinking.strip(),
            final=final,
            analysis_blocks=1,
            truncated=final is None,
        )
    return content


def _trl_labels(n: int, kwargs: Mapping[str, Any]) -> list[object]:
    if "label" in kwargs or "labels" in kwargs:
        column = kwargs["label"] if "label" in kwargs else kwargs["labels"]
        return list(column)
    if "reasoning_language" in kwargs and "answer_language" in kwargs:
        return [
            {"reasoning": r, "answer": a}
            for r, a in zip(kwargs["reasoning_language"], kwargs["answer_language"], strict=True)
        ]
    if "language" in kwargs:
        return list(kwargs["language"])
    raise ValueError(
        "language_compliance_reward needs a dataset column 'label' ('fr' or 'fr/en'), or "
        f"'reasoning_language' and 'answer_language'; got columns {sorted(kwargs)} "
        f"for {n} completions"
    )


def language_compliance_reward(
    prompts: Sequence[object], completions: Sequence[object], **kwargs: Any
) -> list[float]:
    """TRL reward function (``GRPOTrainer(reward_funcs=[language_compliance_reward])``).

    Args:
        prompts: Ignored.
        completions: Strings, or (conversational datasets) lists of message dicts whose
            assistant message has ``content`` and optionally ``thinking`` /
            ``reasoning_content``.
        **kwargs: Dataset columns: ``label`` (or ``reasoning_language`` + ``answer_language``,
            or ``language``) and optionally ``expected_answer``.

    Returns:
        One float reward per completion.

    Raises:
        ValueError: No label column (a configuration error, raised on the first batch).
    """
    labels = _trl_labels(len(completions), kwargs)
    expected = kwargs.get("expected_answer")
    expected_list = list(expected) if expected is not None else None
    responses = [_completion_to_response(c) for c in completions]
    results = default_scorer().score_batch(responses, labels, expected_list)  # type: ignore[arg-type]
    return [r.reward for r in results]
