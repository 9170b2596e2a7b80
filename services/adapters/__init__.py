"""Adapters: the multi-LoRA adapter registry (which tenant adapter trains in which trainer slot)."""
