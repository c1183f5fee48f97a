"""The KFP UI's views of the eval: ``ClassificationMetrics`` and ``Metrics`` artifacts, read
back from a kfp.local run of the real ``evaluate`` component (issue #18)."""

import json

import pytest
from kfp import dsl, local

from components.evaluate import evaluate
from components.models import base_model
from eval.eval_metrics import DETECTED_COLUMNS

# the components name the project's images; here they run in this Python (as in the demo)
pytestmark = pytest.mark.filterwarnings("ignore:.*custom or non-Python base image")
TINY = {"vocab_size": 600, "hidden_size": 64, "intermediate_size": 64, "seed": 0}
EVAL = {"limit": 5, "sampling": {"max_tokens": 8, "n": 1}, "device": "cpu"}


@dsl.pipeline
def eval_two_models():
    model = base_model(source="tiny", tiny_config=TINY)
    evaluate(base_model=model.outputs["model"], sft_model=model.outputs["model"], config=EVAL)


def _artifacts(task_dir) -> dict[str, dict]:
    """name → metadata, from the executor output kfp.local keeps in the task's directory."""
    output = json.loads((task_dir / "executor_output.json").read_text())
    return {name: a["artifacts"][0].get("metadata", {}) for name, a in output["artifacts"].items()}


@pytest.mark.slow  # ~40 s (two kfp.local tasks); test_eval_gate's component test is the fast one
def test_eval_publishes_confusion_matrices_and_headline_metrics(tmp_path):
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path))
    eval_two_models()
    (task_dir,) = tmp_path.glob("*/evaluate")
    artifacts = _artifacts(task_dir)
    for model in ("base", "sft"):
        for part in ("reasoning", "answer"):
            matrix = artifacts[f"{model}_{part}_language"]["confusionMatrix"]
            assert [c["displayName"] for c in matrix["annotationSpecs"]] == list(DETECTED_COLUMNS)
            rows = [row["row"] for row in matrix["rows"]]
            assert len(rows) == len(DETECTED_COLUMNS) and all(len(r) == len(rows) for r in rows)
            assert sum(map(sum, rows)) == 5  # one count per question
            assert not any(map(sum, rows[5:]))  # no question requests other / und / missing / loop
    assert not artifacts.get("grpo_answer_language")  # no GRPO model: left empty
    scalars = artifacts["metrics"]
    assert {"base/mean_reward", "sft/answer_language_accuracy"} <= set(scalars)
    assert 0.0 <= scalars["sft/both_language_accuracy"] <= 1.0
