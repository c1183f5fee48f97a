"""The HF-side GRPO code under the transformers that megatron-bridge 0.6 pins (≤ 5.12.1,
where the KV cache is the ``past_key_values`` keyword): the rollout engine's decode loop and the
update's shared-prefix path must work there too (the Megatron image has no vLLM)."""

from __future__ import annotations

import torch


def test_rollout_and_shared_prefix_under_the_pinned_transformers(megatron_bridge, tiny_models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.modeling import cache_keyword
    from trainer.grpo.config import RolloutConfig
    from trainer.grpo.micro_batch import sequences as _sequences
    from trainer.grpo.prompts import Prompt
    from trainer.grpo.rollout import HFRolloutEngine, Rollout

    model_dir = tiny_models["square"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print("cache keyword:", cache_keyword(model))
    engine = HFRolloutEngine(model, tokenizer, RolloutConfig(max_new_tokens=6, top_p=1e-6))
    prompt = list(range(5, 45))  # longer than the 32-token sliding window
    out = engine.generate([prompt], [[0, 1]])
    # the reference: greedy by full forwards, no cache (transformers 5.12.1's own `generate`
    # departs from it on this prompt: at token 6 its top-2 logits are 0.4319 vs 0.4303 and
    # it picks the second; a full forward and our cached loop agree on the first)
    greedy = list(prompt)
    with torch.no_grad():
        for _ in range(len(out[0].response_ids)):
            greedy.append(int(model(input_ids=torch.tensor([greedy])).logits[0, -1].argmax()))
    assert out[0].response_ids == out[1].response_ids == greedy[len(prompt) :]

    layout = _sequences(
        [Prompt(prompt, "fr", "a")], [Rollout(0, [7, 8, 9], True), Rollout(0, [10], True)], 0, "cpu"
    )
    full = type(layout)(layout.ids, layout.attention, layout.positions, layout.mask, None)
    with torch.no_grad():
        shared = layout.hf_log_probs(model, False)[0]
        rows = full.hf_log_probs(model, False)[0]
    torch.testing.assert_close(shared * layout.mask, rows * layout.mask, atol=2e-5, rtol=1e-4)
