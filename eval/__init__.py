"""Language identification, response parsing, compliance scoring and the 50-question eval."""
