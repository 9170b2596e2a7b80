"""Bundled verifiable tasks: prompts, held-out prompts, reward, and a tiny model to start from."""
