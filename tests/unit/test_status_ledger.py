"""`asyncrl status` on a finished run: its ledger line counts what result.json and the console
count (services/buffer/state.py `ledger_counts`), a multi-LoRA run's foreign and retired groups
among the dropped."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from services.buffer.state import ledger_counts
from services.dashboard.status import render

SUMMARY = {"run_id": "r", "mode": "fully_async", "live": False, "finished": True, "step": 4, "total": 4,
           "eta_s": None, "step_time_s": 1.0, "weight_version": 4, "heldout_first": None, "heldout": None,
           "reward": 0.5, "staleness": 0.0, "queue": 0, "diagnosis": "-", "length_warning": None}  # fmt: skip

LEDGER = {"released_prompts": 20, "trained": 10, "failed": 1, "filtered": {"zero_std": 2}, "aborted_dropped": 1,
          "stale_dropped": 2, "foreign_dropped": 3, "retired_dropped": 1, "rejected": 0, "recycled": 5,
          "in_flight_at_end": {"recycled_waiting": 0}, "lost": 0, "trained_twice": 0, "balanced": True}  # fmt: skip


def test_the_status_ledger_line_counts_foreign_and_retired_groups_as_dropped():
    data = SimpleNamespace(summary=lambda: SUMMARY, run_dir=Path("run"), capacity=8, services=list,
                           errors=lambda n: [])  # fmt: skip
    line = next(x for x in render(data, LEDGER, " (audit.json)").splitlines() if x.startswith("ledger:"))
    assert ledger_counts(LEDGER)["dropped"] == 7
    assert line == ("ledger: 20 released, 10 trained, 1 failed, 2 filtered, 7 dropped, 0 rejected, 5 recycled, "
                    "0 in flight, 0 lost, 0 trained twice (balanced) (audit.json)")  # fmt: skip
