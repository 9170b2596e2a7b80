"""`asyncrl status` on a finished run: its ledger lines count what result.json and the console
count (services/buffer/state.py `ledger_counts`): a multi-LoRA run's audit.json holds each
registration's ledger under `adapters` (its own run ledger is empty), and an adapter's foreign and
retired groups are among its dropped."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from services.buffer.state import ledger_counts
from services.dashboard.status import render

SUMMARY = {"run_id": "r", "mode": "fully_async", "live": False, "finished": True, "step": 4, "total": 4,
           "eta_s": None, "step_time_s": 1.0, "weight_version": 4, "heldout_first": None, "heldout": None,
           "reward": 0.5, "staleness": 0.0, "queue": 0, "diagnosis": "-", "length_warning": None}  # fmt: skip


def ledger(**counts) -> dict:
    zero = {"released_prompts": 0, "trained": 0, "failed": 0, "filtered": {}, "aborted_dropped": 0,
            "stale_dropped": 0, "rejected": 0, "recycled": 0, "in_flight_at_end": {"recycled_waiting": 0},
            "lost": 0, "trained_twice": 0, "balanced": True}  # fmt: skip
    return zero | counts


def ledger_lines(report: dict) -> list[str]:
    data = SimpleNamespace(summary=lambda: SUMMARY, run_dir=Path("run"), capacity=8, services=list,
                           errors=lambda n: [])  # fmt: skip
    return [x for x in render(data, report, " (audit.json)").splitlines() if x.startswith("ledger")]


def test_a_single_model_run_has_one_ledger_line():
    report = ledger(released_prompts=20, trained=10, failed=1, filtered={"zero_std": 2}, aborted_dropped=1,
                    stale_dropped=2, recycled=5)  # fmt: skip
    assert ledger_lines(report) == ["ledger: 20 released, 10 trained, 1 failed, 2 filtered, 3 dropped, 0 rejected, "
                                    "5 recycled, 0 in flight, 0 lost, 0 trained twice (balanced) (audit.json)"]  # fmt: skip


def test_a_multi_lora_run_has_a_line_for_each_adapter_with_its_foreign_and_retired_groups_dropped():
    a = ledger(released_prompts=12, trained=6, stale_dropped=2, foreign_dropped=3, retired_dropped=1, recycled=2)
    b = ledger(released_prompts=4, trained=4, foreign_dropped=0, retired_dropped=0, balanced=False)
    report = ledger(adapters={"rev@0123456789ab": a, "add@ba9876543210": b}, balanced=False)
    assert ledger_counts(a)["dropped"] == 6
    assert ledger_lines(report) == [
        "ledger of adapter rev@0123456789ab: 12 released, 6 trained, 0 failed, 0 filtered, 6 dropped, 0 rejected, "
        "2 recycled, 0 in flight, 0 lost, 0 trained twice (balanced) (audit.json)",
        "ledger of adapter add@ba9876543210: 4 released, 4 trained, 0 failed, 0 filtered, 0 dropped, 0 rejected, "
        "0 recycled, 0 in flight, 0 lost, 0 trained twice (NOT BALANCED) (audit.json)",
    ]
