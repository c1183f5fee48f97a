"""KFP component: serve the champion (a KServe InferenceService running vLLM) after the gate
promoted it and ``publish`` uploaded it; the logic is ``cluster.serving``."""

from kfp import dsl

from components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def deploy(published_prefix: str, config: dict, pipeline_run_id: str) -> str:
    """Apply the InferenceService that serves ``<published_prefix>/grpo-model/`` with vLLM
    (gpt-oss's reasoning parser, the preset's GPUs); returns its URL once Ready."""
    from cluster.serving import deploy_champion
    from core.processes import start_step_process

    start_step_process()  # dies with its parent; every log line redacted
    return deploy_champion(published_prefix, config, pipeline_run_id)
