"""KFP component: the pipeline's first step, which turns the run form into the steps' configs.

It lives beside the presets rather than in ``components/``: it reads a ``Preset``
(``pipelines.run_form``), and ``components`` do not import ``pipelines``.
"""

from typing import NamedTuple, Optional

from kfp import dsl

from components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def configure(
    preset: str,
    data_source: str,
    model_source: str,
    sft_max_steps: int,
    sft_num_epochs: float,
    sft_learning_rate: float,
    grpo_max_steps: int,
    grpo_learning_rate: float,
    grpo_samples_per_prompt: int,
    grpo_prompts_per_step: int,
    eval_samples: int,
    gate_margin: float,
    force: bool,
    overrides: str = "",
    job_platform: str = "",
    export_uri: str = "",
    backend: Optional[str] = None,  # noqa: UP045 (KFP reads Optional[...]); both branches only
) -> NamedTuple(
    "RunConfig",
    [
        ("data_source", str),
        ("data_prep", dict),
        ("model_source", str),
        ("tiny_config", dict),
        ("sft", dict),
        ("grpo", dict),
        ("eval", dict),
        ("gate", dict),
        ("serving", dict),
        ("hardware", dict),
        ("layout_overrides", dict),
        ("backend", str),
        ("megatron_layout", dict),
        ("megatron_optim", dict),
        ("sft_execution", dict),
        ("grpo_execution", dict),
    ],
):
    """The run's step configs: ``preset`` (the JSON the pipeline carries) with the form's
    fields (``pipelines.run_form.FORM_FIELDS``; ``backend`` where the preset has both GRPO
    branches) and then ``overrides`` (``--set`` syntax) applied, checked; a value that does not
    hold fails this step with a message naming the field (``run_form.resolve_run``).
    ``job_platform``: the training jobs' volume and Secrets as the pipeline was compiled
    (``pipelines.presets.job_platform_json``). ``export_uri``: the run's, checked here."""
    given = dict(locals())  # first: the parameters only
    run = ("preset", "overrides", "job_platform", "export_uri")
    form = {k: v for k, v in given.items() if k not in run and v is not None}
    from collections import namedtuple

    from core.processes import start_step_process
    from pipelines.run_form import check_export_uri, configure_outputs

    start_step_process()  # dies with its parent; every log line redacted
    check_export_uri(export_uri)  # read by `publish` at the end: checked before any training
    outputs = configure_outputs(preset, form, overrides, job_platform)
    return namedtuple("RunConfig", list(outputs))(**outputs)
