"""What a trainable group is, checked by meaning, not only by shape (decoding checks the shape).

A sample is trainable when its token ids are inside the vocabulary, its length inside the
context, its response length, log-probs and loss mask agree, its log-probs and reward are
finite, and every weight version it names has been published. A FAILED sample carries no
tokens that anyone trains on; it only needs a finite reward or none.

Who calls this: the producer on what it built (a bad sample is marked FAILED with the reason,
so the group still accounts for its prompt); the buffer on every group it receives (a bad one is
dead-lettered and its prompt's fate recorded as `rejected`); the trainer on every group it is
handed (a bad sample is left out of the loss: defence in depth, it never happens with a healthy
buffer). No torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from asyncrl_proto.messages import SampleStatus, flatten_group, group_id

MAX_ATTEMPT = 10_000
LOGPROB_SLACK = 1e-3
"""A log-prob above 0 by more than float error is not a probability."""


@dataclass(frozen=True)
class Limits:
    n: int
    """Trajectories per group (--n-samples-per-prompt)."""
    vocab_size: int
    context_length: int
    max_version: int | None = None
    """The newest weight version published; None when unknown (versions are not checked)."""
    reward_key: str | None = None
    max_abs_reward: float = 1e6
    """--max-abs-reward: rewards outside [-this, this] are refused where they enter."""


def _model_config(path: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(path) / "config.json").read_text())


def model_context_length(path: str) -> int:
    """The model's positions (its config.json's max_position_embeddings)."""
    return int(_model_config(path)["max_position_embeddings"])


def limits_from_model_dir(path: str, n: int, reward_key: str | None, max_abs_reward: float = 1e6) -> Limits:
    """The limits of the run's model (its config.json: vocab_size, max_position_embeddings)."""
    cfg = _model_config(path)
    return Limits(n=n, vocab_size=int(cfg["vocab_size"]), context_length=int(cfg["max_position_embeddings"]),
                  reward_key=reward_key, max_abs_reward=max_abs_reward)  # fmt: skip


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def reward_problem(reward: Any, reward_key: str | None, max_abs: float = 1e6) -> str | None:
    """A reward must be a number in [-max_abs, max_abs] (--max-abs-reward), or a dict of them
    (holding --reward-key): then no accepted group can overflow its advantages or the loss."""
    if isinstance(reward, dict):
        if not reward:
            return "reward is an empty dict"
        bad = next((k for k, v in reward.items() if not isinstance(k, str) or not finite(v)), None)
        if bad is not None:
            return f"reward[{bad!r}] is {reward[bad]!r}, not a finite number"
        big = next((k for k, v in reward.items() if abs(v) > max_abs), None)
        if big is not None:
            return f"reward[{big!r}] is {reward[big]!r:.30}, outside [-{max_abs:g}, {max_abs:g}] (--max-abs-reward)"
        if reward_key is None:  # nothing would say which entry to train on
            return f"reward is a dict ({', '.join(sorted(reward))[:80]}): set --reward-key to the entry to train on"
        if reward_key not in reward:
            return f"reward has no {reward_key!r} entry (--reward-key)"
        return None
    if not finite(reward):
        return f"reward is {reward!r:.60} ({type(reward).__name__}), not a finite number"
    if abs(reward) > max_abs:
        return f"reward is {reward!r:.30}, outside [-{max_abs:g}, {max_abs:g}] (--max-abs-reward)"
    return None


def sample_problem(s: Any, limits: Limits) -> str | None:
    """The first reason this sample cannot be trained on, or None."""
    if s.status == SampleStatus.FAILED:
        return None if s.reward is None else reward_problem(s.reward, limits.reward_key, limits.max_abs_reward)
    if s.status == SampleStatus.PENDING:
        return "status is PENDING: a finished group holds finished samples"
    tokens = s.tokens
    if tokens:
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= limits.vocab_size:
            return f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {limits.vocab_size})"
    if len(tokens) > limits.context_length:
        return f"{len(tokens)} tokens exceed the context length {limits.context_length}"
    if not 0 <= s.response_length <= len(tokens) or (tokens and s.response_length == len(tokens)):
        return f"response_length {s.response_length} does not fit {len(tokens)} tokens with a prompt"
    if s.rollout_log_probs and len(s.rollout_log_probs) != s.response_length:
        return f"{len(s.rollout_log_probs)} log-probs for {s.response_length} response tokens"
    if s.rollout_log_probs and not all(math.isfinite(x) and x <= LOGPROB_SLACK for x in s.rollout_log_probs):
        return "a rollout log-prob is not finite or above 0"
    if s.loss_mask is not None and (len(s.loss_mask) != s.response_length or not set(s.loss_mask) <= {0, 1}):
        return f"loss_mask must hold {s.response_length} values of 0 or 1"
    if s.status != SampleStatus.ABORTED and (p := reward_problem(s.reward, limits.reward_key, limits.max_abs_reward)):
        return p
    for v in s.weight_versions:
        if v < 0 or (limits.max_version is not None and v > limits.max_version):
            return f"weight version {v} was never published (newest {limits.max_version})"
    end = 0
    for span in s.version_spans:
        if len(span) != 3 or not end <= span[0] < span[1] <= s.response_length or span[2] not in s.weight_versions:
            return (f"version span {span!r:.60} is not an increasing [start, end, version] within the "
                    f"{s.response_length} response tokens of a version the sample lists")  # fmt: skip
        end = span[1]
    return None


def group_problem(group_id_: str, group_index: int, attempt: int, samples: list, limits: Limits) -> str | None:
    """The first reason a group cannot be trained on, or None."""
    if group_index < 0 or not 0 <= attempt <= MAX_ATTEMPT:
        return f"group_index {group_index} / attempt {attempt} out of range"
    if group_id_ != group_id(group_index, attempt):
        return f"group id {group_id_!r:.60} does not match group_index {group_index} and attempt {attempt}"
    if len(samples) != limits.n:
        return f"group {group_id_} has {len(samples)} trajectories, expected n={limits.n}"
    for s in flatten_group(samples):
        if s.group_index != group_index:
            return f"a sample of group {group_id_} names group_index {s.group_index}"
        if (p := sample_problem(s, limits)) is not None:
            return f"sample {s.index}: {p}"
    return None


def finite_metrics(metrics: dict[Any, Any]) -> tuple[dict[str, float], list[str]]:
    """The entries of a metrics dict that are finite numbers under string keys, and the keys of
    the others (a NaN from an evaluator plugin must not reach a record or a dashboard)."""
    kept = {k: float(v) for k, v in metrics.items() if isinstance(k, str) and finite(v)}
    return kept, [str(k)[:80] for k in metrics if k not in kept]


def eval_result_problem(step: int, total_steps: int) -> str | None:
    """An EvalResult for a point that is not one of this run's (0..total_steps)."""
    if not 0 <= step <= total_steps:
        return f"eval result for step {step}, outside the run's 0..{total_steps}"
    return None


class EvalPoints:
    """The eval points a run asked for, and the results taken for them (the trainer's and the
    launcher's): a result is taken only for a point that was requested, for a weight version it
    was requested for (a trainer that restarts and passes a point again may name newer weights;
    the point is answered once, for either), and once; anything else is refused with the reason.
    Points requested before a restart (`resumed_at`) are not known here: a result for one of
    them, at most the resume step, is taken once whatever its version."""

    def __init__(self):
        self.requested: dict[int, set[int]] = {}
        self.taken: set[int] = set()
        self.unknown_before = -1

    def request(self, step: int, version: int) -> None:
        self.requested.setdefault(step, set()).add(version)

    def resumed_at(self, step: int) -> None:
        self.unknown_before = step

    def problem(self, step: int, version: int) -> str | None:
        """Why a result for (step, version) is refused, or None; taken when None."""
        wanted = self.requested.get(step)
        if wanted is not None and version not in wanted and step not in self.taken:
            return (f"eval result for step {step}: the point was requested for weights "
                    f"{', '.join(f'v{v}' for v in sorted(wanted))}, not v{version}")  # fmt: skip
        return self.skip_problem(step, wanted is not None or step <= self.unknown_before)

    def skip_problem(self, step: int, on_schedule: bool) -> str | None:
        """Why a skip result for a point no request named (the trainer skips a busy point or a
        failed export itself, sending it to no one) is refused, or None; taken when None: once, for
        an eval point of the run's schedule. A skip carries no held-out figure."""
        if step in self.taken:
            return f"eval result for step {step}: that point was answered already"
        if not on_schedule:
            return f"eval result for step {step}: no eval point was requested there"
        self.taken.add(step)
        return None

    def launcher_problem(self, step: int, version: int, skipped: bool, on_schedule) -> str | None:
        """The launcher's rule (it also hears the skips the trainer decided itself): a skip for a
        point no request named is judged by skip_problem (`on_schedule(step)`), anything else by
        problem; taken when None."""
        if skipped and step not in self.requested:
            return self.skip_problem(step, on_schedule(step))
        return self.problem(step, version)
