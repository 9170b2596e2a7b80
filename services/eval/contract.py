"""The external-evaluator contract (exported from services.api).

A `--eval-function-path` class subclasses CheckpointEvalFn. The eval service builds it once as
`cls(config)` and calls `evaluate_checkpoint(checkpoint_dir, input)` for every eval point, with
the HF snapshot of that point (complete: its `.complete` marker exists) and a dict:

    {"step": int, "weight_version": int, "datasets": {name: [rows]}, "n_samples_per_prompt": int,
     "sampling_params": dict}

It returns metrics (a dict of floats; keys without an "eval/" prefix get one), or raises
EvalSkip(reason) to record the point as skipped with that reason. It may be sync or async.
"""

from __future__ import annotations

from typing import Any


class EvalSkip(Exception):
    """Raised by an evaluator to skip an eval point; `reason` becomes eval/skipped_<reason>."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class CheckpointEvalFn:
    def __init__(self, config: Any):
        self.config = config

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict) -> dict[str, float]:  # noqa: A002
        raise NotImplementedError
