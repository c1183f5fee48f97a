"""GRPO: the algorithm's pure tensor functions (advantages, policy loss, KL, aggregation)."""
