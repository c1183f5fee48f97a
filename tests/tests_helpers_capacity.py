"""Shared test inputs for the capacity tests: a gpt-oss config small enough to count by hand."""

# V=10, H=4, I=6, L=2 (one sliding layer, window 4, one full), nh=2, kv=1, d=2, E=3, k=2;
# 782 parameters (per layer 349, of which experts 264).
HAND_CONFIG = {
    "model_type": "gpt_oss",
    "vocab_size": 10,
    "hidden_size": 4,
    "intermediate_size": 6,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 2,
    "num_local_experts": 3,
    "num_experts_per_tok": 2,
    "sliding_window": 4,
    "attention_bias": True,
    "tie_word_embeddings": False,
}
