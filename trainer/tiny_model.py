"""A tiny GPT-OSS-architecture model and a harmony tokenizer, built offline, for CPU runs.

The model is ``transformers``' ``GptOssForCausalLM`` (MoE experts with a router, attention
sinks, alternating sliding-window and full attention, YaRN RoPE) at a size that trains on two
CPU cores. The tokenizer is a byte-level BPE trained on the bundled corpus, with gpt-oss's
harmony special tokens and a harmony chat template. Both are saved as a normal Hugging Face
directory, so every later step loads them with ``from_pretrained`` exactly as it would load
``openai/gpt-oss-20b``. The same seed and corpus give byte-identical files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from pydantic import ConfigDict, Field

from core.config_model import ConfigModel
from core.harmony import HARMONY_SPECIAL_TOKENS, SYSTEM_MESSAGE

log = logging.getLogger(__name__)

EOS_TOKEN = "<|return|>"
PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|startoftext|>"


class TinyModelConfig(ConfigModel):
    """Size of the tiny model (defaults: ~1.4M parameters, fp32, trains at ~0.1 s/step)."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(2048, ge=300)
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    sliding_window: int = 32
    max_position_embeddings: int = 4096
    seed: int = 0


SMALLEST = TinyModelConfig(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    seed=0,
)
"""The smallest tiny model the tests and the GPU check's CPU dry run build (~0.26M
parameters, a step in well under a second)."""


def harmony_chat_template() -> str:
    """A Jinja chat template that renders messages exactly as ``core.harmony`` does.

    Messages: ``system``/``developer`` (the developer instructions), ``user``, ``assistant``
    (``content`` = final answer, optional ``thinking`` = analysis). The last assistant turn
    ends with ``<|return|>``; ``add_generation_prompt`` appends ``<|start|>assistant``.
    """
    system = SYSTEM_MESSAGE.replace("{effort}", "' + (reasoning_effort | default('medium')) + '")
    system = system.replace("\n", "\\n")
    return (
        "{{- '<|start|>system<|message|>" + system + "<|end|>' -}}"
        "{%- for m in messages -%}"
        "{%- if m.role in ['system', 'developer'] -%}"
        "{{- '<|start|>developer<|message|># Instructions\\n\\n' + m.content + '<|end|>' -}}"
        "{%- elif m.role == 'user' -%}"
        "{{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}"
        "{%- elif m.role == 'assistant' -%}"
        "{%- if m.thinking -%}"
        "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}"
        "{%- endif -%}"
        "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content -}}"
        "{{- '<|return|>' if loop.last else '<|end|>' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE with the harmony special tokens; returns a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(HARMONY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return harmony_fast_tokenizer(tokenizer)


def harmony_fast_tokenizer(tokenizer_object):
    """A ``tokenizers`` object as a transformers ``PreTrainedTokenizerFast`` with harmony's
    special tokens (end, pad, start and the others) and the harmony chat template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        additional_special_tokens=[
            t for t in HARMONY_SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN, BOS_TOKEN)
        ],
    )
    fast.chat_template = harmony_chat_template()
    return fast


def bundled_corpus() -> list[str]:
    """Texts to train the tokenizer on: the bundled sample rendered as harmony, the eval set."""
    import json

    from data_prep.config import DataPrepConfig
    from data_prep.process import Good, process_rows
    from data_prep.sources import iter_source

    texts = []
    for outcome in process_rows(iter_source("bundled"), DataPrepConfig(workers=1)):
        if isinstance(outcome, Good):
            record = json.loads(outcome.record)
            texts.append(record["prompt"] + record["completion"])
    from eval.runner import BUNDLED_QUESTIONS

    texts += [json.loads(line)["question"] for line in BUNDLED_QUESTIONS.read_text().splitlines()]
    return texts


def build_tiny_model(
    output_dir: str | Path,
    config: TinyModelConfig | None = None,
    corpus: Iterable[str] | None = None,
    tokenizer=None,
) -> Path:
    """Create the tiny GPT-OSS model and its tokenizer in ``output_dir`` (a HF directory).

    ``tokenizer``: a harmony tokenizer to use instead of training one on ``corpus`` (the
    model's vocabulary is then its size, not ``config.vocab_size``).
    """
    import torch
    from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

    config = config or TinyModelConfig()
    output_dir = Path(output_dir)
    if tokenizer is None:
        tokenizer = train_tokenizer(
            corpus if corpus is not None else bundled_corpus(), config.vocab_size
        )
    model_config = GptOssConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        num_local_experts=config.num_local_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        sliding_window=config.sliding_window,
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(config.num_hidden_layers)
        ],
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": config.max_position_embeddings // 32,
        },
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        attn_implementation="eager",
    )
    torch.manual_seed(config.seed)
    model = GptOssForCausalLM(model_config)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in (EOS_TOKEN, "<|call|>")],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        do_sample=True,
        temperature=1.0,
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "tiny GPT-OSS model: %.2fM parameters, vocab %d → %s",
        n_params / 1e6,
        len(tokenizer),
        output_dir,
    )
    return output_dir
