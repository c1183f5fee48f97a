"""KFP components: the 50-question eval, the promotion gate and the registration.

``gate`` only reads the registry and returns the decision as a plain ``str`` for
``dsl.If(gate_task.output == "promote")`` (a single output: kfp.local 2.17 cannot resolve a
condition on a named output of a multi-output task); ``register`` does
the registry writes and decides again first, so it never promotes a model that stopped
beating the champion between the two steps. MLflow is reached through
``MLFLOW_TRACKING_URI`` (set on the task, or passed as ``mlflow_tracking_uri``).
"""

from kfp import dsl
from kfp.dsl import HTML, Artifact, ClassificationMetrics, Input, Markdown, Metrics, Model, Output

from components.images import CPU_IMAGE, GPU_IMAGE


@dsl.component(base_image=GPU_IMAGE, install_kfp_package=False)
def evaluate(
    base_model: Input[Model],
    sft_model: Input[Model],
    config: dict,
    results: Output[Artifact],
    report: Output[Markdown],
    report_html: Output[HTML],
    metrics: Output[Metrics],
    base_reasoning_language: Output[ClassificationMetrics],
    base_answer_language: Output[ClassificationMetrics],
    sft_reasoning_language: Output[ClassificationMetrics],
    sft_answer_language: Output[ClassificationMetrics],
    grpo_reasoning_language: Output[ClassificationMetrics],
    grpo_answer_language: Output[ClassificationMetrics],
    grpo_model: Input[Model] = None,
    champion_model: Input[Model] = None,
    mlflow_tracking_uri: str = "",
    mlflow_parent_run_id: str = "",
):
    """Run base, SFT (and GRPO, and the registry's champion when there is one) side by side
    over the eval set, with the same questions, samples and seeds; publish results and reports.

    The KFP UI shows ``metrics`` (every model's overall figures) and, per model, the
    requested → detected language confusion matrices of the reasoning and the answer.
    """
    from core.processes import start_step_process
    from core.tracking import configure_tracking
    from eval.eval_step import champion_location, run_eval_step
    from eval.report import kfp_confusion_matrices, load_results

    start_step_process()  # dies with its parent; every log line redacted
    configure_tracking(mlflow_tracking_uri, mlflow_parent_run_id)
    models = {
        "base": base_model.path,
        "sft": sft_model.path,
        "grpo": grpo_model.path if grpo_model is not None else None,
        "champion": champion_location(champion_model.path if champion_model else None),
    }
    scalars = run_eval_step(models, config, results.path, report.path, report_html.path)
    for name, value in scalars.items():
        metrics.log_metric(name, value)
    results.metadata.update(format="json", models=[k for k, v in models.items() if v])
    matrices = kfp_confusion_matrices(load_results(results.path))
    for name, artifact in {
        "base_reasoning_language": base_reasoning_language,
        "base_answer_language": base_answer_language,
        "sft_reasoning_language": sft_reasoning_language,
        "sft_answer_language": sft_answer_language,
        "grpo_reasoning_language": grpo_reasoning_language,
        "grpo_answer_language": grpo_answer_language,
    }.items():
        if name in matrices:  # no GRPO model: its two stay empty
            artifact.log_confusion_matrix(*matrices[name])


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def champion(config: dict, model: Output[Model], mlflow_tracking_uri: str = "") -> str:
    """The registry's champion (``config``: the gate's: model name and alias), downloaded for
    the eval; returns its version ("" when there is none: ``model`` then holds only a
    ``NO_CHAMPION`` file). Never served from cache: the alias moves."""
    from core.processes import start_step_process
    from core.tracking import configure_tracking
    from eval.eval_step import run_champion_step

    start_step_process()  # dies with its parent; every log line redacted
    configure_tracking(mlflow_tracking_uri)
    version = run_champion_step(config, model.path)
    model.metadata.update(version=version, format="huggingface" if version else "none")
    return version


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def gate(
    results: Input[Artifact],
    grpo_model: Input[Model],
    config: dict,
    report: Output[Markdown],
    mlflow_tracking_uri: str = "",
    mlflow_parent_run_id: str = "",
) -> str:
    """Decide whether the GRPO model beats the champion: returns ``promote``, ``keep``,
    ``unchanged`` or ``skipped`` (the reason is in ``report``)."""
    from core.processes import start_step_process
    from core.tracking import configure_tracking
    from eval.eval_step import run_gate_step

    start_step_process()  # dies with its parent; every log line redacted
    configure_tracking(mlflow_tracking_uri, mlflow_parent_run_id)
    decision = run_gate_step(results.path, grpo_model.path, config, report.path, apply=False)
    return decision.decision.value


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def register(
    results: Input[Artifact],
    grpo_model: Input[Model],
    config: dict,
    report: Output[Markdown],
    data_fingerprint: str = "",
    mlflow_tracking_uri: str = "",
    mlflow_parent_run_id: str = "",
) -> str:
    """Register the GRPO model (tagged with ``data_fingerprint``) and move the champion
    alias to it when it (still) wins.

    Returns the version the alias points to afterwards ("" when nothing changed).
    """
    from core.processes import start_step_process
    from core.tracking import configure_tracking
    from eval.eval_step import run_gate_step

    start_step_process()  # dies with its parent; every log line redacted
    configure_tracking(mlflow_tracking_uri, mlflow_parent_run_id)
    decision = run_gate_step(
        results.path, grpo_model.path, config, report.path, apply=True,
        data_fingerprint=data_fingerprint,
    )  # fmt: skip
    return decision.registered_version or ""
