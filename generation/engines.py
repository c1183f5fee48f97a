"""The generation engines of the eval and of GRPO, and what they share.

Every engine of the project is one of four: a Hugging Face model in this process
(``HFGenerator``: the eval's ``HFEngine``, GRPO's ``HFRolloutEngine``), vLLM in this process
(``generation.vllm.VLLMGenerator``: the eval's ``VLLMEngine``, GRPO's ``VLLMRolloutEngine``),
vLLM in processes of its own (GRPO's dedicated and remote engines, built on the same
``VLLMGenerator``), and an OpenAI-compatible endpoint (``generation.endpoint``). They load
models (``core.modeling``), take their stop tokens (``core.harmony.stop_token_ids``), seed
each response (one seed per response, ``core.seeds``) and read their sampling parameters
(``generation.sampling.SamplingParams``) in one way.

The eval's engines take ``GenerationRequest`` s (the harmony prompt text for local models,
the chat messages for endpoints) and return one ``Generation`` per request, in order. A
request that fails comes back as a ``Generation`` with ``error`` set: nothing is dropped
silently. GRPO's take token ids and return ``Rollout`` s (``trainer.grpo.rollout``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from core.harmony import stop_token_ids
from core.model_files import model_dir_problems
from generation.requests import Generation, GenerationRequest, SamplingParams
from generation.vllm import (
    VLLMGenerator,
    completion_text,
    import_llm,
    on_cpu,
    vllm_model_kwargs,
)


class ModelNotFoundError(FileNotFoundError):
    """A model directory that does not exist or is not a Hugging Face model directory."""


class Engine(Protocol):
    """Generates responses for requests; ``close`` frees the model."""

    description: str

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[Generation]: ...

    def close(self) -> None: ...


def require_model_dir(path: str | Path) -> Path:
    """``path`` as a Hugging Face model directory whose config, tokenizer files and weight
    files are there and readable (``core.model_files``); ``ModelNotFoundError`` naming every
    problem if not."""
    path = Path(path)
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model directory {path} does not exist; pass a Hugging Face model directory or an "
            "http(s):// URL of an OpenAI-compatible endpoint"
        )
    problems = model_dir_problems(path)
    if problems:
        raise ModelNotFoundError("; ".join(problems))
    return path


def is_endpoint(location: str) -> bool:
    """True for an ``http(s)://`` URL (an OpenAI-compatible endpoint)."""
    return location.startswith(("http://", "https://"))


class HFGenerator:
    """A Hugging Face causal LM that generates in this process: the model, its tokenizer's pad
    id and the stop tokens (``core.harmony.stop_token_ids`` with the model's generation
    config; a response keeps its stop token)."""

    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = stop_token_ids(tokenizer, model.generation_config)


class HFEngine(HFGenerator):
    """Batched ``transformers`` generation (CPU or GPU), left padding, harmony stop tokens.

    Args:
        model_dir: A Hugging Face model directory with a harmony tokenizer.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:1`` …
        dtype: ``auto``, ``float32`` or ``bfloat16``.
        batch_size: Prompts per ``generate`` call.

    Raises:
        ModelNotFoundError: ``model_dir`` is missing or not a model directory.
    """

    def __init__(
        self, model_dir: str | Path, device: str = "auto", dtype: str = "auto", batch_size: int = 8
    ) -> None:
        import torch

        from core.modeling import load_causal_lm, load_tokenizer, resolve_dtype

        path = require_model_dir(model_dir)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        tokenizer = load_tokenizer(path)
        tokenizer.padding_side = "left"
        model = load_causal_lm(path, resolve_dtype(dtype, self.device), self.device)
        model.eval()
        super().__init__(model, tokenizer)
        self.batch_size = batch_size
        self.description = f"hf:{path} ({self.device}, {self.model.dtype})"

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[Generation]:
        """Generate in batches of ``batch_size``; each request samples with its own generator
        (seeded with ``request.seed``), so a response does not depend on its batch."""
        out: list[Generation] = []
        for start in range(0, len(requests), self.batch_size):
            batch = requests[start : start + self.batch_size]
            began = time.perf_counter()
            out.extend(self._generate_batch(batch, sampling, began))
        return out

    def _generate_batch(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams, began: float
    ) -> list[Generation]:
        import torch
        from transformers import LogitsProcessorList

        from generation.sampling import PerRowSampler, row_generators

        encoded = self.tokenizer(
            [r.prompt for r in requests],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        ).to(self.device)
        kwargs: dict[str, object] = {
            "max_new_tokens": sampling.max_tokens,
            "eos_token_id": self.stop_ids,
            "pad_token_id": self.pad_id,
            # PerRowSampler draws the token; generate's own step is greedy on its output
            "do_sample": False,
            "temperature": None,
            "top_p": None,
            "top_k": None,
        }
        if sampling.temperature > 0:
            generators = row_generators([r.seed for r in requests], self.device)
            sampler = PerRowSampler(sampling.temperature, sampling.top_p, generators)
            kwargs["logits_processor"] = LogitsProcessorList([sampler])
        with torch.inference_mode():
            output = self.model.generate(**encoded, **kwargs)
        new_tokens = output[:, encoded["input_ids"].shape[1] :].tolist()
        latency = (time.perf_counter() - began) / len(requests)
        results = []
        stops = set(self.stop_ids)
        for ids in new_tokens:
            end = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
            kept = ids if end is None else ids[:end]
            results.append(
                Generation(
                    text=self.tokenizer.decode(kept, skip_special_tokens=False),
                    finish_reason="length" if end is None else "stop",
                    completion_tokens=len(kept),
                    latency_s=latency,
                )
            )
        return results

    def close(self) -> None:
        """Drop the model (and free GPU memory)."""
        import torch

        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class VLLMEngine(VLLMGenerator):
    """vLLM offline generation (GPU; the ``gpu`` extra). One request seed per response
    (``request.seed``, from ``core.seeds``).

    Args:
        model_dir: A Hugging Face model directory.
        dtype: ``auto``, ``float32`` or ``bfloat16``.
        gpu_memory_utilization: vLLM's share of GPU memory.
        max_num_batched_tokens: vLLM's cap on the tokens of one scheduler step (None: its
            default; see ``generation.vllm.vllm_scheduling_kwargs`` for vLLM's CPU build).

    Raises:
        ModelNotFoundError: ``model_dir`` is missing or not a model directory.
        ImportError: vLLM is not installed.
    """

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.85,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        path = require_model_dir(model_dir)
        llm = import_llm(
            "the vllm eval engine needs vLLM: pip install 'lingo-rl[gpu]' (or use engine=hf)"
        )
        model_len = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
        kwargs = vllm_model_kwargs(
            path, dtype, gpu_memory_utilization, max_num_batched_tokens, model_len or 8192, on_cpu()
        )
        super().__init__(llm(**kwargs), path)
        self.description = f"vllm:{path}"

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[Generation]:
        """Generate all requests in one call; special tokens are kept in the text."""
        tokenizer = self.tokenizer
        prompts = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
        began = time.perf_counter()
        completions = self.complete(prompts, [r.seed for r in requests], sampling, stop_text=True)
        latency = (time.perf_counter() - began) / max(len(requests), 1)
        return [
            Generation(
                text=completion_text(completion, tokenizer, self.stop_ids),
                finish_reason=completion.finish_reason,
                completion_tokens=len(completion.token_ids),
                latency_s=latency,
            )
            for completion in completions
        ]

    def close(self) -> None:
        """Drop the engine."""
        del self.llm
