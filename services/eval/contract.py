"""The external-evaluator contract (exported from services.api).

A `--eval-function-path` class subclasses CheckpointEvalFn. The eval service builds it once as
`cls(config)` and calls `evaluate_checkpoint(checkpoint_dir, input)` for every eval point, with
the HF snapshot of that point (complete: its `.complete` marker exists) and a dict:

    {"step": int, "weight_version": str(step), "trainer_version": int, "datasets": {name: [rows]},
     "n_samples_per_prompt": int, "sampling_params": dict,
     "dataset_settings": {name: {"n_samples_per_eval_prompt", "sampling_params", "rm_type"}}}

`step` and `weight_version` name the point as Miles does (eval/step: the rollout id at dispatch;
as a string, the version to load it under on a server); `trainer_version` is the trainer's push
counter at the point; `dataset_settings` are each set's own (--eval-config). It returns
metrics (a dict of floats; keys without an "eval/" prefix get one), or raises EvalSkip(reason)
to record the point as skipped with that reason; any other exception records it as `crashed`.
It may be sync or async. `dispose()` (sync or async) is called once when the eval service stops.
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

    def dispose(self) -> None:
        """Release what the evaluator holds (clients, servers); called once at shutdown."""
