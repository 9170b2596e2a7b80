"""The trainer's one loop, for whatever it trains: the model (services.trainer.model_mode) or
adapters on a frozen base (services.trainer.multi_lora), a mode chosen once at start-up.

Each pass asks the mode for its next leases (`next`: one step's lease for the model, the leases
that completed together for adapters), and takes each through the same order:

  train            one optimizer step on the lease's groups
  before_records   what the step's record reports (the model's weight push, and one-step's next
                   lease completed before it)
  records          trained.jsonl, the step's samples, its metrics record (metrics.jsonl, sinks,
                   `progress`)
  after_records    what makes the step resumable: checkpoint and commit (the model), registry,
                   version and commit (an adapter), then what follows the step (an eval point)

The records come before the commit: a trainer killed in between resumes from its committed step,
drops the records after it and trains those steps again, so a committed step always has its
records (the audit checks it). What differs between the drivers is the model mode's DriverPolicy
(services.trainer.policy)."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from services.common.sinks import finite_record
from services.trainer.steps import Records, SampleRecorder, append_trained

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run cannot go on, and a restart would not change it (e.g. every reward raises): the
    trainer reports it in its final record and stops; the launcher fails the run with it."""


@dataclasses.dataclass
class Work:
    """One step of one trainee: its lease and what the step made of it."""

    step: int
    """The step on its trainee's axis (the run's, or the adapter's)."""
    version: int
    """The weight version its samples are judged against and its sample records name."""
    records_dir: Path
    """Where its trained.jsonl and samples go (the run directory, or an adapter registration's)."""
    axis: str
    """The records' step axis (`rollout/step`, or `<adapter>/step`)."""
    std: bool
    """GRPO's std normalisation of its advantages (for its sample records)."""
    groups: list[list] = dataclasses.field(default_factory=list)
    refs: dict = dataclasses.field(default_factory=dict)
    """The lease's GroupRef of each group, by group index (its group id and staleness)."""
    metrics: dict = dataclasses.field(default_factory=dict)
    """The buffer's metrics with the lease."""
    rollout_time: float = 0.0
    """Seconds from the step's first get to its complete lease (Miles's perf/rollout_time)."""
    wait_s: float = 0.0
    """Seconds the loop waited for it (less than rollout_time when it was fetched ahead)."""
    owner: Any = None
    """The mode's own handle (an adapter's track)."""
    started: float = 0.0
    stats: dict = dataclasses.field(default_factory=dict)
    train_s: float = 0.0
    push_s: float = 0.0


class Mode:
    """What the loop asks of the trainee; the base does nothing where a mode has nothing to do."""

    async def setup(self) -> None:
        """At the service's start, before the loop (resume)."""

    async def start(self) -> None:
        """As the loop starts."""

    async def next(self) -> list[Work] | None:
        """The leases to train now ([]: none yet), or None once the run is over."""
        raise NotImplementedError

    async def train(self, w: Work) -> None:
        """Train the lease's batch."""
        raise NotImplementedError

    async def before_records(self, w: Work) -> None:
        """What the step's record reports and must happen before it."""

    async def record(self, w: Work) -> dict:
        """The step's metrics record."""
        raise NotImplementedError

    async def after_records(self, w: Work, record: dict) -> None:
        """The steps of the module docstring that follow the records."""
        raise NotImplementedError

    async def finish(self, error: str | None = None) -> None:
        """The run is over, or failed with `error`."""
        raise NotImplementedError

    def cancel(self) -> None:
        """Drop what is in flight (fetches ahead, gets)."""

    async def stop(self) -> None:
        """At the service's end."""

    def status(self) -> dict:
        return {}

    def metric_values(self) -> dict[str, float]:
        return {}


class TrainLoop:
    def __init__(self, mode: Mode, records: Records, samples: SampleRecorder, lifecycle) -> None:
        self.mode, self.records, self.samples, self.lifecycle = mode, records, samples, lifecycle

    async def run(self) -> None:
        error = None
        try:
            await self.mode.start()
            while not self.lifecycle.stopping and (work := await self.mode.next()) is not None:
                for w in work:
                    await self.step(w)
        except RunFailed as e:
            error = str(e)
        finally:
            self.mode.cancel()
        if error is not None or not self.lifecycle.stopping:
            await self.mode.finish(error=error)

    async def step(self, w: Work) -> None:
        w.started = time.perf_counter()  # its batch in hand (perf/step_time_s runs from here)
        await self.mode.train(w)
        w.train_s = time.perf_counter() - w.started
        await self.mode.before_records(w)
        append_trained(w.records_dir, w.step, w.groups)
        await self.samples.record(w.records_dir, w.step, w.version, w.groups, w.refs, w.std)
        record, bad = finite_record(await self.mode.record(w))
        if bad:
            log.error("step %d: %s were not finite; recorded as null", w.step, ", ".join(bad[:10]))
        await self.records.emit(record["step"], record, w.axis)
        await self.mode.after_records(w, record)
