"""The lingo-rl pipeline: the DAG of components, built for one preset.

``build_pipeline(preset)`` is the preset's pipeline: its parameters are the preset's run form
(``pipelines.run_form``: the fields users change, defaulting to the preset's values, the run's
settings, ``overrides`` and the images), each described from ``describe_parameters``; the
preset itself travels whole as a constant of the first step, ``configure``, which applies the
form to it and hands every other step its config. Only the GRPO branches the preset names
(``grpo_branches``) are built.
"""

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from kfp import dsl
from kfp.dsl import pipeline_task

from components.data_prep import data_check, data_prep
from components.evaluate import champion, evaluate, gate, register
from components.grpo import grpo, grpo_megatron
from components.images import CPU_IMAGE, GPU_IMAGE, MEGATRON_IMAGE
from components.megatron import convert_megatron, export_hf
from components.models import base_model, capacity_check, sft
from components.serving import deploy
from components.tracking import finalize, publish, start_tracking
from pipelines.configure import configure
from pipelines.platform import ClusterSettings, get_platform, with_platform
from pipelines.presets import Preset, job_platform_json, preset_json
from pipelines.run_form import (
    IMAGE_FIELDS,
    RUN_FIELDS,
    field_value,
    form_fields,
)

PIPELINE_NAME = "lingo-rl"
DESCRIPTION = (
    "GRPO post-training of gpt-oss to reason and answer in the user's language: "
    "data prep → (new data?) SFT → GRPO → eval with the champion → gate → register, publish."
)
IMAGES = {"cpu_image": CPU_IMAGE, "gpu_image": GPU_IMAGE, "megatron_image": MEGATRON_IMAGE}
"""Each image parameter's default: the image ``components.images`` names (at compile time)."""


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


def pipeline_parameters(preset: Preset) -> list[inspect.Parameter]:
    """``preset``'s pipeline parameters, in the form's order: its form fields (the preset's
    values), the run fields, the images."""
    parameters = [(field.name, field_value(preset, field.path)) for field in form_fields(preset)]
    parameters += [(field.name, field.default) for field in RUN_FIELDS]
    parameters += list(IMAGES.items())
    return [
        inspect.Parameter(
            name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=value, annotation=type(value)
        )
        for name, value in parameters
    ]


def describe_parameters(preset: Preset) -> str:
    """The pipeline function's docstring: its ``Args:`` are the form's descriptions (KFP's
    compiler writes them into ``inputDefinitions.parameters.*.description``)."""
    described = {
        field.name: f"{field.description} (--set {field.path})" for field in form_fields(preset)
    }
    described |= {field.name: field.description for field in RUN_FIELDS}
    described |= IMAGE_FIELDS
    args = "\n".join(f"    {name}: {text}" for name, text in described.items())
    return f"{DESCRIPTION}\n\nArgs:\n{args}\n"


NEVER_CACHED = frozenset({"start-tracking", "finalize", "gate", "register", "publish"})
"""Steps whose work is a side effect or reads state no argument holds: the MLflow run (a cached
``start-tracking`` handed a second run the first run's finished MLflow run to nest under), the
registry's champion (``gate``, ``register``), the upload. KFP never reuses their outputs."""
INPUT_FINGERPRINT_ENV = "LINGO_INPUT_FINGERPRINT"
"""The environment variable that carries a step's input fingerprint (``build_pipeline``)."""


def build_pipeline(
    preset: Preset,
    platform_settings: ClusterSettings | None = None,
    input_fingerprints: dict[str, str] | None = None,
):
    """``preset``'s pipeline, with Kubernetes platform settings applied to its tasks (default:
    the preset's ``hardware.platform``'s).

    ``input_fingerprints``: step name → a fingerprint of the local files it reads
    (``pipelines.local_run.input_fingerprints``), set as the step's environment variable
    ``INPUT_FINGERPRINT_ENV``. kfp.local keys its cache on a task's arguments, command, image
    and container environment, not on the content of a path given as an argument: the
    fingerprint puts that content in the key. The steps in ``NEVER_CACHED`` are never cached."""
    settings = platform_settings or get_platform(preset.hardware.platform)
    platform = with_platform(settings)
    carried = preset_json(preset)
    fields = [field.name for field in form_fields(preset)]
    image_of = {image: name for name, image in IMAGES.items()}

    def lingo_pipeline(p: dict) -> None:
        """The DAG; ``p``: parameter name → the pipeline's parameter (a KFP channel)."""
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER

        def step(task, display_name: str, name: str):
            """``task``, shown as ``display_name``, with the platform's settings of step
            ``name`` and its image from the image parameters."""
            task.set_display_name(display_name)
            task.set_container_image(p[image_of[task.container_spec.image]])
            platform(task, name)
            if name in NEVER_CACHED:
                task.set_caching_options(False)
            if fingerprint := (input_fingerprints or {}).get(name):
                task.set_env_variable(INPUT_FINGERPRINT_ENV, fingerprint)
            return task

        def train_and_promote(config, prep, fingerprint, run, tracked) -> None:
            """Everything after data prep, run only on new data (or ``force``): base model,
            capacity check, SFT, GRPO, the eval with the champion, the gate; register and
            publish on promote."""
            base = step(
                base_model(source=config["model_source"], tiny_config=config["tiny_config"]),
                "base model",
                "base-model",
            )
            capacity = capacity_check(
                base_model=base.outputs["model"],
                **run,
                overrides=config["layout_overrides"],
                sft_execution=config["sft_execution"],
                grpo_execution=config["grpo_execution"],
                backend=config["backend"],
                megatron_layout=config["megatron_layout"],
                megatron_optim=config["megatron_optim"],
            )
            step(capacity, "capacity check", "capacity-check")
            images = dict(gpu_image=p["gpu_image"], megatron_image=p["megatron_image"])

            def training_inputs(step_config, execution) -> dict:
                """What both training steps take besides their input model."""
                return dict(
                    train_data=prep.outputs["train_data"],
                    eval_data=prep.outputs["eval_data"],
                    config=step_config,
                    execution=execution,
                    pipeline_run_id=run_id,
                    **images,
                    **tracked,
                )

            sft_inputs = training_inputs(config["sft"], config["sft_execution"])
            sft_inputs.pop("megatron_image", None)  # SFT's jobs run the GPU image
            tuned = sft(base_model=base.outputs["model"], **sft_inputs)
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
                """champion → eval → gate → on promote register, then publish and deploy:
                in each backend's branch (kfp.local 2.17 cannot resolve a dsl.OneOf of
                artifacts, so the branches do not merge)."""
                held = champion(config=config["gate"], mlflow_tracking_uri=p["mlflow_tracking_uri"])
                step(held, "champion from the registry", "champion")
                held.set_caching_options(False)  # the alias moves
                evaluation = evaluate(
                    base_model=base.outputs["model"],
                    sft_model=tuned.outputs["model"],
                    grpo_model=policy_model,
                    champion_model=held.outputs["model"],
                    config=config["eval"],
                    **tracked,
                )
                step(evaluation, "eval: base vs SFT vs GRPO vs champion", "evaluate")
                results = evaluation.outputs["results"]
                decision = gate(
                    results=results, grpo_model=policy_model, config=config["gate"], **tracked
                )
                step(decision, "promotion gate", "gate")
                with dsl.If(decision.outputs["Output"] == "promote", name="beats-champion"):
                    registered = register(
                        results=results,
                        grpo_model=policy_model,
                        config=config["gate"],
                        data_fingerprint=fingerprint,
                        **tracked,
                    )
                    step(registered, "register champion", "register")
                    with dsl.If(p["export_uri"] != "", name="export-to-object-storage"):
                        published = publish(
                            grpo_model=policy_model,
                            eval_results=results,
                            eval_report=evaluation.outputs["report"],
                            export_uri=p["export_uri"],
                            pipeline_run_id=run_id,
                        )
                        step(published, "publish to object storage", "publish").after(registered)
                        if preset.serving.enabled:  # the champion on KServe (cluster/serving.py)
                            served = deploy(
                                published_prefix=published.output,
                                config=config["serving"],
                                pipeline_run_id=run_id,
                            )
                            step(served, "serve the champion (KServe)", "deploy")

            grpo_inputs = dict(  # the same GRPO inputs on both branches
                sft_model=tuned.outputs["model"],
                **training_inputs(config["grpo"], config["grpo_execution"]),
            )

            def grpo_on_hf_weights() -> None:
                """GRPO on the HF weights (grpo.optim.backend: torch or deepspeed)."""
                hf_policy = step(grpo(**grpo_inputs), "GRPO", "grpo")
                export_and_evaluate(hf_policy.outputs["model"], "hf")

            def grpo_on_megatron() -> None:
                """GRPO on a Megatron checkpoint converted from the SFT model."""
                converted = convert_megatron(
                    hf_model=tuned.outputs["model"], layout=config["megatron_layout"]
                )
                step(converted, "convert to Megatron + precision check", "convert-megatron")
                megatron_policy = grpo_megatron(
                    **grpo_inputs,
                    backend="megatron",
                    megatron_checkpoint=converted.outputs["megatron_model"],
                    megatron_layout=config["megatron_layout"],
                    megatron_optim=config["megatron_optim"],
                )
                step(megatron_policy, "GRPO (Megatron)", "grpo")
                export_and_evaluate(megatron_policy.outputs["model"], "megatron")

            branches = {"hf": grpo_on_hf_weights, "megatron": grpo_on_megatron}
            if len(preset.grpo_branches) == 1:
                branches[preset.grpo_branches[0]]()
            else:  # named for what runs
                with dsl.If(p["backend"] != "megatron", name="grpo-on-hf-weights"):
                    grpo_on_hf_weights()
                with dsl.Else(name="grpo-on-megatron"):
                    grpo_on_megatron()

        cleanup = finalize(
            pipeline_run_id=run_id,
            mlflow_tracking_uri=p["mlflow_tracking_uri"],
            mlflow_experiment=p["mlflow_experiment"],
            delete_jobs=settings.training_jobs,
        )
        step(cleanup, "finalize: jobs, MLflow run", "finalize")
        with dsl.ExitHandler(cleanup, name="lingo-rl"):
            configured = configure(
                preset=carried,
                overrides=p["overrides"],
                job_platform=job_platform_json(settings),
                export_uri=p["export_uri"],
                **{name: p[name] for name in fields},
            )
            step(configured, "run config: the form on the preset", "configure")
            config = configured.outputs
            # the run as the pipeline run records it and as the capacity check estimates it
            run = dict(
                hardware=config["hardware"], sft_config=config["sft"], grpo_config=config["grpo"]
            )
            tracking = start_tracking(
                pipeline_run_id=run_id,
                pipeline_run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
                data_source=config["data_source"],
                model_source=config["model_source"],
                **run,
                mlflow_tracking_uri=p["mlflow_tracking_uri"],
                mlflow_experiment=p["mlflow_experiment"],
            )
            step(tracking, "MLflow run", "start-tracking")
            # each step's MLflow run nests under the pipeline's
            tracked = dict(
                mlflow_tracking_uri=p["mlflow_tracking_uri"],
                mlflow_parent_run_id=tracking.output,
            )
            prep = step(data_prep(config=config["data_prep"], **tracked), "data prep", "data-prep")
            prep.set_caching_options(False)  # its source can change under the same name
            fingerprint = prep.outputs["Output"]
            checked = data_check(
                data_fingerprint=fingerprint,
                gate_config=config["gate"],
                mlflow_tracking_uri=p["mlflow_tracking_uri"],
            )
            step(checked, "new data? (fingerprint vs champion)", "data-check")
            checked.set_caching_options(False)  # the champion's alias moves
            with dsl.If(checked.outputs["Output"] == "retrain", name="new-data"):
                train_and_promote(config, prep, fingerprint, run, tracked)

    signature = inspect.Signature(pipeline_parameters(preset))

    def pipeline(*args, **kwargs) -> None:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        lingo_pipeline(dict(bound.arguments))

    pipeline.__signature__ = signature
    pipeline.__name__ = pipeline.__qualname__ = "lingo_pipeline"
    pipeline.__doc__ = describe_parameters(preset)
    with _frames_without_source():
        return dsl.pipeline(name=PIPELINE_NAME, description=DESCRIPTION)(pipeline)


class _InspectWithoutSource:
    """``inspect`` as kfp's ``pipeline_task`` module sees it, but ``stack()`` gives each frame's
    file, line and function without reading its source (the rest is ``inspect``'s own)."""

    def __getattr__(self, name: str):
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        frames, frame = [], sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            frames.append(
                inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, None, None)
            )
            frame = frame.f_back
        return frames


@contextmanager
def _frames_without_source() -> Iterator[None]:
    """Build the DAG with kfp's task setters (``set_cpu_limit``, ``set_env_variable``, …, ~90
    calls a preset) asking for their caller's name the cheap way. Each setter calls
    ``inspect.stack()`` only to name its caller in an error message; ``inspect.stack()`` reads
    the source of every frame on the stack and, for a frame without a file (runpy's under
    ``python -m``, typer's test runner), scans every loaded module: ``lingo compile --all``
    spent ~13 of its ~15 CPU seconds there (kfp 2.17.3). The YAML is the same bytes
    (``tests/pipelines/test_compile.py``)."""
    stock = pipeline_task.inspect
    pipeline_task.inspect = _InspectWithoutSource()
    try:
        yield
    finally:
        pipeline_task.inspect = stock
