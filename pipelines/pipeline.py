"""The lingo-rl pipeline: the DAG of components.

Parameters default to the typed step configs (``DataPrepConfig()`` …); a preset's values are
passed as arguments by ``lingo run --local`` and ``lingo compile --preset``. Data prep's fields
are one parameter each, ``data_<field>``, written from ``DataPrepConfig`` (a new field needs no
edit here); the other steps' configs are one dict parameter each.
"""

from kfp import dsl

from cluster.config import ExecutionConfig
from components.config_fields import config_dict, with_config_parameters
from components.data_prep import data_prep
from components.evaluate import evaluate, gate, register
from components.grpo import grpo, grpo_megatron
from components.megatron import convert_megatron, export_hf
from components.models import base_model, capacity_check, sft
from components.tracking import finalize, publish, start_tracking
from data_prep.config import DataPrepConfig
from eval.eval_config import EvalConfig
from eval.gate import GateConfig
from pipelines.platform import ClusterSettings, get_platform, with_platform
from pipelines.presets import DATA_PREP_PREFIX, ModelSource, Preset, megatron_layout
from trainer.grpo.config import GRPOConfig
from trainer.sft.config import SFTConfig

PIPELINE_NAME = "lingo-rl"
_MODEL = ModelSource()
_TINY_DEFAULT = config_dict(_MODEL.tiny)
_SFT_DEFAULT = config_dict(SFTConfig())
_GRPO_DEFAULT = config_dict(GRPOConfig())
_EVAL_DEFAULT = config_dict(EvalConfig())
_GATE_DEFAULT = config_dict(GateConfig())
_HARDWARE_DEFAULT = config_dict(Preset.model_fields["hardware"].default)
_BACKEND_DEFAULT = Preset.model_fields["backend"].default
_LOCAL_EXECUTION = config_dict(ExecutionConfig())
_MEGATRON_LAYOUT_DEFAULT = megatron_layout(Preset(name="default", description=""))


MAIN_OUTPUTS: dict[str, tuple[str, str]] = {
    "train_data": ("data-prep", "train_data"),
    "eval_data": ("data-prep", "eval_data"),
    "dataset_card": ("data-prep", "card"),
    "sft_model": ("sft", "model"),
    "sft_report": ("sft", "loss_plot"),
    "grpo_model": ("export-hf", "model"),
    "grpo_report": ("grpo", "report"),
    "eval_report": ("evaluate", "report"),
    "eval_report_html": ("evaluate", "report_html"),
    "eval_results": ("evaluate", "results"),
}
"""The artifacts a user opens first: name → (task, output). The pipeline returns no outputs
(KFP allows none from inside the exit handler's group); ``lingo run --local`` finds these
under the run's directory."""


def build_pipeline(platform_settings: ClusterSettings | None = None):
    """The pipeline with Kubernetes platform settings applied to its tasks (none: local)."""
    settings = platform_settings or get_platform("local")
    platform = with_platform(settings)

    @dsl.pipeline(
        name=PIPELINE_NAME,
        description=(
            "GRPO post-training of gpt-oss to reason and answer in the user's language: "
            "data prep → SFT → GRPO → eval."
        ),
    )
    @with_config_parameters(DataPrepConfig(), prefix=DATA_PREP_PREFIX, param="data_prep_fields")
    def lingo_pipeline(
        data_prep_fields: dict,  # DataPrepConfig's fields: data_<field>, with_config_parameters
        model_source: str = _MODEL.source,
        model_tiny_config: dict = _TINY_DEFAULT,
        sft_config: dict = _SFT_DEFAULT,
        grpo_config: dict = _GRPO_DEFAULT,
        eval_config: dict = _EVAL_DEFAULT,
        gate_config: dict = _GATE_DEFAULT,
        hardware: dict = _HARDWARE_DEFAULT,
        layout_overrides: dict = {},  # noqa: B006 (KFP reads the default; never mutated)
        backend: str = _BACKEND_DEFAULT,
        megatron_layout: dict = _MEGATRON_LAYOUT_DEFAULT,
        megatron_optim: dict = {},  # noqa: B006 (KFP reads the default; never mutated)
        sft_execution: dict = _LOCAL_EXECUTION,
        grpo_execution: dict = _LOCAL_EXECUTION,
        mlflow_tracking_uri: str = "",
        mlflow_experiment: str = "",
        export_uri: str = "",
    ):
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER

        def step(task, display_name: str, name: str):
            """``task``, shown as ``display_name``, with the platform's settings of step
            ``name``."""
            task.set_display_name(display_name)
            platform(task, name)
            return task

        cleanup = finalize(
            pipeline_run_id=run_id,
            mlflow_tracking_uri=mlflow_tracking_uri,
            mlflow_experiment=mlflow_experiment,
            delete_jobs=settings.training_jobs,
        )
        step(cleanup, "finalize: jobs, MLflow run", "finalize")
        with dsl.ExitHandler(cleanup, name="lingo-rl"):
            # the run as the pipeline run records it and as the capacity check estimates it
            run = dict(hardware=hardware, sft_config=sft_config, grpo_config=grpo_config)
            tracking = start_tracking(
                pipeline_run_id=run_id,
                pipeline_run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
                data_source=data_prep_fields["source"],
                model_source=model_source,
                **run,
                mlflow_tracking_uri=mlflow_tracking_uri,
                mlflow_experiment=mlflow_experiment,
            )
            step(tracking, "MLflow run", "start-tracking")
            # each step's MLflow run nests under the pipeline's
            tracked = dict(
                mlflow_tracking_uri=mlflow_tracking_uri, mlflow_parent_run_id=tracking.output
            )
            prep = step(data_prep(**data_prep_fields, **tracked), "data prep", "data-prep")
            base = step(
                base_model(source=model_source, tiny_config=model_tiny_config),
                "base model",
                "base-model",
            )
            capacity = capacity_check(
                base_model=base.outputs["model"],
                **run,
                overrides=layout_overrides,
                sft_execution=sft_execution,
                grpo_execution=grpo_execution,
                backend=backend,
                megatron_layout=megatron_layout,
                megatron_optim=megatron_optim,
            )
            step(capacity, "capacity check", "capacity-check")

            def training_inputs(config, execution) -> dict:
                """What both training steps take besides their input model."""
                return dict(
                    train_data=prep.outputs["train_data"],
                    eval_data=prep.outputs["eval_data"],
                    config=config,
                    execution=execution,
                    pipeline_run_id=run_id,
                    **tracked,
                )

            tuned = sft(
                base_model=base.outputs["model"], **training_inputs(sft_config, sft_execution)
            )
            step(tuned, "SFT + merge", "sft").after(capacity)

            def export_and_evaluate(policy_checkpoint, source_format: str) -> None:
                """Both branches end in export_hf (a standard sharded HF directory with the
                SFT model's tokenizer and chat template, checked to load), then eval."""
                exported = export_hf(
                    checkpoint=policy_checkpoint,
                    template_model=tuned.outputs["model"],
                    source_format=source_format,
                )
                step(exported, "export to HF", "export-hf")
                evaluate_and_promote(exported.outputs["model"])

            def evaluate_and_promote(policy_model) -> None:
                """eval → gate → register, and publish: in each backend's branch (kfp.local
                2.17 cannot resolve a dsl.OneOf of artifacts, so the branches do not merge)."""
                evaluation = evaluate(
                    base_model=base.outputs["model"],
                    sft_model=tuned.outputs["model"],
                    grpo_model=policy_model,
                    config=eval_config,
                    **tracked,
                )
                step(evaluation, "eval: base vs SFT vs GRPO", "evaluate")
                results = evaluation.outputs["results"]
                with dsl.If(export_uri != "", name="export-to-object-storage"):
                    published = publish(
                        grpo_model=policy_model,
                        eval_results=results,
                        eval_report=evaluation.outputs["report"],
                        export_uri=export_uri,
                        pipeline_run_id=run_id,
                    )
                    step(published, "publish to object storage", "publish")
                decision = gate(
                    results=results, grpo_model=policy_model, config=gate_config, **tracked
                )
                step(decision, "promotion gate", "gate")
                with dsl.If(decision.outputs["Output"] == "promote", name="beats-champion"):
                    registered = register(
                        results=results, grpo_model=policy_model, config=gate_config, **tracked
                    )
                    step(registered, "register champion", "register")

            grpo_inputs = dict(  # the same GRPO inputs on both branches
                sft_model=tuned.outputs["model"], **training_inputs(grpo_config, grpo_execution)
            )
            # named for what runs: GRPO on the HF weights (grpo.optim.backend: torch or
            # deepspeed), or on a Megatron checkpoint
            with dsl.If(backend != "megatron", name="grpo-on-hf-weights"):
                hf_policy = step(grpo(**grpo_inputs), "GRPO", "grpo")
                export_and_evaluate(hf_policy.outputs["model"], "hf")
            with dsl.Else(name="grpo-on-megatron"):
                converted = convert_megatron(
                    hf_model=tuned.outputs["model"], layout=megatron_layout
                )
                step(converted, "convert to Megatron + precision check", "convert-megatron")
                megatron_policy = grpo_megatron(
                    **grpo_inputs,
                    backend="megatron",
                    megatron_checkpoint=converted.outputs["megatron_model"],
                    megatron_layout=megatron_layout,
                    megatron_optim=megatron_optim,
                )
                step(megatron_policy, "GRPO (Megatron)", "grpo")
                export_and_evaluate(megatron_policy.outputs["model"], "megatron")

    return lingo_pipeline


lingo_pipeline = build_pipeline()
"""The pipeline without platform settings: what ``lingo run --local`` and the kept YAML use."""
