"""Rollout engines behind one small interface: a Hugging Face model with its KV cache, and vLLM.

An engine samples one response per seed of each prompt (token ids in, token ids out) and takes
the policy's new weights after each update (``sync_weights``). Every response has its own seed
(``eval.seeds.sample_seed`` of the run seed, step, prompt slot and sample index), so no two
responses share a random stream and a rerun draws the same ones. Responses end with the first
stop token (``<|return|>``, kept in the response so the policy learns to stop) or at the token
limit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from eval.modeling import cache_keyword, output_cache
from eval.sampling import row_generators, sample_tokens
from trainer.grpo.config import RolloutConfig
from trainer.placement import EnginePlacement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rollout:
    """One sampled response."""

    prompt_index: int
    response_ids: list[int]
    finished: bool
    """True when it ended with a stop token, False when cut by max_new_tokens."""


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> list[Rollout]:
        """One response per seed of each prompt (``seeds[i]``: prompt ``i``'s, all of one
        length ``n``), grouped: prompt 0's n responses first, then prompt 1's…"""
        ...

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's updated weights (HF parameter names)."""
        ...


def group_size(prompts: Sequence, seeds: Sequence[Sequence[int]]) -> int:
    """``n``, the responses per prompt; every prompt must have ``n`` seeds."""
    if len(seeds) != len(prompts) or len({len(s) for s in seeds}) > 1 or (seeds and not seeds[0]):
        raise ValueError(
            f"{len(prompts)} prompts with seed lists of lengths {[len(s) for s in seeds]}: give "
            "each prompt the same number (≥ 1) of seeds"
        )
    return len(seeds[0]) if seeds else 0


def generate_share(
    engine: RolloutEngine,
    prompts: Sequence[list[int]],
    seeds: Sequence[Sequence[int]],
    group: Sequence[int],
    rank: int,
    per_rank: int,
) -> list[Rollout]:
    """``rank``'s rollouts when one engine serves the ranks of ``group`` together.

    ``prompts`` and ``seeds`` are the whole step's (slot ``s`` belongs to rank
    ``s // per_rank``). The engine generates every slot of the group — the ranks of a vLLM
    engine in ``external_launcher`` mode must all submit the same requests — and ``rank``
    keeps its own, with prompt indices relative to its share.
    """
    slots = [s for member in group for s in range(member * per_rank, (member + 1) * per_rank)]
    out = engine.generate([prompts[s] for s in slots], [seeds[s] for s in slots])
    first = list(group).index(rank) * per_rank
    return [
        Rollout(r.prompt_index - first, r.response_ids, r.finished)
        for r in out
        if first <= r.prompt_index < first + per_rank
    ]


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

    ``model`` is a plain ``nn.Module`` the engine may share with the trainer (the policy
    itself, so there is nothing to sync) or own (a copy, updated by sync_weights).

    ``lockstep``: every rank runs the same number of forward passes, as a ZeRO-3 partitioned
    model needs (each forward gathers its parameters collectively): a rank whose rows have all
    stopped keeps stepping until every rank's have (one all-reduce per decode step, as HF's
    ``synced_gpus``). Every rank must then call ``generate`` with as many prompts.
    """

    def __init__(
        self, model, tokenizer, cfg: RolloutConfig, batch_size: int = 64, lockstep: bool = False
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.batch_size = batch_size
        self.lockstep = lockstep
        self.pad_id = tokenizer.pad_token_id
        eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
        self.stop_ids = set(eos if isinstance(eos, list) else [eos])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> list[Rollout]:
        n = group_size(prompts, seeds)
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        per_call = max(1, self.batch_size // max(n, 1))
        if self.lockstep:
            counts = torch.tensor([len(prompts), -len(prompts)], device=device)
            torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
            if int(counts[0]) != -int(counts[1]):
                raise ValueError(
                    f"lockstep generation: the ranks have {-int(counts[1])} to "
                    f"{int(counts[0])} prompts; every rank must generate as many (ZeRO-3 "
                    "forwards are collective)"
                )
        out: list[Rollout] = []
        try:
            for start in range(0, len(prompts), per_call):
                chunk = prompts[start : start + per_call]
                rows = [s for group in seeds[start : start + per_call] for s in group]
                out += self._generate_chunk(chunk, rows, start, n, device)
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(
        self, prompts: list[list[int]], seeds: list[int], first_index: int, n: int, device
    ):
        """Prefill each prompt once, copy its KV cache to its n samples, then decode.

        The decode loop is ours rather than ``model.generate``: one forward per token on the
        cache, temperature and nucleus (top-p) filtering, and a sample drawn by the
        exponential race (``argmax(p / E)``, ``E ~ Exp(1)``: the same distribution as
        ``multinomial(p)``, as vLLM samples), stopping when every row has hit a stop token
        (in ``lockstep``: every row of every rank).
        Row ``i`` draws its noise from its own generator (``seeds[i]``): its samples do not
        depend on the other rows of the chunk.
        """
        generators = row_generators(seeds, device)
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
            token = torch.where(finished, self.pad_id, self._sample(logits, generators))
            tokens[:, t] = token.cpu()
            finished |= torch.isin(token, stop)
            if t == self.cfg.max_new_tokens - 1 or self._all_done(bool(finished.all()), device):
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

    def _all_done(self, done: bool, device) -> bool:
        """``done`` on every rank (lockstep), else this rank's ``done``."""
        if not self.lockstep:
            return done
        flag = torch.tensor([int(done)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def _sample(self, logits: torch.Tensor, generators=None) -> torch.Tensor:
        """One token per row from ``softmax(logits / temperature)``, nucleus-filtered; row
        ``i`` from ``generators[i]`` (the global generator when None)."""
        return sample_tokens(logits, self.cfg.temperature, self.cfg.top_p, generators)

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))


def vllm_engine_kwargs(
    model_dir: str, cfg: RolloutConfig, engine: EnginePlacement | None, world_size: int, seed: int
) -> dict[str, object]:
    """``vllm.LLM`` keyword arguments for the engine a process takes part in.

    Under torchrun (``world_size`` > 1) each process of an engine runs one of its workers on
    its own GPU (``distributed_executor_backend="external_launcher"``; vLLM groups
    ``tensor_parallel_size`` consecutive ranks into one engine, as ``trainer.placement``
    does), and the workers of one engine share its seed. One process alone starts vLLM's
    own workers.
    """
    kwargs: dict[str, object] = {
        "model": str(model_dir),
        "tensor_parallel_size": engine.tensor_parallel_size if engine else cfg.tensor_parallel_size,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "enable_sleep_mode": cfg.colocate,
        "seed": seed + (engine.index if engine else 0),
        "dtype": "bfloat16",
    }
    if world_size > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    return kwargs


def vllm_request_params(
    seeds: Sequence[Sequence[int]], cfg: RolloutConfig
) -> list[list[dict[str, object]]]:
    """``vllm.SamplingParams`` keyword arguments for each response of each prompt.

    One request per response (``n=1``) with its own seed: ``SamplingParams(n=k, seed=s)``
    would seed sample ``i`` as ``s + i``, so one seed for every prompt makes sample ``i`` of
    all prompts share a stream. ``LLM.generate`` takes a list of params paired one by one
    with the prompts.
    """
    return [
        [
            {
                "n": 1,
                "temperature": cfg.temperature,
                "top_p": cfg.top_p,
                "max_tokens": cfg.max_new_tokens,
                "seed": seed,
                "skip_special_tokens": False,
            }
            for seed in group
        ]
        for group in seeds
    ]


class VLLMRolloutEngine:
    """vLLM ``LLM.generate``, one request per response (GPU; the ``gpu`` extra).

    Colocated (hybrid): the engine shares the training GPU and sleeps (level 1: weights
    offloaded to host, KV cache freed) while the policy updates; ``wake_up`` before the next
    rollout. Dedicated (non-hybrid): the engine owns its GPUs and stays awake. Either way the
    updated weights are loaded into the running engine through ``load_weights``. ``engine``
    is this process's engine in the run's ``PlacementPlan`` (None: one process, one engine).
    """

    def __init__(
        self,
        model_dir: str,
        tokenizer,
        cfg: RolloutConfig,
        seed: int = 0,
        engine: EnginePlacement | None = None,
        world_size: int = 1,
    ) -> None:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError(
                "rollout.engine='vllm' needs vLLM: pip install 'lingo-rl[gpu]'"
            ) from exc
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.llm = LLM(**vllm_engine_kwargs(model_dir, cfg, engine, world_size, seed))
        self.asleep = False

    def generate(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> list[Rollout]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n = group_size(prompts, seeds)
        self.wake_up()
        requests, params = [], []
        for prompt, group in zip(prompts, vllm_request_params(seeds, self.cfg), strict=True):
            for kwargs in group:
                requests.append(TokensPrompt(prompt_token_ids=prompt))
                params.append(SamplingParams(**kwargs))
        results = self.llm.generate(requests, params, use_tqdm=False)
        out = []
        for index, result in enumerate(results):
            completion = result.outputs[0]
            finished = completion.finish_reason == "stop"
            out.append(Rollout(index // n, list(completion.token_ids), finished))
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
