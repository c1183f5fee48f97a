"""The policy's weights as vLLM's in-place reload takes them (trainer/grpo/vllm_weights.py),
without vLLM: the stream's GPT-OSS rules, and the attention sinks fed to the loader of vLLM
0.32 (none: the reload wraps vLLM's default loader) and of vLLM 0.33 (their own). The
reload itself runs on vLLM's CPU build in tests/vllm_engines (``make test-vllm``)."""

from __future__ import annotations

import functools
import logging

import torch
from tests_helpers_trainer import AliveBytes
from transformers import AutoModelForCausalLM

from trainer.grpo.vllm_weights import (
    SyncedWeights,
    VLLMWeights,
    _derived_state_layers,
    _DerivedStateFilter,
    load_sink,
    weight_buckets,
)


def test_vllm_weights_split_experts_and_set_sinks_aside(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    params = dict(model.named_parameters())
    weights = VLLMWeights((n, p.detach()) for n, p in params.items())
    streamed = dict(weights.checkpoint_format())
    experts = params["model.layers.0.mlp.experts.gate_up_proj"]
    for e in range(experts.shape[0]):
        assert torch.equal(streamed[f"model.layers.0.mlp.experts.{e}.w13_weight"], experts[e])
    down_bias = params["model.layers.1.mlp.experts.down_proj_bias"]
    assert torch.equal(streamed["model.layers.1.mlp.experts.3.w2_bias"], down_bias[3])
    assert not [n for n in streamed if n.endswith(("gate_up_proj", "down_proj", "sinks"))]
    assert torch.equal(streamed["lm_head.weight"], params["lm_head.weight"])
    sinks = dict(weights.sinks)  # every head: the loader keeps its rank's
    assert set(sinks) == {f"model.layers.{i}.attn.sinks" for i in range(2)}
    assert torch.equal(sinks["model.layers.0.attn.sinks"], params["model.layers.0.self_attn.sinks"])
    assert weights.count == len(params)
    assert weights.bytes == sum(p.numel() * p.element_size() for p in params.values())


def test_vllm_weights_draw_one_tensor_at_a_time():
    drawn = []

    def producer():
        for i in range(3):
            drawn.append(i)
            yield f"model.layers.{i}.mlp.router.weight", torch.zeros(2)

    stream = VLLMWeights(producer()).checkpoint_format()
    assert drawn == []
    next(stream)
    assert drawn == [0]  # nothing is gathered ahead of the consumer


def test_a_sync_holds_one_bucket_at_a_time_whatever_the_model_size(tiny_model_dir):
    """The weight stream (HF names, as a training backend's ``hf_weights`` gives them) goes
    into vLLM's reload in buckets: what is alive at once stays under the budget plus the one
    tensor that opens the next bucket, never the model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    budget = 16 << 10
    recorder, synced, loaded = AliveBytes(), SyncedWeights(), {}
    for bucket in weight_buckets(recorder.stream(params.items()), budget, synced):
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= max(budget, recorder.largest)
        loaded.update((n, t.clone()) for n, t in VLLMWeights(bucket).checkpoint_format())
        del bucket  # what the reload does once a bucket is loaded
    assert synced.count == len(params) and synced.bytes == total
    assert synced.buckets > 10 and synced.largest_bucket <= max(budget, recorder.largest)
    assert recorder.peak <= budget + recorder.largest < total / 2  # the embeddings: 1/4
    assert recorder.alive == 0
    experts = params["model.layers.1.mlp.experts.down_proj"]
    assert torch.equal(loaded["model.layers.1.mlp.experts.0.w2_weight"], experts[0])


def _reload_wrapped(original):
    """A loader wrapped as vLLM's layerwise reload wraps every parameter's
    (``reload/layerwise.py``, ``make_online_process_loader``: ``functools.wraps`` with only
    the doc and annotations, so the wrapper keeps its own name and ``__wrapped__``)."""
    calls = []

    @functools.wraps(original, assigned=("__doc__", "__annotations__"))
    def online_process_loader(param, loaded_weight):
        calls.append(loaded_weight.clone())
        return original(param, loaded_weight)

    return online_process_loader, calls


def default_weight_loader(param, loaded_weight):  # vLLM's contract: shapes equal, a copy
    assert param.shape == loaded_weight.shape
    param.data.copy_(loaded_weight)


def _sinks_of_their_own(tp_rank: int, tp_size: int):
    """vLLM 0.33's sinks loader, as its contract reads (``weight_utils.load_attention_sink``:
    the global sinks in, this rank's heads kept)."""

    def load_attention_sink(param, loaded_weight):
        heads = loaded_weight.numel() // tp_size
        param.data[:heads].copy_(loaded_weight.narrow(0, tp_rank * heads, heads))

    return load_attention_sink


GLOBAL = torch.arange(8, dtype=torch.float32)  # 8 heads; rank 1 of 2 keeps heads 4..7


def test_vllm_032_sinks_go_to_the_reloads_default_loader_cut_to_the_rank():
    param = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    param.weight_loader, calls = _reload_wrapped(default_weight_loader)
    load_sink(param, GLOBAL, tp_rank=1, tp_size=2)
    assert len(calls) == 1 and torch.equal(calls[0], GLOBAL[4:])  # counted by the reload
    assert torch.equal(param.data, GLOBAL[4:])


def test_vllm_033_sinks_go_whole_to_their_own_loader():
    param = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    param.weight_loader, calls = _reload_wrapped(_sinks_of_their_own(1, 2))
    load_sink(param, GLOBAL, tp_rank=1, tp_size=2)
    assert len(calls) == 1 and torch.equal(calls[0], GLOBAL)  # the loader cuts them itself
    assert torch.equal(param.data, GLOBAL[4:])


def test_sinks_without_any_loader_are_copied_in():
    param = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    load_sink(param, GLOBAL, tp_rank=0, tp_size=2)
    assert torch.equal(param.data, GLOBAL[:4])


class Rotary(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(4), persistent=False)


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.zeros(2))
        self.rotary = Rotary()


def test_only_layers_of_derived_state_have_their_failed_loads_unreported():
    model = torch.nn.Sequential(Attention(), torch.nn.Linear(2, 2))
    layers = _derived_state_layers(model)
    assert layers == {"Rotary"}
    quiet = _DerivedStateFilter(layers)

    def record(layer: str) -> logging.LogRecord:
        return logging.LogRecord(
            "x", logging.WARNING, "", 0, "%s: Failed to load weights", (layer,), None
        )

    assert not quiet.filter(record("Rotary"))  # a cache vLLM computes: put back as it was
    assert quiet.filter(record("Attention"))  # stale sinks stay reported
    other = logging.LogRecord("x", logging.WARNING, "", 0, "Rotary went wrong", (), None)
    assert quiet.filter(other)


def test_failed_loads_are_unreported_when_records_arrive_formatted_and_redacted():
    # every step redacts its log records when they are made (core.redact), which formats
    # them: the filter matched the raw format string and let vLLM's warning through
    from core.redact import _redact_record

    quiet = _DerivedStateFilter({"Rotary"})
    for layer, kept in (("Rotary", False), ("Attention", True)):
        record = logging.LogRecord(
            "x", logging.WARNING, "", 0, "%s: Failed to load weights", (layer,), None
        )
        _redact_record(record)
        assert record.args is None
        assert quiet.filter(record) is kept
