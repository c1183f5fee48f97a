"""Settings of the 50-question eval: sampling, engines, endpoint client, failure threshold.

One typed model, validated once at the edge (CLI, component, notebook); its defaults are the
reference recipe's sampling parameters.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from core.config_model import ConfigModel
from generation.endpoint import EndpointSettings
from generation.requests import SamplingParams

DEFAULT_PERSONA = "You are a helpful assistant who solves word problems."
"""The fixed persona line after ``reasoning language: <Name>`` in the developer instructions."""


class SamplingSettings(ConfigModel):
    """Sampling parameters, recorded with the results.

    Attributes:
        temperature: 0 means greedy decoding.
        top_p: Nucleus sampling mass.
        max_tokens: New tokens per response (analysis + final).
        seed: Base seed; sample ``k`` of question ``q`` uses its own seed
            ``core.seeds.sample_seed(seed, "eval", q, k)`` (vLLM and endpoints per request,
            HF with one generator per row), never shared by two responses.
        n: Samples per question (for variance).
    """

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.7, ge=0.0, le=2.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    max_tokens: int = Field(512, ge=1)
    seed: int = 0
    n: int = Field(1, ge=1)

    @property
    def params(self) -> SamplingParams:
        """What every engine samples with (the seed and ``n`` make the requests)."""
        return SamplingParams(self.temperature, self.top_p, self.max_tokens)


class EvalConfig(ConfigModel):
    """Everything an eval run needs besides the models.

    Attributes:
        engine: Engine for model directories (``hf`` or ``vllm``); URLs always use the
            OpenAI-compatible endpoint client.
        sampling: Sampling parameters.
        endpoint: Endpoint client settings.
        batch_size: Prompts per ``generate`` call (HF engine).
        device: ``auto`` (CUDA when present), ``cpu`` or ``cuda[:i]`` (HF engine).
        dtype: ``auto`` (bf16 on a GPU that has it, else fp32), ``float32`` or ``bfloat16``.
        persona: The persona line of the developer instructions.
        reasoning_effort: The harmony system message's ``Reasoning:`` level (rendered prompts).
        questions: A JSONL file in the eval_50 schema; ``None``: the bundled eval_50.jsonl.
        languages: Only questions in these languages; ``None``: all.
        limit: Only the first ``limit`` questions (after the language filter); ``None``: all.
        max_failure_fraction: The run fails when a model's failed responses exceed this share.
        vllm_gpu_memory_utilization: vLLM's share of GPU memory.
        vllm_max_num_batched_tokens: vLLM's cap on the tokens of one scheduler step
            (``None``: vLLM's default; on vLLM's CPU build at least the model's length, as
            prompts are never split there: ``generation.vllm.vllm_scheduling_kwargs``).
    """

    model_config = ConfigDict(extra="forbid")

    engine: Literal["hf", "vllm"] = "hf"
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    endpoint: EndpointSettings = Field(default_factory=EndpointSettings)
    batch_size: int = Field(8, ge=1)
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    persona: str = DEFAULT_PERSONA
    reasoning_effort: Literal["low", "medium", "high"] = "medium"
    questions: str | None = None
    languages: list[str] | None = None
    limit: int | None = Field(None, ge=1)
    max_failure_fraction: float = Field(0.1, ge=0.0, le=1.0)
    vllm_gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    vllm_max_num_batched_tokens: int | None = Field(None, ge=16)
