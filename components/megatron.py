"""KFP components of the Megatron path: HF → Megatron conversion, and the export back to HF."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Markdown, Model, Output

from components.images import MEGATRON_IMAGE


@dsl.component(base_image=MEGATRON_IMAGE, install_kfp_package=False)
def convert_megatron(
    hf_model: Input[Model],
    layout: dict,
    megatron_model: Output[Model],
    verification_report: Output[Markdown],
    manifest: Output[Artifact],
):
    """HF directory → Megatron ``torch_dist`` checkpoint with megatron-bridge.

    ``layout`` is the training layout (a ``MegatronLayout`` as a dict, or
    ``{"preset": name, **overrides}``). It is checked against the model's config before any
    weight loads; the step itself is one process, so the checkpoint is written at the
    one-process layout (``conversion_layout``: TP = PP = EP = 1, the training layout's dtype)
    and the training job reshards it on load. The checkpoint gets a manifest, and its
    next-token logits must match the HF model's within the dtype's tolerance (the report is
    written either way). Nothing is published when a check fails.
    """
    import importlib
    import shutil
    from pathlib import Path

    from core.atomic import discard_staging, publish_dir, staging_dir
    from core.processes import start_step_process
    from trainer.megatron.layout import conversion_layout, validate_layout
    from trainer.megatron.manifest import MANIFEST_FILE, build_manifest, write_manifest
    from trainer.megatron.verify import verify_conversion

    start_step_process()  # dies with its parent; every log line redacted
    training = validate_layout(hf_model.path, layout)  # the layout GRPO will load it at
    checked = validate_layout(hf_model.path, conversion_layout(training.layout), world_size=1)
    bridge = importlib.import_module("trainer.megatron.bridge")
    final = Path(megatron_model.path)
    partial = staging_dir(final)
    try:
        # the bridge writes a directory that must not exist yet (its own save is atomic):
        # converted inside the staging folder, then its entries moved up into it
        converted = partial / ".converted"
        bridge.convert_hf_to_megatron(hf_model.path, str(converted), checked.layout)
        for entry in converted.iterdir():
            entry.rename(partial / entry.name)
        converted.rmdir()
        write_manifest(partial, build_manifest(hf_model.path, checked.layout, checked.world_size))
        report = verify_conversion(
            hf_model.path,
            partial,
            dtype=checked.layout.params_dtype,
            report_path=verification_report.path,
            json_path=partial / "lingo_verification.json",
        )
    except BaseException:
        discard_staging(partial)
        raise
    publish_dir(partial, final)
    shutil.copyfile(final / MANIFEST_FILE, manifest.path)
    parallel = checked.layout.model_dump(include={"tp", "pp", "ep", "etp", "cp", "dp", "vpp"})
    megatron_model.metadata.update(
        format="megatron-torch_dist",
        layout=checked.layout.name,
        dtype=checked.layout.params_dtype,
        world_size=checked.world_size,
        training_world_size=training.world_size,
        max_abs_logit_diff=report.max_abs_diff,
        **{k: v for k, v in parallel.items() if v is not None},
    )


@dsl.component(base_image=MEGATRON_IMAGE, install_kfp_package=False)
def export_hf(
    checkpoint: Input[Model],
    template_model: Input[Model],
    source_format: str,
    model: Output[Model],
    dtype: str = "auto",
    max_shard_size: str = "5GB",
):
    """A training checkpoint → a standard HF directory (sharded safetensors, the template's
    tokenizer and chat template), checked to load with ``AutoModelForCausalLM``.

    ``source_format``: ``hf`` (a HF directory a training step wrote: the ``hf`` branch's GRPO
    policy, re-sharded in ``dtype``), ``deepspeed`` (a GRPO work dir, ``checkpoints/``
    root or ``step-<N>`` dir; ZeRO shards consolidated by DeepSpeed) or ``megatron`` (a
    Megatron checkpoint, exported by megatron-bridge; ``dtype`` and ``max_shard_size`` are
    the bridge's then): ``trainer.export_hf.EXPORTERS``.
    """
    from core.processes import start_step_process
    from trainer.export_hf import export_checkpoint

    start_step_process()  # dies with its parent; every log line redacted
    result = export_checkpoint(
        source_format, checkpoint.path, template_model.path, model.path,
        dtype=dtype, max_shard_size=max_shard_size,
    )  # fmt: skip
    model.metadata.update(
        format="huggingface",
        source_format=result.source_format,
        dtype=result.dtype,
        shards=result.shards,
        parameters=result.parameters,
    )
