"""Step configs the cluster tests share."""

# gpt-oss-20b's GRPO shape with dedicated engines: 16 DeepSpeed training processes beside
# 2 vLLM engines of TP 4 (24 GPUs: 6 nodes x 4, or 3 x 8)
DEDICATED_GRPO = {
    "nproc": 16,
    "prompts_per_step": 32,
    "mini_batch_size": 256,
    "micro_batch_size": 1,
    "optim": {"backend": "deepspeed"},
    "rollout": {"engine": "vllm", "colocate": False, "num_engines": 2, "tensor_parallel_size": 4},
}
