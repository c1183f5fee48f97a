"""The Megatron path: layout checks, HF → Megatron conversion with a manifest and a precision
check, and the export back to a Hugging Face directory. See ``docs/megatron.md``."""
