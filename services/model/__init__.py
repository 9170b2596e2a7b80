"""Model code shared by the trainer and the built-in engine (imports torch)."""
