"""The step bookkeeping the trainer's loop (services.trainer.loop) and both its modes share: the
model's (services.trainer.model_mode) and the adapters' (services.trainer.multi_lora).

- `BufferLink`: request/reply to the buffer that rides out a restarting buffer or broker, the
  wait for a step's lease, its payloads, and commits;
- `Records`: metrics.jsonl and the metric sinks (`emit`), where the records' axis resumes, and
  the records a restart drops (`drop_after`: the steps after the committed one are trained again);
- `append_trained` / `keep_lines`: trained.jsonl (the audit holds it against the ledger);
- `SampleCheck`: the samples a loop must not train on, left out of the loss and counted;
- `SampleRecorder`: every trained sample kept for the dashboard (services/common/sample_records.py).

Snapshot retention is shared one level down (services.common.snapshot.snapshots_to_remove).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl_proto import (
    BufferCommit,
    BufferCommitReply,
    BufferGetReply,
    BufferGetRequest,
    ProgressRecord,
    RolloutGroup,
    decode,
)
from asyncrl_proto.messages import SampleStatus, flatten_group
from services.common import procs, sample_records
from services.common.bus import TransportError
from services.common.validate import Limits, sample_problem
from services.trainer.core import LossConfig, missing_logprobs, samples_with_advantages
from services.trainer.setup import TrainerError

log = logging.getLogger(__name__)


class BufferLink:
    """The trainer's side of the buffer's request/reply subjects."""

    def __init__(self, bus, timeout_s: float):
        self.bus = bus
        self.timeout_s = timeout_s

    async def request(self, subject: str, msg, reply_type, what: str, timeout: float = 10):
        """Request/reply that rides out a restarting buffer or broker, up to --buffer-timeout-s."""
        start = time.monotonic()
        while True:
            try:
                return await self.bus.request(subject, msg, reply_type, timeout=timeout)
            except (TimeoutError, TransportError) as e:
                if time.monotonic() - start > self.timeout_s:
                    raise TrainerError(
                        f"the buffer service has not answered the {what} for {self.timeout_s:.0f}s "
                        f"({type(e).__name__}): is it running?"
                    ) from e
                await asyncio.sleep(0.5)

    async def lease(self, req: BufferGetRequest, producer_seen: Callable[[], float], warn_every_s: float,
                    producer_timeout_s: float) -> BufferGetReply:
        """Ask the buffer for a step's lease until it is complete; warn while groups are missing
        ("No completed rollout groups for 30.0s", then 60.0s, ... as Miles logs it), fail when the
        buffer is gone for --buffer-timeout-s or no producer was seen (`producer_seen`, a monotonic
        time) for `producer_timeout_s`."""
        last_progress, last_count = time.monotonic(), 0
        next_warn = last_progress + warn_every_s
        while True:
            reply = await self.request(self.bus.subjects.buffer_get, req, BufferGetReply, f"get of step {req.step}",
                                       timeout=req.wait_s + 5)  # fmt: skip
            if reply.error:
                raise TrainerError(f"buffer refused get(step={req.step}): {reply.error}")
            now = time.monotonic()
            if len(reply.refs) > last_count:
                last_count, last_progress, next_warn = len(reply.refs), now, now + warn_every_s
            if reply.complete:
                return reply
            while now >= next_warn:
                log.warning("No completed rollout groups for %.1fs", next_warn - last_progress)
                next_warn += warn_every_s
            if now - producer_seen() > producer_timeout_s:
                raise TrainerError(
                    f"no rollout producer has been alive for {producer_timeout_s:.0f}s while step {req.step} waits "
                    f"for groups ({len(reply.refs)}/{req.count}): start producers (asyncrl service rollout)"
                )

    async def load_group(self, ref) -> list:
        """A leased group's samples: inline in the lease, or read from ROLLOUTS by sequence."""
        data = ref.payload if ref.payload is not None else await self.bus.get_payload(
            self.bus.subjects.rollouts_stream, ref.stream_seq)  # fmt: skip
        return decode(data, RolloutGroup).samples

    async def commit(self, subject: str, step: int, version: int, what: str, error=TrainerError) -> None:
        """Tell the buffer `step` is done (trained, and resumable at `version`); `error` if it refuses."""
        reply = await self.request(subject, BufferCommit(step=step, version=version), BufferCommitReply, what)
        if reply.error:
            raise error(f"buffer refused {what}: {reply.error}")


class Records:
    """metrics.jsonl, one JSON line per step, the metric sinks (--use-tensorboard, --use-wandb)
    and the progress stream (the launcher's console and its end of the run)."""

    def __init__(self, metrics_path: Path, sinks, bus):
        self.path = metrics_path
        self.sinks = sinks
        self.bus = bus
        self.last: dict = {}

    async def emit(self, step: int, record: dict, axis: str) -> None:
        self.last = record
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.sinks.log(record, axis)
        await self.bus.publish_durably([(self.bus.subjects.progress, ProgressRecord(step=step, record=record), None)],
                                       "progress")  # fmt: skip

    async def finish(self, step: int, error: str | None = None, last_eval: int | None = None) -> None:
        """The final progress record: the run is over (with its error, if it failed)."""
        done = ProgressRecord(step=step, done=True, record=self.last, error=error, last_eval=last_eval)
        await self.bus.publish_durably([(self.bus.subjects.progress, done, None)], "the final progress record")

    def next_step(self) -> int:
        """The `step` the next record takes: one past the newest in metrics.jsonl (a restarted
        trainer continues the records' axis; the steps it drops leave gaps, never repeats)."""
        last = -1
        if self.path.exists():
            for x in self.path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    last = max(last, int(json.loads(x)["step"]))
        return last + 1

    def drop_after(self, records_dir: Path, last_step: int, axis: str = "step", rid: str | None = None) -> None:
        """The steps after `last_step` are trained again: drop their records, in `records_dir`'s
        trained.jsonl and samples, and in metrics.jsonl on `axis` (`rid`: one registration's only)."""
        keep_lines(records_dir / "trained.jsonl", lambda rec: rec["step"] <= last_step)
        sample_records.drop_after(records_dir, last_step)
        keep_lines(self.path, lambda rec: rec.get("registration") != rid or rec[axis] <= last_step)


def append_trained(records_dir: Path, step: int, groups: list[list]) -> None:
    """`<records_dir>/trained.jsonl`: the prompts (group indexes) each step trained on."""
    records_dir.mkdir(parents=True, exist_ok=True)
    with (records_dir / "trained.jsonl").open("a") as f:
        f.write(json.dumps({"step": step, "groups": sorted(flatten_group(g)[0].group_index for g in groups)}) + "\n")


def keep_lines(path: Path, keep) -> None:
    """Rewrite a JSON-lines file with the records `keep` accepts (a torn last line of a killed
    trainer is dropped); a kill meanwhile leaves the old file, never none."""
    if not path.exists():
        return
    kept = []
    for x in path.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):  # a line that is no record
            if keep(json.loads(x)):
                kept.append(x)
    procs.replace_file(path, "".join(x + "\n" for x in kept))


class SampleCheck:
    """Defence in depth (the buffer validated these groups): a sample that cannot be trained on
    (ids outside the vocabulary, a non-finite log-prob or reward, a version from the future, ...)
    is marked FAILED, which leaves it out of the loss, and said loudly; it never reaches the model."""

    def __init__(self, limits: Limits, loss_cfg: LossConfig):
        self.limits = limits
        self.loss_cfg = loss_cfg
        self.num_invalid = 0

    def exclude_invalid(self, groups: list[list], max_version: int, n: int | None = None) -> None:
        """`max_version`: the newest version a sample may name; `n`: the group size (a multi-LoRA
        adapter's own)."""
        limits = dataclasses.replace(self.limits, max_version=max_version, n=self.limits.n if n is None else n)
        for s in (s for g in groups for s in flatten_group(g) if s.status != SampleStatus.FAILED):
            if (problem := sample_problem(s, limits) or missing_logprobs(s, self.loss_cfg)) is not None:
                self.num_invalid += 1
                log.error("sample %s of group %s cannot be trained on (%s): left out of the loss",
                          s.index, s.group_index, problem)  # fmt: skip
                s.status, s.reward = SampleStatus.FAILED, None
                s.metadata["error"] = f"invalid at the trainer: {problem}"


class SampleRecorder:
    """A step's samples with their advantages, kept in `<dir>/samples` (the run directory, or an
    adapter registration's), built and written off the event loop. A record is for reading: one
    that cannot be written is said, never a failed step."""

    def __init__(self, model_dir: str, reward_key: str | None, keep: int):
        self.model_dir, self.reward_key, self.keep = model_dir, reward_key, keep

    @functools.cached_property
    def decode(self) -> Callable[[list[int]], str]:
        try:
            from services.model.tokenizer import Tokenizer

            tok = Tokenizer(self.model_dir)
            return lambda x: tok.decode(x, skip_special_tokens=False)
        except Exception as e:  # no tokenizer.json: the records show token ids
            log.warning("sample records show token ids, not text: %s", e)
            return lambda x: " ".join(map(str, x))

    async def record(self, where: Path, step: int, version: int, groups: list[list], refs: dict, std: bool) -> None:
        if self.keep <= 0:
            return

        def build_and_write() -> None:
            advantages = {id(s): a for s, a in samples_with_advantages(groups, std, self.reward_key)}
            rec = sample_records.step_record(step, version, groups, advantages, refs, self.decode)
            sample_records.write(where, rec, self.keep)

        try:
            await asyncio.to_thread(build_and_write)
        except Exception as e:
            log.warning("step %d's sample record was not written: %s: %s", step, type(e).__name__, e)
