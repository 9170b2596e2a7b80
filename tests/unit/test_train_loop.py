"""The trainer's one loop (services.trainer.loop) with a mode that writes down what it is asked:
each lease goes train -> before_records -> trained.jsonl and the record -> after_records; the run
ends at the mode's None with one finish, a RunFailed ends it with the error, and a stopping
service ends it without a finish."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

from asyncrl_proto.messages import Sample
from services.trainer.loop import Mode, RunFailed, TrainLoop, Work


class Recorder(Mode):
    def __init__(self, tmp_path, batches, fail_at=None):
        self.tmp_path, self.batches, self.fail_at = tmp_path, list(batches), fail_at
        self.calls: list[str] = []

    async def next(self):
        self.calls.append("next")
        if not self.batches:
            return None
        return [Work(step=s, version=0, records_dir=self.tmp_path, axis="rollout/step", std=False,
                     groups=[[Sample(group_index=10 + s, index=0, tokens=[1, 2], reward=1.0)]])
                for s in self.batches.pop(0)]  # fmt: skip

    async def train(self, w):
        self.calls.append(f"train {w.step}")

    async def before_records(self, w):
        self.calls.append(f"before {w.step}")

    async def record(self, w):
        trained = (self.tmp_path / "trained.jsonl").read_text().splitlines()
        self.calls.append(f"record {w.step} after {len(trained)} trained")
        return {"step": w.step, "loss": math.nan}

    async def after_records(self, w, record):
        self.calls.append(f"after {w.step} loss {record['loss']}")
        if w.step == self.fail_at:
            raise RunFailed("every reward raised")

    async def finish(self, error=None):
        self.calls.append(f"finish {error}")

    def cancel(self):
        self.calls.append("cancel")


class Emitted:
    def __init__(self):
        self.records = []

    async def emit(self, step, record, axis):
        self.records.append((step, record, axis))


class Samples:
    async def record(self, *args):
        pass


def run(mode, stopping=False):
    records = Emitted()
    asyncio.run(TrainLoop(mode, records, Samples(), SimpleNamespace(stopping=stopping)).run())
    return records


def test_each_lease_goes_through_the_same_order_and_the_run_ends_once(tmp_path):
    mode = Recorder(tmp_path, [[0], [1, 2]])
    records = run(mode)
    assert mode.calls == ["next", "train 0", "before 0", "record 0 after 1 trained", "after 0 loss None",
                          "next", "train 1", "before 1", "record 1 after 2 trained", "after 1 loss None",
                          "train 2", "before 2", "record 2 after 3 trained", "after 2 loss None",
                          "next", "cancel", "finish None"]  # fmt: skip
    assert [(s, r["loss"], axis) for s, r, axis in records.records] == [(0, None, "rollout/step"),
                                                                         (1, None, "rollout/step"),
                                                                         (2, None, "rollout/step")]  # fmt: skip
    lines = [json.loads(x) for x in (tmp_path / "trained.jsonl").read_text().splitlines()]
    assert [(x["step"], x["groups"]) for x in lines] == [(0, [10]), (1, [11]), (2, [12])]


def test_a_failed_run_finishes_with_its_error_and_a_stopping_one_without_finishing(tmp_path):
    mode = Recorder(tmp_path, [[0], [1]], fail_at=0)
    run(mode)
    assert mode.calls[-2:] == ["cancel", "finish every reward raised"]
    assert "train 1" not in mode.calls
    mode = Recorder(tmp_path / "b", [[0]])
    run(mode, stopping=True)
    assert mode.calls == ["cancel"]
