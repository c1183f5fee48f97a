"""DeepSpeed checkpoint → HF directory: real ZeRO-3 and ZeRO-0 checkpoints of the tiny GPT-OSS
model, written by our DeepSpeed backend exactly as GRPO writes them, exported and reloaded."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from kfp.dsl import Model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GptOssConfig, GptOssForCausalLM

from trainer.export_hf import (
    ExportError,
    check_loadable,
    copy_template_files,
    export_deepspeed,
    export_hf_directory,
    export_megatron,
    normalize_state_dict_keys,
    resolve_deepspeed_checkpoint,
    write_hf_model,
)
from trainer.tiny_model import TinyModelConfig, build_tiny_model

pytest.importorskip("deepspeed")

REPO = Path(__file__).resolve().parents[2]

# One process, gloo on CPU: DeepSpeedBackend trains one step, trainer.checkpoint writes the
# checkpoint as GRPO does (step-1/deepspeed/...), and the gathered weights are kept to compare.
MAKE_CHECKPOINTS = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    from trainer.backends import DeepSpeedBackend, OptimConfig
    from trainer.checkpoint import save_checkpoint
    from trainer.distributed import init_distributed
    from core.modeling import load_causal_lm

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    info = init_distributed("cpu")
    for stage in (3, 0):
        torch.manual_seed(0)
        model = load_causal_lm(model_dir, torch.float32)
        cfg = OptimConfig(backend="deepspeed", zero_stage=stage, learning_rate=1e-2)
        backend = DeepSpeedBackend(model, cfg, 10, info, 1, 1)
        ids = torch.randint(0, model.config.vocab_size, (2, 24))
        backend.backward(backend.module(input_ids=ids, labels=ids).loss)
        backend.step()
        work = out / f"zero{stage}"
        save_checkpoint(work / "checkpoints", 1, backend, {"note": "test"}, info, keep=2)
        torch.save(backend.full_state_dict(), work / "expected.pt")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """Work dirs ``zero3`` and ``zero0`` holding a one-step DeepSpeed checkpoint each."""
    out = tmp_path_factory.mktemp("deepspeed")
    script = out / "make_checkpoints.py"
    script.write_text(MAKE_CHECKPOINTS)
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), str(out)], env=env, check=True
    )
    return out


def _safetensors(directory) -> dict[str, torch.Tensor]:
    weights = {}
    for shard in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def test_zero3_checkpoint_exports_exactly_the_trained_fp32_weights(
    checkpoints, tiny_model_dir, tmp_path
):
    expected = torch.load(checkpoints / "zero3" / "expected.pt")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    name = "model.embed_tokens.weight"
    assert not torch.equal(expected[name], initial[name])  # the step trained the weights

    out = tmp_path / "hf"
    result = export_deepspeed(
        checkpoints / "zero3", tiny_model_dir, out, dtype="float32", max_shard_size="200KB"
    )
    assert result.source == checkpoints / "zero3" / "checkpoints" / "step-1" / "deepspeed"
    assert result.dtype == "float32" and result.shards > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)
    written = _safetensors(out)
    assert set(written) == set(expected)
    for name, tensor in expected.items():
        assert written[name].dtype == torch.float32
        assert torch.equal(written[name], tensor), name
    assert result.tensors == len(expected)
    assert result.parameters == sum(t.numel() for t in expected.values())

    loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(
        result.copied_files
    )
    assert not list(tmp_path.glob(".*partial"))


def test_zero0_checkpoint_exports_cast_to_bf16(checkpoints, tiny_model_dir, tmp_path):
    expected = torch.load(checkpoints / "zero0" / "expected.pt")
    out = tmp_path / "hf"
    result = export_deepspeed(
        checkpoints / "zero0" / "checkpoints" / "step-1", tiny_model_dir, out, dtype="bfloat16"
    )
    assert result.shards == 1 and result.dtype == "bfloat16"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    written = _safetensors(out)
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor.to(torch.bfloat16)), name
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert loaded.dtype == torch.bfloat16


def test_auto_dtype_keeps_the_templates(checkpoints, tiny_model_dir, tmp_path):
    result = export_deepspeed(checkpoints / "zero0", tiny_model_dir, tmp_path / "hf")
    assert result.dtype == "float32"  # the tiny model is saved in fp32


def test_checkpoint_is_found_from_work_dir_root_step_or_tag_dir(checkpoints):
    work = checkpoints / "zero3"
    step = work / "checkpoints" / "step-1"
    for path in (work, work / "checkpoints", step, step / "deepspeed"):
        assert resolve_deepspeed_checkpoint(path) == (step, "deepspeed")
    with pytest.raises(ExportError, match="no such checkpoint directory"):
        resolve_deepspeed_checkpoint(work / "missing")
    with pytest.raises(ExportError, match="found none"):
        resolve_deepspeed_checkpoint(checkpoints.parent)


def test_a_checkpoint_that_does_not_fit_the_template_leaves_no_output(
    checkpoints, tmp_path, tiny_model_dir
):
    other = build_tiny_model(
        tmp_path / "other",
        TinyModelConfig(vocab_size=1024, hidden_size=32, num_attention_heads=2, head_dim=16),
        corpus=["a b c d e f g"] * 10,
    )
    out = tmp_path / "hf"
    with pytest.raises(ExportError, match="size mismatch|does not fit"):
        export_deepspeed(checkpoints / "zero0", other, out)
    assert not out.exists() and not list(tmp_path.glob(".*partial"))
    with pytest.raises(ValueError, match="dtype='float8'"):
        export_deepspeed(checkpoints / "zero0", tiny_model_dir, out, dtype="float8")


def test_wrapper_prefixes_are_stripped_and_adapters_refused():
    t = torch.zeros(1)
    assert set(normalize_state_dict_keys({"module.model.norm.weight": t, "lm_head.weight": t})) == {
        "model.norm.weight",
        "lm_head.weight",
    }
    assert set(normalize_state_dict_keys({"_orig_mod.module.lm_head.weight": t})) == {
        "lm_head.weight"
    }
    with pytest.raises(ExportError, match="adapter weights"):
        normalize_state_dict_keys({"base_model.model.q_proj.lora_A.default.weight": t})
    with pytest.raises(ExportError, match="two checkpoint entries"):
        normalize_state_dict_keys({"module.lm_head.weight": t, "lm_head.weight": t})


def _tied_template(tmp_path, tiny_model_dir):
    config = GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2,
        num_experts_per_tok=1, tie_word_embeddings=True, layer_types=["full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    template = tmp_path / "tied"
    model.save_pretrained(template)
    copy_template_files(tiny_model_dir, template)
    return model, template


@pytest.mark.parametrize("with_lm_head", [True, False])
def test_tied_embeddings_are_written_once_and_tied_again(tmp_path, tiny_model_dir, with_lm_head):
    model, template = _tied_template(tmp_path, tiny_model_dir)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if not with_lm_head:
        del state["lm_head.weight"]
    out = tmp_path / "out"
    written = write_hf_model(state, template, out, torch.float32)
    assert written.lm_head.weight is written.model.embed_tokens.weight
    assert "lm_head.weight" not in _safetensors(out)  # save_pretrained drops the tied copy
    copy_template_files(template, out)
    check_loadable(out, {k: v for k, v in model.state_dict().items()})
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)


def test_template_without_tokenizer_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ExportError, match="no tokenizer"):
        copy_template_files(tmp_path, tmp_path / "out")


@pytest.fixture
def trained_hf_dir(tmp_path, tiny_model_dir):
    """What the ``hf`` branch's GRPO step writes: the policy's weights (here: the tiny
    model's, changed) saved with ``save_pretrained`` in small shards, no tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 1e-3)
    out = tmp_path / "policy"
    model.save_pretrained(out, max_shard_size="500KB")
    assert len(list(out.glob("*.safetensors"))) > 1
    return out, {k: v.clone() for k, v in model.state_dict().items()}


def test_hf_directory_exports_exact_weights_with_the_templates_tokenizer(
    trained_hf_dir, tiny_model_dir, tmp_path
):
    source, weights = trained_hf_dir
    out = tmp_path / "out"
    result = export_hf_directory(source, tiny_model_dir, out, "float32")
    assert result.source_format == "hf" and result.dtype == "float32" and result.shards == 1
    assert "chat_template.jinja" in result.copied_files or "tokenizer.json" in result.copied_files
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert set(loaded) == set(weights)
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    assert not list(tmp_path.glob(".out.partial"))

    cast = export_hf_directory(source, tiny_model_dir, tmp_path / "bf16", "bfloat16")
    assert cast.dtype == "bfloat16"
    loaded = load_file(next((tmp_path / "bf16").glob("*.safetensors")))
    assert all(loaded[k].dtype == torch.bfloat16 for k in loaded)
    assert all(torch.equal(loaded[k], weights[k].to(torch.bfloat16)) for k in loaded)


def test_hf_directory_without_weights_is_an_error_and_leaves_nothing(tiny_model_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ExportError, match=r"no \*\.safetensors weights"):
        export_hf_directory(empty, tiny_model_dir, tmp_path / "out")
    with pytest.raises(ExportError, match="not a HF model directory"):
        export_hf_directory(tmp_path / "missing", tiny_model_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_hf_component_exports_the_grpo_policy_directory(
    trained_hf_dir, tiny_model_dir, tmp_path
):
    from components.megatron import export_hf

    source, weights = trained_hf_dir
    model = Model(uri=str(tmp_path / "model"))
    export_hf.python_func(
        checkpoint=Model(uri=str(source)),
        template_model=Model(uri=str(tiny_model_dir)),
        source_format="hf",
        model=model,
    )
    assert model.metadata["source_format"] == "hf" and model.metadata["dtype"] == "float32"
    loaded = AutoModelForCausalLM.from_pretrained(model.path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())


def test_export_hf_component_exports_the_deepspeed_work_dir(checkpoints, tiny_model_dir, tmp_path):
    from components.megatron import export_hf

    model = Model(uri=str(tmp_path / "model"))
    export_hf.python_func(
        checkpoint=Model(uri=str(checkpoints / "zero3")),
        template_model=Model(uri=str(tiny_model_dir)),
        source_format="deepspeed",
        model=model,
        dtype="float32",
    )
    assert model.metadata["format"] == "huggingface"
    assert model.metadata["source_format"] == "deepspeed" and model.metadata["dtype"] == "float32"
    expected = torch.load(checkpoints / "zero3" / "expected.pt")
    loaded = AutoModelForCausalLM.from_pretrained(model.path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    with pytest.raises(ValueError, match="source_format='fsdp'"):
        export_hf.python_func(
            checkpoint=Model(uri=str(checkpoints / "zero3")),
            template_model=Model(uri=str(tiny_model_dir)),
            source_format="fsdp",
            model=model,
        )


def test_megatron_export_adds_tokenizer_checks_loading_and_publishes_atomically(
    tmp_path, tiny_model_dir, monkeypatch
):
    # Megatron-Core cannot run on this CPU-only machine: a stand-in for
    # trainer.megatron.bridge writes what megatron-bridge's export writes (config + weights,
    # no tokenizer). The real bridge runs in test_megatron_gpu.py.
    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    fake = types.ModuleType("trainer.megatron.bridge")

    def export_megatron_to_hf(megatron_dir, hf_template_dir, out_dir):
        source.save_pretrained(out_dir)

    fake.export_megatron_to_hf = export_megatron_to_hf
    monkeypatch.setitem(sys.modules, "trainer.megatron.bridge", fake)
    megatron_dir = tmp_path / "megatron"
    megatron_dir.mkdir()
    out = tmp_path / "hf"
    result = export_megatron(megatron_dir, tiny_model_dir, out)
    assert result.source_format == "megatron" and result.dtype == "float32"
    assert (out / "chat_template.jinja").is_file() and (out / "tokenizer.json").is_file()
    assert AutoTokenizer.from_pretrained(out).chat_template

    def broken_export(megatron_dir, hf_template_dir, out_dir):
        source.save_pretrained(out_dir)
        weights = load_file(Path(out_dir) / "model.safetensors")
        del weights["model.norm.weight"]  # a weight the architecture needs goes missing
        save_file(weights, Path(out_dir) / "model.safetensors", metadata={"format": "pt"})

    fake.export_megatron_to_hf = broken_export
    with pytest.raises(ExportError, match="does not load cleanly"):
        export_megatron(megatron_dir, tiny_model_dir, tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists() and not list(tmp_path.glob(".*partial"))


def test_an_mxfp4_template_exports_unpacked_weights_without_its_quantization_config(
    mxfp4_model, tmp_path
):
    from core.modeling import load_causal_lm

    template, originals = mxfp4_model  # the hub's gpt-oss layout: the run started from it
    state = load_causal_lm(template, torch.bfloat16).state_dict()
    out = tmp_path / "out"
    write_hf_model(state, template, out, torch.bfloat16)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    copy_template_files(template, out)
    check_loadable(out, {**state, **originals})  # plain from_pretrained: the same bf16 weights


def test_each_checkpoint_format_has_its_exporter(monkeypatch):
    """The export step dispatches by ``source_format`` through ``EXPORTERS``; Megatron's
    ignores the dtype and shard size (megatron-bridge picks them)."""
    from trainer import export_hf

    calls = []
    monkeypatch.setattr(export_hf, "export_megatron", lambda *paths: calls.append(paths))
    export_hf.export_checkpoint("megatron", "ckpt", "template", "out", dtype="bfloat16")
    assert calls == [("ckpt", "template", "out")]
    assert set(export_hf.EXPORTERS) == {"hf", "deepspeed", "megatron"}
    with pytest.raises(ValueError, match="expected one of 'hf', 'deepspeed', 'megatron'"):
        export_hf.export_checkpoint("fsdp", "ckpt", "template", "out")
