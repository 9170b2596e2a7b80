"""Prompt release per mode, and the JSONL data source."""

from __future__ import annotations

import json

import pytest

from services.api import RunConfig
from services.buffer.datasource import DataError, PromptSource, load_rows
from services.buffer.policy import ReleaseState, release_allowance


def state(**kw) -> ReleaseState:
    base = dict(mode="fully_async", batch_size=4, capacity=8, inflight_cap=4, want_step=0, lookahead=0,
                groups_still_needed=4, stored=0, outstanding=0, live_version=0, min_version=None)  # fmt: skip
    base.update(kw)
    return ReleaseState(**base)


def test_nothing_before_the_first_get():
    assert release_allowance(state(want_step=None)) == 0
    assert release_allowance(state(mode="sync", want_step=None)) == 0


def test_fully_async_fills_capacity_plus_in_flight_and_stops_when_full():
    assert release_allowance(state()) == 12
    assert release_allowance(state(stored=8, outstanding=4)) == 0  # full: producers run dry
    assert release_allowance(state(stored=5, outstanding=4)) == 3


def test_sync_releases_the_step_only_on_the_right_weights():
    s = state(mode="sync", groups_still_needed=4, min_version=3, live_version=2)
    assert release_allowance(s) == 0
    s.live_version = 3
    assert release_allowance(s) == 4
    s.outstanding, s.stored = 3, 1
    assert release_allowance(s) == 0


def test_one_step_looks_ahead():
    s = state(mode="one_step", lookahead=1, groups_still_needed=8, min_version=None)
    assert release_allowance(s) == 8


def write(tmp_path, lines: list[str]):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_malformed_rows_name_file_and_line(tmp_path):
    p = write(tmp_path, ['{"prompt": "a", "label": "b"}', "{not json"])
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        load_rows(p, "prompt", "label", "metadata")
    p = write(tmp_path, ['{"question": "a"}'])
    with pytest.raises(DataError, match=r"d.jsonl:1: row has no 'prompt' key \(set --input-key\)"):
        load_rows(p, "prompt", "label", None)
    with pytest.raises(DataError, match="no such file"):
        load_rows(tmp_path / "missing.jsonl", "prompt", None, None)


def test_keys_and_metadata(tmp_path):
    p = write(tmp_path, [json.dumps({"q": "a", "a": "b", "meta": {"x": 1}})])
    rows = load_rows(p, "q", "a", "meta")
    assert rows == [{"prompt": "a", "label": "b", "metadata": {"x": 1}}]


def test_indices_epochs_recycling_and_state(tmp_path):
    p = write(tmp_path, [json.dumps({"prompt": str(i)}) for i in range(3)])
    cfg = RunConfig(n_samples_per_prompt=4)
    src = PromptSource(cfg, load_rows(p, "prompt", None, None))
    got = [src.next_prompt() for _ in range(4)]
    assert [m.group_index for m in got] == [0, 1, 2, 3]
    assert [m.prompt for m in got] == ["0", "1", "2", "0"] and got[3].epoch == 1  # wraps
    src.recycle(1, "1", None, {}, attempt=0, epoch=0, row=1)
    again = src.next_prompt()
    assert (again.group_index, again.attempt, again.prompt) == (1, 1, "1")  # recycled first
    state = src.state_dict()
    src.recycle(2, "2", None, {}, attempt=0, epoch=0, row=2)
    other = PromptSource(cfg, src.rows)
    other.load_state_dict(src.state_dict())
    assert other.next_prompt().group_index == 2 and other.next_prompt().group_index == 4
    assert state["next_group_index"] == 4


def test_shuffle_is_seeded_per_epoch(tmp_path):
    p = write(tmp_path, [json.dumps({"prompt": str(i)}) for i in range(20)])
    rows = load_rows(p, "prompt", None, None)
    a = PromptSource(RunConfig(rollout_shuffle=True, rollout_seed=1), rows)
    b = PromptSource(RunConfig(rollout_shuffle=True, rollout_seed=1), rows)
    first = [a.next_prompt().prompt for _ in range(40)]
    assert first == [b.next_prompt().prompt for _ in range(40)]
    assert first[:20] != [str(i) for i in range(20)] and sorted(first[:20]) == sorted(first[20:])
    assert first[:20] != first[20:]
