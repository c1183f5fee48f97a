"""The Megatron path: layout checks, HF → Megatron conversion with a manifest and a precision
check, the Megatron-Core GRPO training backend (``backend``, built by
``trainer.backends.make_backend``), and the export back to a Hugging Face directory. See
``docs/megatron.md``."""
