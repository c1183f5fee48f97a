"""The Megatron path for real on a GPU: layout check → megatron-bridge conversion → manifest →
precision check → export back to HF, on the tiny GPT-OSS model. Needs CUDA and the
``megatron`` extra (megatron-core, megatron-bridge; Python ≥ 3.12)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trainer.export_hf import export_megatron
from trainer.megatron.layout import MegatronLayout, validate_layout
from trainer.megatron.manifest import build_manifest, check_manifest, write_manifest
from trainer.megatron.verify import verify_conversion

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bridge():
    """The real trainer.megatron.bridge, on a machine with CUDA and megatron-bridge."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("megatron.bridge")
    return pytest.importorskip("trainer.megatron.bridge")


def _hf_weights(directory) -> dict[str, torch.Tensor]:
    weights = {}
    for shard in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


@pytest.fixture(scope="module")
def bf16_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model saved in bf16 (what gpt-oss ships in), with its tokenizer."""
    from trainer.export_hf import copy_template_files

    out = tmp_path_factory.mktemp("bf16") / "model"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    model.save_pretrained(out)
    copy_template_files(tiny_model_dir, out)
    return out


def _convert_and_verify(bridge, hf_dir, tmp_path, dtype: str):
    """``hf_dir`` converted to ``tmp_path/megatron`` in ``dtype`` (layout checked, manifest
    written and checked), then its precision checked on CUDA: ``(megatron_dir, report)``."""
    layout = MegatronLayout(name=f"tiny-gpu-{dtype}", params_dtype=dtype)
    megatron_dir = tmp_path / "megatron"
    checked = validate_layout(hf_dir, layout, world_size=1)
    bridge.convert_hf_to_megatron(str(hf_dir), str(megatron_dir), checked.layout)
    write_manifest(megatron_dir, build_manifest(hf_dir, checked.layout, checked.world_size))
    check_manifest(megatron_dir, layout=checked.layout, hf_dir=hf_dir)
    report = verify_conversion(
        hf_dir,
        megatron_dir,
        dtype=dtype,
        report_path=tmp_path / "report.md",
        json_path=tmp_path / "report.json",
        device="cuda",
    )
    return megatron_dir, report


def test_fp32_round_trip_hf_megatron_hf_is_exact(bridge, tiny_model_dir, tmp_path):
    megatron_dir, report = _convert_and_verify(bridge, tiny_model_dir, tmp_path, "fp32")
    assert report.passed and report.top1_agreement == 1.0

    out = tmp_path / "hf"
    result = export_megatron(megatron_dir, tiny_model_dir, out)
    assert result.source_format == "megatron"
    source, exported = _hf_weights(tiny_model_dir), _hf_weights(out)
    assert set(exported) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name].float(), tensor.float()), name


def test_bf16_conversion_is_within_the_bf16_tolerance(bridge, bf16_model_dir, tmp_path):
    megatron_dir, report = _convert_and_verify(bridge, bf16_model_dir, tmp_path, "bf16")
    assert report.passed
    out = tmp_path / "hf"
    export_megatron(megatron_dir, bf16_model_dir, out)
    source, exported = _hf_weights(bf16_model_dir), _hf_weights(out)
    for name, tensor in source.items():
        assert torch.equal(exported[name].to(tensor.dtype), tensor), name
