"""Generation engines of the eval: Hugging Face ``generate``, vLLM, and (in ``eval.endpoint``)
any OpenAI-compatible chat endpoint.

An engine takes ``GenerationRequest`` s (the harmony prompt text for local models, the chat
messages for endpoints) and returns one ``Generation`` per request, in order. A request that
fails comes back as a ``Generation`` with ``error`` set: nothing is dropped silently.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from core.harmony import stop_token_ids
from core.model_files import model_dir_problems
from core.vllm_scheduling import vllm_scheduling_kwargs
from eval.eval_config import EvalConfig, SamplingSettings
from eval.generation import Generation, GenerationRequest

log = logging.getLogger(__name__)


class ModelNotFoundError(FileNotFoundError):
    """A model directory that does not exist or is not a Hugging Face model directory."""


class Engine(Protocol):
    """Generates responses for requests; ``close`` frees the model."""

    description: str

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingSettings
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


class HFEngine:
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
        self.tokenizer = load_tokenizer(path)
        self.tokenizer.padding_side = "left"
        self.model = load_causal_lm(path, resolve_dtype(dtype, self.device), self.device)
        self.model.eval()
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(self.tokenizer, self.model.generation_config)
        self.description = f"hf:{path} ({self.device}, {self.model.dtype})"

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingSettings
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
        self, requests: Sequence[GenerationRequest], sampling: SamplingSettings, began: float
    ) -> list[Generation]:
        import torch
        from transformers import LogitsProcessorList

        from core.sampling import PerRowSampler, row_generators

        encoded = self.tokenizer(
            [r.prompt for r in requests],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        ).to(self.device)
        kwargs: dict[str, object] = {
            "max_new_tokens": sampling.max_tokens,
            "eos_token_id": self.stop_ids,
            "pad_token_id": self.tokenizer.pad_token_id,
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


class VLLMEngine:
    """vLLM offline generation (GPU; the ``gpu`` extra). One request seed per response
    (``request.seed``, from ``core.seeds``).

    Args:
        model_dir: A Hugging Face model directory.
        dtype: ``auto``, ``float32`` or ``bfloat16``.
        gpu_memory_utilization: vLLM's share of GPU memory.
        max_num_batched_tokens: vLLM's cap on the tokens of one scheduler step (None: its
            default; see ``vllm_scheduling_kwargs`` for vLLM's CPU build).

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
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError(
                "the vllm eval engine needs vLLM: pip install 'lingo-rl[gpu]' (or use engine=hf)"
            ) from err
        from vllm.platforms import current_platform

        from core.modeling import load_generation_config

        kwargs: dict[str, object] = {"model": str(path), "dtype": dtype}
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        model_len = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
        kwargs |= vllm_scheduling_kwargs(
            max_num_batched_tokens, model_len or 8192, current_platform.is_cpu()
        )
        self.llm = LLM(**kwargs)
        tokenizer = self.llm.get_tokenizer()
        self.stop_ids = stop_token_ids(tokenizer, load_generation_config(path))
        self.description = f"vllm:{path}"

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingSettings
    ) -> list[Generation]:
        """Generate all requests in one call; special tokens are kept in the text."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        tokenizer = self.llm.get_tokenizer()
        prompts = [
            TokensPrompt(prompt_token_ids=tokenizer.encode(r.prompt, add_special_tokens=False))
            for r in requests
        ]
        params = [
            SamplingParams(**kw) for kw in vllm_request_params(requests, sampling, self.stop_ids)
        ]
        began = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        latency = (time.perf_counter() - began) / max(len(requests), 1)
        results = []
        for output in outputs:
            completion = output.outputs[0]
            text = completion.text
            if completion.finish_reason == "stop" and completion.token_ids:
                last = completion.token_ids[-1]
                if last in self.stop_ids and not text.endswith(tokenizer.decode([last])):
                    text += tokenizer.decode([last])
            results.append(
                Generation(
                    text=text,
                    finish_reason=completion.finish_reason,
                    completion_tokens=len(completion.token_ids),
                    latency_s=latency,
                )
            )
        return results

    def close(self) -> None:
        """Drop the engine."""
        del self.llm


def vllm_request_params(
    requests: Sequence[GenerationRequest], sampling: SamplingSettings, stop_ids: Sequence[int]
) -> list[dict[str, object]]:
    """``vllm.SamplingParams`` keyword arguments, one per request (``LLM.generate`` pairs a
    list of params with the prompts one by one): one response each, with its own seed."""
    return [
        {
            "n": 1,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
            "seed": r.seed,
            "stop_token_ids": list(stop_ids),
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        for r in requests
    ]


def is_endpoint(location: str) -> bool:
    """True for an ``http(s)://`` URL (an OpenAI-compatible endpoint)."""
    return location.startswith(("http://", "https://"))


def make_engine(location: str, config: EvalConfig, served_model: str | None = None) -> Engine:
    """The engine for a model location: an endpoint URL, or a directory with ``config.engine``.

    Raises:
        ModelNotFoundError: A directory that does not exist.
    """
    if is_endpoint(location):
        from eval.endpoint import ChatEndpointEngine

        return ChatEndpointEngine(location, served_model, config.endpoint)
    if config.engine == "vllm":
        return VLLMEngine(
            location,
            config.dtype,
            config.vllm_gpu_memory_utilization,
            config.vllm_max_num_batched_tokens,
        )
    return HFEngine(location, config.device, config.dtype, config.batch_size)
