"""Rollout producers: pull prompts, generate groups on the engines, score them, publish them."""
