"""The generation engines the eval and GRPO share: what they take and return, sampling,
vLLM and Hugging Face engines in this process, and OpenAI-compatible endpoints."""
