from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.common.config.base import Section
from services.common.engine_commands import launcher_flags_problem


class EvalSection(Section):
    """Evaluation: when, on what, and which backend (eval service, trainer)."""

    interval: int | None = Field(None, ge=1, description="Evaluate every this many steps.")
    prompt_data: list[str] = Field(
        default_factory=list,
        description="NAME PATH pairs of held-out sets (JSONL or Parquet); default: the task's held-out set.",
    )
    config: str | None = Field(
        None,
        description="Miles's eval dataset file (YAML/JSON, or base64:<payload>): eval.datasets with per-set "
        "path, n_samples_per_eval_prompt, temperature, top_p, top_k, max_response_len, rm_type, keys and "
        "metadata_overrides, and eval.defaults; replaces --eval-prompt-data.",
    )
    n_samples_per_eval_prompt: int = Field(4, ge=1, description="Samples per held-out prompt.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for evaluation.")
    skip_eval_before_train: bool = Field(False, description="No evaluation at step 0.")
    max_response_len: int | None = Field(
        None, ge=1, description="max_new_tokens for evaluation (default: the rollout's)."
    )
    top_p: float | None = Field(None, gt=0, le=1, description="top_p for evaluation (default: the rollout's).")
    num_gpus: int = Field(
        0,
        ge=0,
        description="Dedicated eval fleet: this many engines' worth of devices owned by the eval service (0 = none).",
    )
    num_gpus_per_engine: int = Field(1, ge=1, description="Devices per eval-fleet engine.")
    function_path: str | None = Field(
        None, description="module.Class: a services.api.CheckpointEvalFn subclass that evaluates each snapshot."
    )
    hf_dir: str | None = Field(None, description="Export a fresh HF snapshot per eval point here (snapshot backends).")
    max_in_flight: int = Field(2, ge=1, description="Eval points that may be pending at once.")
    overflow_policy: Literal["backpressure", "skip"] = Field(
        "backpressure",
        description="When --eval-max-in-flight points are pending: wait for the oldest, or skip as busy.",
    )
    keep_snapshots: int = Field(
        2,
        ge=0,
        description="Exported eval snapshots kept after their evaluation (0: none, each is deleted once evaluated).",
    )
    engine_urls: list[str] = Field(
        default_factory=list,
        description="Attach the eval fleet to these running engines instead of launching --eval-num-gpus of them.",
    )
    custom_eval_rollout_log_function_path: str | None = Field(
        None,
        description="module.fn: log_eval_rollout_data(rollout_id, config, data, extra_metrics) -> bool, called "
        "per eval point with data = {dataset: {rewards, truncated, samples}}; True skips the default eval metrics.",
    )
    sglang_args: list[str] = Field(
        default_factory=list,
        description="Overrides of the fleet engines' settings, collected from every --eval-sglang-<flag> "
        "(and --no-eval-sglang-<flag>) on the command line.",
    )

    @property
    def backend(self) -> Literal["fleet", "external", "shared"]:
        """The eval backend these flags select (docs/services.md, "Evaluation"): a dedicated fleet,
        an external evaluator, or the rollout engines."""
        if self.num_gpus > 0 or self.engine_urls:
            return "fleet"
        if self.function_path:
            return "external"
        return "shared"

    def problems(self) -> list[str]:
        """Every eval combination that cannot work, with what to set."""
        errs = []
        if self.backend == "fleet" and self.function_path:
            errs.append(
                "--eval-num-gpus (a dedicated eval fleet) and --eval-function-path (an external evaluator) each "
                "select an eval backend: pass one of them"
            )
        if self.num_gpus % self.num_gpus_per_engine:
            errs.append(
                f"--eval-num-gpus ({self.num_gpus}) must be a multiple of --eval-num-gpus-per-engine "
                f"({self.num_gpus_per_engine})"
            )
        if self.sglang_args and self.num_gpus == 0:
            given = sorted({a for a in self.sglang_args if a.startswith("--")})
            errs.append(
                "--eval-sglang-* configures the dedicated eval fleet, which needs --eval-num-gpus > 0. "
                f"Got {given} with --eval-num-gpus 0."
            )
        if problem := launcher_flags_problem(self.sglang_args, "--eval-sglang-", "the eval fleet"):
            errs.append(problem)
        tp = [a for a in self.sglang_args if a.split("=")[0] in ("--tp-size", "--tp", "--tensor-parallel-size")]
        if tp:
            errs.append(
                f"--eval-sglang{tp[0].split('=')[0][1:]} is not a flag: the eval fleet's tensor-parallel size is "
                "--eval-num-gpus-per-engine"
            )
        if len(self.prompt_data) % 2:
            errs.append("--eval-prompt-data takes NAME PATH pairs, e.g. --eval-prompt-data aime aime.jsonl")
        return errs
