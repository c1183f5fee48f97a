"""Precision check of a Megatron conversion: report logic on synthetic logits, and the whole
check (and the convert component) on the tiny model.

Megatron-Core cannot run on this CPU-only machine, so where a Megatron forward pass or
conversion is needed, ``trainer.megatron.bridge`` is replaced by a stand-in module: its
``megatron_next_token_logits`` returns the real HF model's logits plus chosen noise, its
``convert_hf_to_megatron`` writes a marker file. The real bridge runs in
``test_megatron_gpu.py``.
"""

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from kfp.dsl import Artifact, Markdown, Model

from core.modeling import load_causal_lm, load_tokenizer
from trainer.megatron.layout import LayoutError
from trainer.megatron.manifest import MANIFEST_FILE, read_manifest
from trainer.megatron.verify import (
    TOLERANCES,
    VERIFICATION_PROMPTS,
    PrecisionCheckFailed,
    Tolerance,
    VerificationReport,
    compare_logits,
    encode_prompts,
    hf_next_token_logits,
    verify_conversion,
)


def _logits(prompts=10, vocab=50, seed=0):
    return torch.randn(prompts, vocab, generator=torch.Generator().manual_seed(seed)) * 5


def test_identical_logits_pass_with_zero_difference():
    hf = _logits()
    report = compare_logits(hf, hf.clone(), "fp32")
    assert report.passed and report.failures == []
    assert report.max_abs_diff == 0 and report.mean_abs_diff == 0
    assert report.top1_agreement == 1 and report.topk_agreement == 1
    assert len(report.prompts) == 10 and report.top_k == 5


def test_metrics_match_hand_computed_values():
    hf = torch.tensor([[4.0, 3.0, 1.0, 0.0, -1.0, -2.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    mg = hf.clone()
    mg[0, 1] += 1.5  # prompt 0: top-1 flips from token 0 to token 1
    mg[1, 0] -= 0.3  # prompt 1: only a low logit moves
    report = compare_logits(hf, mg, "bf16", names=["a", "b"], tokens=[7, 9], top_k=2)
    a, b = report.prompts
    assert (a.name, a.tokens, b.tokens) == ("a", 7, 9)
    assert a.max_abs_diff == pytest.approx(1.5) and a.mean_abs_diff == pytest.approx(0.25)
    assert (a.hf_top1, a.megatron_top1, a.top1_match) == (0, 1, False)
    assert a.hf_top1_margin == pytest.approx(1.0)
    assert a.topk_agreement == 1.0  # top-2 is {0, 1} on both sides
    assert b.max_abs_diff == pytest.approx(0.3) and b.top1_match
    assert report.max_abs_diff == pytest.approx(1.5)
    assert report.mean_abs_diff == pytest.approx(1.8 / 12)
    assert report.top1_agreement == 0.5
    assert report.topk_agreement == 1.0
    assert not report.passed  # bf16: max 1.5 > 1.0, mean 0.15 > 0.1, top-1 0.5 < 0.9
    assert report.failures == [
        "max abs logit diff 1.5 > 1 (worst prompt a)",
        "mean abs logit diff 0.15 > 0.1",
        "top-1 agreement 0.500 < 0.9 (flipped: a)",
    ]


@pytest.mark.parametrize(
    ("dtype", "noise", "passed"),
    [("fp32", 1e-5, True), ("fp32", 1e-2, False), ("bf16", 0.02, True), ("bf16", 0.5, False)],
)
def test_tolerance_by_dtype(dtype, noise, passed):
    hf = _logits(vocab=2000)
    noise_tensor = torch.randn(hf.shape, generator=torch.Generator().manual_seed(1)) * noise
    report = compare_logits(hf, hf + noise_tensor, dtype)
    assert report.passed is passed, report.failures
    assert report.tolerance == TOLERANCES[dtype]


def test_fp32_is_tighter_than_fp16_and_bf16():
    fp32, fp16, bf16 = TOLERANCES["fp32"], TOLERANCES["fp16"], TOLERANCES["bf16"]
    assert fp32.max_abs_diff < fp16.max_abs_diff <= bf16.max_abs_diff
    assert fp32.mean_abs_diff < fp16.mean_abs_diff <= bf16.mean_abs_diff
    assert fp32.min_top1_agreement == 1.0


def test_one_flip_in_ten_is_allowed_in_bf16_but_two_are_not():
    hf = _logits()
    top2 = hf.topk(2, dim=-1).indices
    for i in range(10):  # make every prompt's two best tokens a near-tie (0.4 apart) ...
        hf[i, top2[i, 1]] = hf[i, top2[i, 0]] - 0.4

    def flip(rows):  # ... and swap them in Megatron's logits on some prompts (|Δ| 0.4)
        out = hf.clone()
        for i in rows:
            out[i, top2[i, 0]], out[i, top2[i, 1]] = hf[i, top2[i, 1]], hf[i, top2[i, 0]]
        return out

    mg = flip([0])
    one = compare_logits(hf, mg, "bf16")
    assert one.passed and one.top1_agreement == 0.9 and one.max_abs_diff == pytest.approx(0.4)
    two = compare_logits(hf, flip([0, 1]), "bf16")
    assert not two.passed and two.top1_agreement == 0.8
    assert two.failures == [
        f"top-1 agreement 0.800 < 0.9 (flipped: {two.prompts[0].name}, {two.prompts[1].name})"
    ]
    assert not compare_logits(hf, mg, "fp32").passed  # fp32 allows no flip (nor |Δ| 0.4)


def test_megatron_vocabulary_padding_is_cut_and_bad_shapes_are_errors():
    hf = _logits(prompts=3, vocab=40)
    padded = torch.cat([hf, torch.full((3, 24), -100.0)], dim=1)  # Megatron pads the vocab
    report = compare_logits(hf, padded, "fp32")
    assert report.passed and report.vocab_size == 40
    with pytest.raises(ValueError, match="smaller than HF's"):
        compare_logits(hf, hf[:, :30], "fp32")
    with pytest.raises(ValueError, match="same number of prompts"):
        compare_logits(hf, hf[:2], "fp32")
    broken = hf.clone()
    broken[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        compare_logits(hf, broken, "fp32")


def test_report_renders_markdown_and_round_trips_as_json():
    hf = _logits(prompts=2)
    report = compare_logits(hf, hf + 3, "bf16", names=["en-x", "fr-y"])
    markdown = report.to_markdown()
    assert markdown.startswith("# Megatron conversion precision check: FAILED")
    assert "| en-x |" in markdown and "| fr-y |" in markdown
    assert "| max abs logit diff | 3 | ≤ 1 |" in markdown
    assert "## Failures" in markdown
    assert VerificationReport.model_validate_json(report.to_json()) == report
    good = compare_logits(hf, hf, "bf16").to_markdown()
    assert "check: passed" in good and "## Failures" not in good


def test_prompts_are_rendered_as_harmony_and_encoded_with_the_model_tokenizer(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = encode_prompts(tokenizer, VERIFICATION_PROMPTS)
    assert len(ids) == len(VERIFICATION_PROMPTS) == 10
    assert {p.language for p in VERIFICATION_PROMPTS} == {
        "English", "French", "German", "Spanish", "Italian"
    }  # fmt: skip
    text = tokenizer.decode(ids[2])
    assert text.startswith("<|start|>system<|message|>")
    assert "reasoning language: French" in text
    assert text.endswith("<|start|>assistant")


def _install_fake_bridge(monkeypatch, noise: float = 0.0, calls: list | None = None):
    """Stand in for trainer.megatron.bridge (megatron-core cannot run here, see the module
    docstring): the 'Megatron' logits are the HF model's own, computed again, plus noise."""
    fake = types.ModuleType("trainer.megatron.bridge")

    def megatron_next_token_logits(megatron_dir, hf_dir, input_ids):
        assert (Path(megatron_dir) / "converted.json").is_file()
        if calls is not None:
            calls.append(("logits", input_ids))
        model = load_causal_lm(hf_dir, torch.float32)
        logits = hf_next_token_logits(model, input_ids)
        generator = torch.Generator().manual_seed(0)
        return logits + noise * torch.randn(logits.shape, generator=generator)

    def convert_hf_to_megatron(hf_dir, out_dir, layout):
        if calls is not None:
            calls.append(("convert", layout))
        # Megatron-Core's own rule for the process it runs in: without torchrun the bridge's
        # process group is a world of one (``megatron_parallel``), and
        # ``initialize_model_parallel`` refuses a model-parallel size it does not divide
        # (megatron-core 0.19.2 ``parallel_state.py``)
        model_parallel = layout.tp * layout.pp * layout.cp
        if 1 % model_parallel or 1 % (layout.etp * layout.ep * layout.pp):
            raise RuntimeError(f"world_size (1) is not divisible by {model_parallel}")
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "converted.json").write_text(layout.model_dump_json())

    fake.megatron_next_token_logits = megatron_next_token_logits
    fake.convert_hf_to_megatron = convert_hf_to_megatron
    monkeypatch.setitem(sys.modules, "trainer.megatron.bridge", fake)
    return fake


def _converted_dir(tmp_path) -> Path:
    """A Megatron directory as the fake bridge's conversion leaves it."""
    megatron_dir = tmp_path / "megatron"
    megatron_dir.mkdir()
    (megatron_dir / "converted.json").write_text("{}")
    return megatron_dir


def test_verify_conversion_passes_and_writes_markdown_and_json(
    tiny_model_dir, tmp_path, monkeypatch
):
    calls = []
    _install_fake_bridge(monkeypatch, noise=1e-5, calls=calls)
    megatron_dir = _converted_dir(tmp_path)
    report = verify_conversion(
        tiny_model_dir,
        megatron_dir,
        dtype="fp32",
        report_path=tmp_path / "report.md",
        json_path=tmp_path / "report.json",
        device="cpu",
    )
    assert report.passed and 0 < report.max_abs_diff < 1e-4
    assert report.top1_agreement == 1.0
    assert [c[0] for c in calls] == ["logits"]
    assert len(calls[0][1]) == 10  # the ten fixed prompts, as token ids
    assert (tmp_path / "report.md").read_text().startswith("# Megatron conversion precision")
    saved = VerificationReport.model_validate_json((tmp_path / "report.json").read_text())
    assert saved == report and saved.megatron_dir == str(megatron_dir)


def test_verify_conversion_past_tolerance_raises_after_writing_the_report(
    tiny_model_dir, tmp_path, monkeypatch
):
    _install_fake_bridge(monkeypatch, noise=0.05)
    megatron_dir = _converted_dir(tmp_path)
    with pytest.raises(PrecisionCheckFailed, match="max abs logit diff") as caught:
        verify_conversion(
            tiny_model_dir, megatron_dir, dtype="fp32", report_path=tmp_path / "r.md", device="cpu"
        )
    assert not caught.value.report.passed
    assert "FAILED" in (tmp_path / "r.md").read_text()
    # the same noise is within a custom, looser tolerance
    loose = Tolerance(
        max_abs_diff=1.0, mean_abs_diff=0.5, min_top1_agreement=0.5, min_topk_agreement=0.5
    )
    report = verify_conversion(
        tiny_model_dir,
        megatron_dir,
        dtype="fp32",
        report_path=tmp_path / "r.md",
        tolerance=loose,
        device="cpu",
    )
    assert report.passed and "passed" in (tmp_path / "r.md").read_text()


def _artifacts(tmp_path):
    (tmp_path / "out").mkdir()
    return (
        Model(uri=str(tmp_path / "out" / "megatron_model")),
        Markdown(uri=str(tmp_path / "out" / "verification_report")),
        Artifact(uri=str(tmp_path / "out" / "manifest")),
    )


def _convert_component(model_dir, layout: dict, artifacts) -> None:
    """The convert_megatron component on ``model_dir`` with ``layout``, into ``artifacts``."""
    from components.megatron import convert_megatron

    megatron_model, report, manifest = artifacts
    convert_megatron.python_func(
        hf_model=Model(uri=str(model_dir)),
        layout=layout,
        megatron_model=megatron_model,
        verification_report=report,
        manifest=manifest,
    )


def test_convert_component_validates_converts_writes_manifest_and_verifies(
    tiny_model_dir, tmp_path, monkeypatch
):
    calls = []
    _install_fake_bridge(monkeypatch, calls=calls)
    artifacts = _artifacts(tmp_path)
    _convert_component(tiny_model_dir, {"preset": "tiny-cpu"}, artifacts)
    megatron_model, report, manifest = artifacts
    out = Path(megatron_model.path)
    assert [c[0] for c in calls] == ["convert", "logits"]
    assert calls[0][1].params_dtype == "fp32"
    assert read_manifest(out).layout.name == "tiny-cpu"
    assert json.loads(Path(manifest.path).read_text()) == json.loads(
        (out / MANIFEST_FILE).read_text()
    )
    assert "check: passed" in Path(report.path).read_text()
    assert (out / "lingo_verification.json").is_file()
    assert not list(out.parent.glob(".*partial"))
    assert megatron_model.metadata["format"] == "megatron-torch_dist"
    assert megatron_model.metadata["tp"] == 1 and megatron_model.metadata["dp"] == 1


def test_convert_component_rejects_a_bad_layout_before_converting(
    tiny_model_dir, tmp_path, monkeypatch
):
    calls = []
    _install_fake_bridge(monkeypatch, calls=calls)
    artifacts = _artifacts(tmp_path)
    megatron_model = artifacts[0]
    with pytest.raises(LayoutError, match="tp=3"):
        _convert_component(tiny_model_dir, {"tp": 3, "gpus_per_node": 3}, artifacts)
    assert calls == [] and not Path(megatron_model.path).exists()


def test_convert_component_writes_the_verl_layout_at_the_one_process_it_runs_as(
    tmp_path, monkeypatch
):
    """Issue #39: the pipeline hands the GRPO layout (the verl preset's TP 8 / EP 8 on one
    node of 8 GPUs) to the convert step, which runs as one KFP pod without torchrun. It used
    to convert at TP 8 / EP 8 in a world of one (Megatron-Core: "world_size (1) is not
    divisible by 8"); it converts at the one-process layout now, in the training layout's
    dtype, and the training job reshards the ``torch_dist`` checkpoint when it loads it."""
    from pipelines.presets import PRESETS, megatron_layout
    from trainer.tiny_model import SMALLEST, build_tiny_model

    layout = megatron_layout(PRESETS["gpt-oss-20b-verl"])
    assert (layout["preset"], layout["nodes"], layout["gpus_per_node"]) == (
        "verl-gpt-oss-8x8-h100", 1, 8,
    )  # fmt: skip
    # a tiny model whose shapes TP 8 / EP 8 split: 8 heads, 8 query groups, 8 experts
    shape = {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8}
    model_dir = build_tiny_model(
        tmp_path / "model", SMALLEST.model_copy(update={**shape, "num_local_experts": 8})
    )
    calls = []
    _install_fake_bridge(monkeypatch, calls=calls)
    artifacts = _artifacts(tmp_path)
    _convert_component(model_dir, layout, artifacts)
    megatron_model = artifacts[0]
    converted = calls[0][1]
    assert (converted.tp, converted.pp, converted.ep, converted.etp, converted.cp) == (1,) * 5
    assert converted.params_dtype == "bf16" and not converted.sequence_parallel
    manifest = read_manifest(megatron_model.path)
    assert (manifest.layout.tp, manifest.layout.ep, manifest.world_size) == (1, 1, 1)
    assert manifest.layout.name == "verl-gpt-oss-8x8-h100"
    assert megatron_model.metadata["world_size"] == 1
    assert megatron_model.metadata["training_world_size"] == 8
