"""Pure parts of the producer: submission credits and turning an engine response into a Sample.

Submission credits (SPEC.md section 4): the in-flight cap is `cap_groups * n` sample credits.
A whole group is submitted only when n credits are free. With `sample` granularity a credit
returns as each trajectory finishes, so a new group goes out once n trajectories have finished
from any groups; with `group` granularity the n credits return together when the group, reward
included, is done. Every path (finish, failure, cancellation) returns exactly the credits taken.
"""

from __future__ import annotations

import asyncio

from asyncrl_proto.messages import Sample, SampleStatus

FINISH_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


class Credits:
    def __init__(self, cap_groups: int, n: int, granularity: str):
        if granularity not in ("sample", "group"):
            raise ValueError(f"granularity must be sample or group, not {granularity!r}")
        self.n = n
        self.total = cap_groups * n
        self.free = self.total
        self.granularity = granularity
        self._changed = asyncio.Event()

    @property
    def free_groups(self) -> int:
        return self.free // self.n

    @property
    def in_flight(self) -> int:
        return self.total - self.free

    def take_group(self) -> None:
        if self.free < self.n:
            raise RuntimeError("no room for a group: check free_groups first")
        self.free -= self.n

    def _give(self, k: int) -> None:
        self.free += k
        assert self.free <= self.total, "credits returned twice"
        self._changed.set()

    def trajectory_done(self) -> int:
        """Returns the credits given back now (1 under sample granularity)."""
        if self.granularity == "sample":
            self._give(1)
            return 1
        return 0

    def group_done(self, given_back_already: int) -> None:
        """Return whatever the group still holds (all n under group granularity)."""
        self._give(self.n - given_back_already)

    async def wait_changed(self, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            pass
        self._changed.clear()


def versions_of(meta: dict) -> list[int]:
    """The weight versions an engine reports for one /generate call: its version spans, else
    its weight_version; an unparsable one (SGLang's initial "default") is unknown."""
    spans = meta.get("weight_versions")
    if spans:
        return [int(s["version"]) for s in spans]
    v = meta.get("weight_version")
    try:
        return [int(v)]
    except (TypeError, ValueError):
        return []  # e.g. SGLang's initial "default": unknown, never filtered


def apply_response(sample: Sample, input_ids: list[int], resp: dict) -> None:
    """Append one /generate turn to a sample: tokens and log-probs from output_token_logprobs
    (whose ids equal output_ids), text, status from finish_reason, and every weight version
    that produced a token."""
    meta = resp.get("meta_info", {})
    pairs = meta.get("output_token_logprobs")
    if pairs is not None:
        new_tokens = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs]
    else:
        new_tokens = list(resp.get("output_ids", []))
        logprobs = []
    if not sample.tokens:
        sample.tokens = list(input_ids)
    sample.tokens += new_tokens
    sample.response += resp.get("text", "")
    sample.response_length += len(new_tokens)
    sample.rollout_log_probs += logprobs
    reason = (meta.get("finish_reason") or {}).get("type", "stop")
    sample.status = FINISH_STATUS.get(reason, SampleStatus.COMPLETED)
    for v in versions_of(meta):
        if not sample.weight_versions or sample.weight_versions[-1] != v:
            sample.weight_versions.append(v)
    sample.metadata["engine"] = {
        "cached_tokens": meta.get("cached_tokens", 0),
        "num_retractions": meta.get("num_retractions", 0),
        "e2e_latency": meta.get("e2e_latency", 0.0),
    }
