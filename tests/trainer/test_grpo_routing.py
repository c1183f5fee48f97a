"""Routing replay on the tiny GPT-OSS: the HF engine records its routers' choices, the
training forward replays them (gate weights still learn), and with an engine whose routing is
perturbed the replay lowers the engine/trainer mismatch."""

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from tests_helpers_trainer import fixed_grpo_batch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.routing_replay import perturbed_engine_batch, update_stats
from core.seeds import group_seeds
from trainer.grpo.config import GRPOConfig, RolloutConfig
from trainer.grpo.micro_batch import micro_log_probs, sequences, with_routing
from trainer.grpo.prompts import Prompt
from trainer.grpo.rollout import HFRolloutEngine, Rollout
from trainer.grpo.routing import RouterCounts, RoutingRecorder, moe_routers


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _own_routing(model, prompt: list[int], response: list[int]):
    """The model's own choices over every token it would run for prompt + response."""
    recorder = RoutingRecorder(model)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([(prompt + response)[:-1]]))
        return recorder.take().numpy()
    finally:
        recorder.close()


def _case(model):
    gen = torch.Generator().manual_seed(0)
    prompts = [
        Prompt(torch.randint(5, 1000, (n,), generator=gen).tolist(), "fr", str(n)) for n in (9, 40)
    ]
    responses = [[20, 21, 22], [40, 41, 42, 43, 44], [], [30, 31, 32, 33, 34, 35]]
    owners = [0, 0, 1, 1]
    rollouts = [
        Rollout(o, r, True, None, _own_routing(model, prompts[o].ids, r))
        for o, r in zip(owners, responses, strict=True)
    ]
    return prompts, rollouts


def test_hf_engine_records_the_routing_of_every_token_it_ran(model, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFRolloutEngine(model, tokenizer, RolloutConfig(n_samples=2, max_new_tokens=12))
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    out = engine.generate(prompts, group_seeds(0, 0, range(2), 2))
    layers, k = len(moe_routers(model)), model.config.num_experts_per_tok
    assert layers == model.config.num_hidden_layers and k >= 2
    agree = total = 0
    for rollout in out:
        prompt = prompts[rollout.prompt_index]
        record = rollout.routed_experts
        assert record.shape == (len(prompt) + len(rollout.response_ids) - 1, layers, k)
        own = _own_routing(model, prompt, rollout.response_ids)
        # the cached decode vs one full forward: the same experts (as sets) but at near-ties
        agree += int((np.sort(record, -1) == np.sort(own, -1)).all(-1).sum())
        total += record.shape[0] * layers
    assert agree / total > 0.98


def test_replaying_the_model_s_own_routing_changes_nothing(model):
    prompts, rollouts = _case(model)
    layout = sequences(prompts, rollouts, 0, "cpu")
    assert layout.shared is not None
    work = copy.deepcopy(model).train()

    def run(micro):
        work.zero_grad()
        log_probs, _ = micro_log_probs(work, micro, False)
        (log_probs * layout.mask).sum().backward()
        router = moe_routers(work)[0]
        return log_probs.detach() * layout.mask, router.weight.grad.clone()

    plain, plain_grad = run(layout)
    counts = RouterCounts()
    replayed = with_routing(sequences(prompts, rollouts, 0, "cpu"), prompts, rollouts, True, counts)
    value, grad = run(replayed)  # shared-prefix forwards, replayed
    torch.testing.assert_close(value, plain, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad, plain_grad, atol=1e-5, rtol=1e-3)
    assert counts.compared > 0 and counts.differ == 0
    full = sequences(prompts, rollouts, 0, "cpu")
    full.shared = None
    value, grad = run(with_routing(full, prompts, rollouts, True, None))  # full rows
    torch.testing.assert_close(value, plain, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad, plain_grad, atol=1e-5, rtol=1e-3)


def test_replay_routes_by_the_record_and_the_gates_still_learn(model):
    prompts, rollouts = _case(model)
    experts = model.config.num_local_experts
    moved = [(r.routed_experts + 1) % experts for r in rollouts]  # every choice one over
    other = [replace(r, routed_experts=m) for r, m in zip(rollouts, moved, strict=True)]
    work = copy.deepcopy(model).train()
    logits_seen, experts_seen = [], []  # layer 1's router logits, what its experts are given
    handles = [
        moe_routers(work)[1].register_forward_hook(lambda m, a, out: logits_seen.append(out[0])),
        work.model.layers[1].mlp.experts.register_forward_pre_hook(
            lambda m, args: experts_seen.append(args[1:])
        ),
    ]
    counts = RouterCounts()
    micro = with_routing(sequences(prompts, other, 0, "cpu"), prompts, other, True, counts)
    micro.shared = None
    log_probs, _ = micro_log_probs(work, micro, False)
    for handle in handles:
        handle.remove()
    plain, _ = micro_log_probs(work, sequences(prompts, rollouts, 0, "cpu"), False)
    assert not torch.allclose(log_probs * micro.mask, plain * micro.mask, atol=1e-3)
    # every recorded choice was moved off the model's own (a near-tie in the batched forward
    # may land its own choice on the moved one)
    assert counts.differ >= 0.97 * counts.compared > 0
    # the experts get the replayed choice, gated by the softmax of the router's own logits
    logits, (chosen, scores) = logits_seen[-1], experts_seen[-1]
    given = micro.routing.full[:, :, 1, :].reshape(-1, chosen.shape[-1])
    known = (given >= 0).all(-1)
    assert torch.equal(chosen[known], given[known])
    torch.testing.assert_close(scores, torch.softmax(logits.gather(-1, chosen), -1))
    (log_probs * micro.mask).sum().backward()
    assert all(float(r.weight.grad.abs().sum()) > 0 for r in moe_routers(work))


def test_replay_lowers_the_mismatch_of_an_engine_whose_routing_is_perturbed(model, tiny_model_dir):
    """bench/routing_replay.py's engine (router weights with noise) and update."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = perturbed_engine_batch(model, tokenizer, 0.3)
    without = update_stats(model, batch, "off")
    replayed = update_stats(model, batch, "rollout")
    # the share of choices the trainer's own routers would make otherwise (replayed, the
    # layers below route as the engine did, so a layer's own choice is measured on their output)
    assert without["router_mismatch_rate"] > 0.05 and replayed["router_mismatch_rate"] > 0.05
    assert replayed["rollout_kl"] < 0.5 * without["rollout_kl"], (replayed, without)
    assert replayed["rollout_logprob_diff_p99"] < without["rollout_logprob_diff_p99"]


def test_replay_needs_the_engine_s_routing_and_an_hf_backend(model):
    batch = fixed_grpo_batch(int(model.config.vocab_size))  # rollouts without routing
    with pytest.raises(ValueError, match="rollout 0 of the batch carries no expert routing"):
        update_stats(model, batch, "rollout")
    with pytest.raises(ValidationError, match="Megatron backend"):
        GRPOConfig.model_validate(
            {
                "algorithm": {"router_replay": "rollout"},
                "optim": {"backend": "megatron", "megatron": {"layout": "tiny-cpu"}},
            }
        )


def test_the_routing_travels_with_the_rollouts_it_belongs_to(model):
    """Rollouts made ahead of their step are kept as JSON by the checkpoint, and cross to the
    training processes pickled (``trainer.grpo.remote``): the routing comes back whole."""
    import json
    import pickle

    from trainer.grpo.producer import StepRollouts

    _, rollouts = _case(model)
    made = StepRollouts(3, 2, rollouts, 0.5)
    back = StepRollouts.from_json(json.loads(json.dumps(made.to_json())))
    crossed = pickle.loads(pickle.dumps(rollouts))
    for copies in (back.rollouts, crossed):
        assert copies == rollouts  # everything but the routing (not compared by ==) …
        for a, b in zip(copies, rollouts, strict=True):  # … which comes back whole
            assert a.routed_experts.dtype == np.int16
            assert np.array_equal(a.routed_experts, b.routed_experts)
