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
from plan import HF_BRANCH, MEGATRON_BRANCH

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
    fields = [field.name for field in form_fields(preset)]
    signature = inspect.Signature(pipeline_parameters(preset))

    def pipeline(*args, **kwargs) -> None:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        _Dag(preset, settings, input_fingerprints or {}, dict(bound.arguments)).build(fields)

    pipeline.__signature__ = signature
    pipeline.__name__ = pipeline.__qualname__ = "lingo_pipeline"
    pipeline.__doc__ = describe_parameters(preset)
    with _frames_without_source():
        return dsl.pipeline(name=PIPELINE_NAME, description=DESCRIPTION)(pipeline)


class _Dag:
    """The DAG of one pipeline run, built while KFP traces the pipeline function: each method
    adds one part of it. ``p``: parameter name → the pipeline's parameter (a KFP channel)."""

    def __init__(
        self,
        preset: Preset,
        settings: ClusterSettings,
        input_fingerprints: dict[str, str],
        p: dict,
    ) -> None:
        self.preset, self.settings, self.p = preset, settings, p
        self.fingerprints = input_fingerprints
        self.platform = with_platform(settings)
        self.image_of = {image: name for name, image in IMAGES.items()}
        self.run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER

    def step(self, task, display_name: str, name: str):
        """``task``, shown as ``display_name``, with the platform's settings of step ``name``
        and its image from the image parameters."""
        task.set_display_name(display_name)
        task.set_container_image(self.p[self.image_of[task.container_spec.image]])
        self.platform(task, name)
        if name in NEVER_CACHED:
            task.set_caching_options(False)
        if fingerprint := self.fingerprints.get(name):
            task.set_env_variable(INPUT_FINGERPRINT_ENV, fingerprint)
        return task

    def build(self, fields: list[str]) -> None:
        """configure → MLflow run → data prep → new data? → ``train_and_promote``, inside an
        exit handler that runs ``finalize`` whatever happens."""
        p = self.p
        cleanup = finalize(
            pipeline_run_id=self.run_id,
            mlflow_tracking_uri=p["mlflow_tracking_uri"],
            mlflow_experiment=p["mlflow_experiment"],
            delete_jobs=self.settings.training_jobs,
        )
        self.step(cleanup, "finalize: jobs, MLflow run", "finalize")
        with dsl.ExitHandler(cleanup, name="lingo-rl"):
            configured = configure(
                preset=preset_json(self.preset),
                overrides=p["overrides"],
                job_platform=job_platform_json(self.settings),
                export_uri=p["export_uri"],
                **{name: p[name] for name in fields},
            )
            self.step(configured, "run config: the form on the preset", "configure")
            self.config = configured.outputs
            checked = self.tracking_and_data()
            with dsl.If(checked.outputs["Output"] == "retrain", name="new-data"):
                self.train_and_promote()

    def tracking_and_data(self):
        """The pipeline run's MLflow run, data prep, and the check for new data (returned: its
        output says whether to train)."""
        p, config = self.p, self.config
        # the run as the pipeline run records it and as the capacity check estimates it
        self.run = dict(
            hardware=config["hardware"], sft_config=config["sft"], grpo_config=config["grpo"]
        )
        tracking = start_tracking(
            pipeline_run_id=self.run_id,
            pipeline_run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
            data_source=config["data_source"],
            model_source=config["model_source"],
            **self.run,
            mlflow_tracking_uri=p["mlflow_tracking_uri"],
            mlflow_experiment=p["mlflow_experiment"],
        )
        self.step(tracking, "MLflow run", "start-tracking")
        # each step's MLflow run nests under the pipeline's
        self.tracked = dict(
            mlflow_tracking_uri=p["mlflow_tracking_uri"], mlflow_parent_run_id=tracking.output
        )
        self.prep = self.step(
            data_prep(config=config["data_prep"], **self.tracked), "data prep", "data-prep"
        )
        self.prep.set_caching_options(False)  # its source can change under the same name
        self.fingerprint = self.prep.outputs["Output"]
        checked = data_check(
            data_fingerprint=self.fingerprint,
            gate_config=config["gate"],
            mlflow_tracking_uri=p["mlflow_tracking_uri"],
        )
        self.step(checked, "new data? (fingerprint vs champion)", "data-check")
        checked.set_caching_options(False)  # the champion's alias moves
        return checked

    def train_and_promote(self) -> None:
        """Everything after data prep, run only on new data (or ``force``): base model,
        capacity check, SFT, GRPO (the preset's branches), the eval with the champion, the
        gate; register and publish on promote."""
        config = self.config
        self.base = self.step(
            base_model(source=config["model_source"], tiny_config=config["tiny_config"]),
            "base model",
            "base-model",
        )
        capacity = capacity_check(
            base_model=self.base.outputs["model"],
            **self.run,
            overrides=config["layout_overrides"],
            sft_execution=config["sft_execution"],
            grpo_execution=config["grpo_execution"],
            backend=config["backend"],
            megatron_layout=config["megatron_layout"],
            megatron_optim=config["megatron_optim"],
        )
        self.step(capacity, "capacity check", "capacity-check")
        sft_inputs = self.training_inputs(config["sft"], config["sft_execution"])
        sft_inputs.pop("megatron_image", None)  # SFT's jobs run the GPU image
        self.tuned = sft(base_model=self.base.outputs["model"], **sft_inputs)
        self.step(self.tuned, "SFT + merge", "sft").after(capacity)
        self.grpo_inputs = dict(  # the same GRPO inputs on both branches
            sft_model=self.tuned.outputs["model"],
            **self.training_inputs(config["grpo"], config["grpo_execution"]),
        )
        branches = {HF_BRANCH: self.grpo_on_hf_weights, MEGATRON_BRANCH: self.grpo_on_megatron}
        if len(self.preset.grpo_branches) == 1:
            branches[self.preset.grpo_branches[0]]()
        else:  # named for what runs
            with dsl.If(self.p["backend"] != MEGATRON_BRANCH, name="grpo-on-hf-weights"):
                self.grpo_on_hf_weights()
            with dsl.Else(name="grpo-on-megatron"):
                self.grpo_on_megatron()

    def training_inputs(self, step_config, execution) -> dict:
        """What both training steps take besides their input model."""
        return dict(
            train_data=self.prep.outputs["train_data"],
            eval_data=self.prep.outputs["eval_data"],
            config=step_config,
            execution=execution,
            pipeline_run_id=self.run_id,
            gpu_image=self.p["gpu_image"],
            megatron_image=self.p["megatron_image"],
            **self.tracked,
        )

    def grpo_on_hf_weights(self) -> None:
        """GRPO on the HF weights (grpo.optim.backend: torch or deepspeed)."""
        hf_policy = self.step(grpo(**self.grpo_inputs), "GRPO", "grpo")
        self.export_and_evaluate(hf_policy.outputs["model"], "hf")

    def grpo_on_megatron(self) -> None:
        """GRPO on a Megatron checkpoint converted from the SFT model."""
        config = self.config
        converted = convert_megatron(
            hf_model=self.tuned.outputs["model"], layout=config["megatron_layout"]
        )
        self.step(converted, "convert to Megatron + precision check", "convert-megatron")
        megatron_policy = grpo_megatron(
            **self.grpo_inputs,
            backend="megatron",
            megatron_checkpoint=converted.outputs["megatron_model"],
            megatron_layout=config["megatron_layout"],
            megatron_optim=config["megatron_optim"],
        )
        self.step(megatron_policy, "GRPO (Megatron)", "grpo")
        self.export_and_evaluate(megatron_policy.outputs["model"], "megatron")

    def export_and_evaluate(self, policy_checkpoint, source_format: str) -> None:
        """Both branches end in export_hf (a standard sharded HF directory with the SFT
        model's tokenizer and chat template, checked to load), then eval."""
        exported = export_hf(
            checkpoint=policy_checkpoint,
            template_model=self.tuned.outputs["model"],
            source_format=source_format,
        )
        self.step(exported, "export to HF", "export-hf")
        self.evaluate_and_promote(exported.outputs["model"])

    def evaluate_and_promote(self, policy_model) -> None:
        """champion → eval → gate → on promote ``register_and_publish``: in each backend's
        branch (kfp.local 2.17 cannot resolve a dsl.OneOf of artifacts, so the branches do not
        merge)."""
        config, p = self.config, self.p
        held = champion(config=config["gate"], mlflow_tracking_uri=p["mlflow_tracking_uri"])
        self.step(held, "champion from the registry", "champion")
        held.set_caching_options(False)  # the alias moves
        evaluation = evaluate(
            base_model=self.base.outputs["model"],
            sft_model=self.tuned.outputs["model"],
            grpo_model=policy_model,
            champion_model=held.outputs["model"],
            config=config["eval"],
            **self.tracked,
        )
        self.step(evaluation, "eval: base vs SFT vs GRPO vs champion", "evaluate")
        decision = gate(
            results=evaluation.outputs["results"],
            grpo_model=policy_model,
            config=config["gate"],
            **self.tracked,
        )
        self.step(decision, "promotion gate", "gate")
        with dsl.If(decision.outputs["Output"] == "promote", name="beats-champion"):
            self.register_and_publish(policy_model, evaluation)

    def register_and_publish(self, policy_model, evaluation) -> None:
        """Register the promoted model; publish it where ``export_uri`` is set, and serve it
        on KServe where the preset says so (``cluster/serving.py``)."""
        config, p = self.config, self.p
        results = evaluation.outputs["results"]
        registered = register(
            results=results,
            grpo_model=policy_model,
            config=config["gate"],
            data_fingerprint=self.fingerprint,
            **self.tracked,
        )
        self.step(registered, "register champion", "register")
        with dsl.If(p["export_uri"] != "", name="export-to-object-storage"):
            published = publish(
                grpo_model=policy_model,
                eval_results=results,
                eval_report=evaluation.outputs["report"],
                export_uri=p["export_uri"],
                pipeline_run_id=self.run_id,
            )
            self.step(published, "publish to object storage", "publish").after(registered)
            if self.preset.serving.enabled:
                served = deploy(
                    published_prefix=published.output,
                    config=config["serving"],
                    pipeline_run_id=self.run_id,
                )
                self.step(served, "serve the champion (KServe)", "deploy")


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
