"""Rollout engines behind one small interface: a Hugging Face model with its KV cache, and vLLM.

An engine samples ``n`` responses per prompt (token ids in, token ids out) and takes the
policy's new weights after each update (``sync_weights``). Responses end with the first stop
token (``<|return|>``, kept in the response so the policy learns to stop) or at the token limit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from eval.modeling import cache_keyword, output_cache
from trainer.grpo.config import RolloutConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rollout:
    """One sampled response."""

    prompt_index: int
    response_ids: list[int]
    finished: bool
    """True when it ended with a stop token, False when cut by max_new_tokens."""


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], n: int, seed: int) -> list[Rollout]:
        """``n`` responses per prompt, grouped: prompt 0's n responses first, then prompt 1's…"""
        ...

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's updated weights (HF parameter names)."""
        ...


def cut_at_stop(ids: list[int], stop_ids: set[int], pad_id: int) -> tuple[list[int], bool]:
    """Response ids up to and including the first stop token; padding removed."""
    for i, token in enumerate(ids):
        if token in stop_ids:
            return ids[: i + 1], True
    while ids and ids[-1] == pad_id:
        ids = ids[:-1]
    return ids, False


class HFRolloutEngine:
    """Sampling with a Hugging Face model and its KV cache (CPU or GPU).

    ``model`` is a plain ``nn.Module`` the engine may share with the trainer (single process:
    the policy itself, so there is nothing to sync) or own (a copy, updated by sync_weights).
    """

    def __init__(self, model, tokenizer, cfg: RolloutConfig, batch_size: int = 64) -> None:
        self.model = model
        self.cfg = cfg
        self.batch_size = batch_size
        self.pad_id = tokenizer.pad_token_id
        eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
        self.stop_ids = set(eos if isinstance(eos, list) else [eos])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, seed: int) -> list[Rollout]:
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        torch.manual_seed(seed)
        per_call = max(1, self.batch_size // n)
        out: list[Rollout] = []
        try:
            for start in range(0, len(prompts), per_call):
                chunk = prompts[start : start + per_call]
                out += self._generate_chunk(chunk, start, n, device)
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, prompts: list[list[int]], first_index: int, n: int, device):
        """Prefill each prompt once, copy its KV cache to its n samples, then decode.

        The decode loop is ours rather than ``model.generate``: one forward per token on the
        cache, temperature and nucleus (top-p) filtering, and a sample drawn by the
        exponential race (``argmax(p / E)``, ``E ~ Exp(1)``: the same distribution as
        ``multinomial(p)``, as vLLM samples), stopping when every row has hit a stop token.
        """
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        prefill = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
        )
        cache = output_cache(prefill)
        cache.batch_repeat_interleave(n)
        keyword = cache_keyword(self.model)
        logits = prefill.logits[:, -1, :].repeat_interleave(n, 0)
        attention = mask.repeat_interleave(n, 0)
        position = mask.sum(-1).repeat_interleave(n, 0)
        rows = attention.shape[0]
        stop = torch.tensor(sorted(self.stop_ids), device=device)
        tokens = torch.full((rows, self.cfg.max_new_tokens), self.pad_id, dtype=torch.long)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        for t in range(self.cfg.max_new_tokens):
            token = torch.where(finished, self.pad_id, self._sample(logits))
            tokens[:, t] = token.cpu()
            finished |= torch.isin(token, stop)
            if bool(finished.all()) or t == self.cfg.max_new_tokens - 1:
                break
            attention = torch.cat([attention, attention.new_ones(rows, 1)], dim=1)
            logits = self.model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=position[:, None],
                use_cache=True,
                **{keyword: cache},
            ).logits[:, -1, :]
            position = position + 1
        out = []
        for row in range(rows):
            response, done = cut_at_stop(tokens[row].tolist(), self.stop_ids, self.pad_id)
            out.append(Rollout(first_index + row // n, response, done))
        return out

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row from ``softmax(logits / temperature)``, nucleus-filtered."""
        probs = torch.softmax(logits.float() / self.cfg.temperature, dim=-1)
        if self.cfg.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always the top token)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.cfg.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return torch.argmax(probs / torch.empty_like(probs).exponential_(), dim=-1)

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))


class VLLMRolloutEngine:
    """vLLM ``LLM.generate`` with ``n`` samples (GPU; the ``gpu`` extra).

    Colocated (hybrid): the engine shares the training GPU and sleeps (level 1: weights
    offloaded to host, KV cache freed) while the policy updates; ``wake_up`` before the next
    rollout. Dedicated (non-hybrid): the engine owns its GPUs and stays awake. Either way the
    updated weights are loaded into the running engine through ``load_weights``.
    """

    def __init__(self, model_dir: str, tokenizer, cfg: RolloutConfig, seed: int = 0) -> None:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError(
                "rollout.engine='vllm' needs vLLM: pip install 'lingo-rl[gpu]'"
            ) from exc
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.llm = LLM(
            model=str(model_dir),
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_sleep_mode=cfg.colocate,
            seed=seed,
            dtype="bfloat16",
        )
        self.asleep = False

    def generate(self, prompts: list[list[int]], n: int, seed: int) -> list[Rollout]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up()
        params = SamplingParams(
            n=n,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            max_tokens=self.cfg.max_new_tokens,
            seed=seed,
            skip_special_tokens=False,
        )
        results = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        out = []
        for index, result in enumerate(results):
            for completion in result.outputs:
                finished = completion.finish_reason == "stop"
                out.append(Rollout(index, list(completion.token_ids), finished))
        return out

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.wake_up()
        weights = list(named_tensors)

        def load(worker):  # runs inside each vLLM worker process
            worker.model_runner.model.load_weights(weights=weights)

        self.llm.collective_rpc(load)
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the GPU for the policy update (colocated engines only)."""
        if self.cfg.colocate and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
