"""gpt-oss's own tokenizer (``o200k_harmony``) as a Hugging Face fast tokenizer, built offline
from the encoding ``openai-harmony`` carries, for a tiny model that vLLM's OpenAI server can
serve.

vLLM's chat endpoint does not use a gpt-oss model's tokenizer to render a chat: for
``model_type == "gpt_oss"`` it renders with ``openai_harmony``'s ``HARMONY_GPT_OSS`` encoding
(``vllm/renderers/online_renderer.py``: ``use_harmony``; ``_make_request_with_harmony``) and
parses the reply with it. A model with another vocabulary (the tiny model's own BPE) gets
o200k ids (``<|message|>`` = 200008) and every request is answered 400 "Token id 200008 is out
of vocabulary" (``vllm/renderers/base.py``: ``validate_token_ids``).
"""

from __future__ import annotations

from pathlib import Path

O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
"""o200k's pre-tokenizer regex (``tiktoken_ext.openai_public.o200k_base``)."""
BPE_TOKENS = 199_998
"""o200k_base's mergeable ranks are 0 … 199,997; the special tokens follow."""
VOCAB_SIZE = 201_088
"""o200k_harmony's ids end at ``<|reserved_201087|>`` (gpt-oss's ``vocab_size``)."""
SPECIAL_NAMES = {
    199_998: "<|startoftext|>",
    199_999: "<|endoftext|>",
    200_002: "<|return|>",
    200_003: "<|constrain|>",
    200_005: "<|channel|>",
    200_006: "<|start|>",
    200_007: "<|end|>",
    200_008: "<|message|>",
    200_012: "<|call|>",
    200_018: "<|endofprompt|>",
}
"""o200k_harmony's named special tokens (``tiktoken_ext.openai_public.o200k_harmony``); every
other id from 199,998 on is ``<|reserved_<id>|>``."""


def harmony_encoding():
    """``openai_harmony``'s gpt-oss encoding, the one vLLM's server renders chats with."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def build_harmony_tokenizer(encoding=None):
    """A ``PreTrainedTokenizerFast`` with o200k_harmony's ids, merges, pre-tokenizer and special
    tokens, and the tiny model's harmony chat template."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from trainer.tiny_model import harmony_fast_tokenizer

    encoding = encoding or harmony_encoding()
    # the public HarmonyEncoding decodes to text only; its Rust core gives a token's bytes
    ranks = {bytes(encoding._inner.decode_bytes([i])): i for i in range(BPE_TOKENS)}
    assert len(ranks) == BPE_TOKENS, "o200k's ranks are not one token per id"
    specials = [SPECIAL_NAMES.get(i, f"<|reserved_{i}|>") for i in range(BPE_TOKENS, VOCAB_SIZE)]

    class _FromRanks(TikTokenConverter):
        def load_tiktoken_bpe(self, tiktoken_url):  # the ranks at hand, not a file
            return ranks

    converted = _FromRanks(pattern=O200K_PATTERN, extra_special_tokens=specials).converted()
    tokenizer = harmony_fast_tokenizer(converted)
    for token_id, name in SPECIAL_NAMES.items():
        assert tokenizer.convert_tokens_to_ids(name) == token_id, (name, token_id)
    return tokenizer


def save_harmony_tokenizer(path: Path):
    return build_harmony_tokenizer().save_pretrained(path)
