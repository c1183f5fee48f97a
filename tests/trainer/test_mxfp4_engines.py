"""MXFP4 checkpoints and the GPU: the loaders unpack them even where transformers could keep them
packed (a GPU with its MXFP4 kernels), and a vLLM engine that runs one quantized refuses the
policy's bf16 weights with a clear error instead of loading them into packed buffers.

The refusal's logic runs here; the ``gpu`` tests run it for real (``pytest -m gpu``; the load
check is also in ``bench/gpu_check.py``). Why the GPU path differs: transformers 5.x keeps
MXFP4 when CUDA, triton and the ``kernels`` package are there (``quantizers/
quantizer_mxfp4.py``, ``validate_environment``: ``dequantize`` is forced only when one is
missing), and vLLM loads a ``quant_method: mxfp4`` config as its ``mxfp4`` quantization (its
``Mxfp4Config``, ``ModelConfig.quantization``), whose MoE weight loader takes packed experts.
"""

from __future__ import annotations

import pytest
import torch

from trainer.grpo.vllm_rollout import QuantizedEngineError, refuse_quantized_reload


def test_an_unquantized_engine_takes_the_policys_weights():
    refuse_quantized_reload(None, "/models/sft")  # nothing raised


def test_a_quantized_engine_refuses_a_reload_and_says_what_to_do():
    with pytest.raises(QuantizedEngineError) as raised:
        refuse_quantized_reload("mxfp4", "/models/gpt-oss-20b")
    message = str(raised.value)
    assert "/models/gpt-oss-20b" in message and "'mxfp4'" in message
    assert "bf16" in message and "SFT step's merged model" in message


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_the_loader_unpacks_mxfp4_on_a_gpu(mxfp4_model):
    from core.modeling import load_causal_lm

    model_dir, originals = mxfp4_model
    model = load_causal_lm(model_dir, torch.bfloat16, torch.device("cuda"))
    assert type(model.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    state = model.state_dict()
    for name, original in originals.items():
        assert torch.equal(state[name].cpu(), original), name


@pytest.mark.gpu
@needs_cuda
def test_a_vllm_engine_running_mxfp4_refuses_bf16_weights(tmp_path):
    pytest.importorskip("vllm")
    from mxfp4_checkpoint import write_mxfp4_checkpoint
    from transformers import AutoTokenizer

    from core.modeling import load_causal_lm
    from trainer.grpo.config import RolloutConfig
    from trainer.grpo.vllm_rollout import VLLMRolloutEngine
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    # vLLM's attention wants head_dim >= 64, its MXFP4 MoE kernels widths of 128 or more
    source = build_tiny_model(
        tmp_path / "bf16",
        TinyModelConfig(head_dim=64, num_attention_heads=2, num_key_value_heads=1, hidden_size=256),
    )
    write_mxfp4_checkpoint(source, tmp_path / "mxfp4")
    engine = VLLMRolloutEngine(
        str(tmp_path / "mxfp4"),
        AutoTokenizer.from_pretrained(source),
        RolloutConfig(max_new_tokens=4, max_prompt_tokens=256, gpu_memory_utilization=0.2),
        dtype="bfloat16",
    )
    assert engine.quantization == "mxfp4"
    policy = load_causal_lm(tmp_path / "mxfp4", torch.bfloat16)
    with pytest.raises(QuantizedEngineError, match="mxfp4"):
        engine.sync_weights((n, p.detach()) for n, p in policy.named_parameters())
