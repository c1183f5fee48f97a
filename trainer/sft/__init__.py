"""Supervised fine-tuning (LoRA or full) on harmony-rendered examples, and the LoRA merge."""
