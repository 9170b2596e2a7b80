"""Prompt release per mode, and the JSONL data source."""

from __future__ import annotations

import json

import pytest

from asyncrl_proto import PromptMsg
from services.api import RunConfig
from services.buffer.policy import ReleaseState, release_allowance
from services.data.source import DataError, PromptSource, load_rows


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


def test_no_mode_releases_more_than_the_run_still_needs():
    assert release_allowance(state(groups_left=5)) == 5  # fully async would allow 12
    assert release_allowance(state(mode="one_step", lookahead=1, groups_still_needed=8, groups_left=4)) == 4
    assert release_allowance(state(groups_left=-2)) == 0


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


def test_indices_epochs_and_recycled_first(tmp_path):
    p = write(tmp_path, [json.dumps({"prompt": str(i)}) for i in range(3)])
    src = PromptSource(RunConfig(n_samples_per_prompt=4), load_rows(p, "prompt", None, None))
    cur = {"epoch": 0, "cursor": 0, "next_group_index": 0}
    got = []
    for _ in range(4):
        msg, cur = src.next_release(cur["epoch"], cur["cursor"], cur["next_group_index"], [])
        got.append(msg)
    assert [m.group_index for m in got] == [0, 1, 2, 3]
    assert [m.prompt for m in got] == ["0", "1", "2", "0"] and got[3].epoch == 1  # epochs wrap
    assert cur == {"epoch": 1, "cursor": 1, "next_group_index": 4}
    recycled = [PromptMsg(group_index=1, prompt="1", attempt=1)]
    again, moved = src.next_release(cur["epoch"], cur["cursor"], cur["next_group_index"], recycled)
    assert (again.group_index, again.attempt, moved) == (1, 1, {})  # recycled first, cursor unmoved


def test_shuffle_is_seeded_per_epoch(tmp_path):
    p = write(tmp_path, [json.dumps({"prompt": str(i)}) for i in range(20)])
    rows = load_rows(p, "prompt", None, None)

    def first_40(seed):
        src = PromptSource(RunConfig(rollout_shuffle=True, rollout_seed=seed), rows)
        cur, out = {"epoch": 0, "cursor": 0, "next_group_index": 0}, []
        for _ in range(40):
            msg, cur = src.next_release(cur["epoch"], cur["cursor"], cur["next_group_index"], [])
            out.append(msg.prompt)
        return out

    first = first_40(1)
    assert first == first_40(1)
    assert first[:20] != [str(i) for i in range(20)] and sorted(first[:20]) == sorted(first[20:])
    assert first[:20] != first[20:]


def test_over_sampling_releases_in_multiples_of_its_batch():
    """--over-sampling-batch-size O: whenever fewer than the step's groups are done or in flight,
    O more prompts (Miles's rollout loop); never beyond what the run can train."""
    s = state(mode="sync", groups_still_needed=4, over_sampling=6)
    assert release_allowance(s) == 6
    s.outstanding = 3  # three dropped by the dynamic filter: 3 missing -> O more
    assert release_allowance(s) == 6
    s.outstanding = 6
    assert release_allowance(s) == 0
    assert release_allowance(state(mode="one_step", lookahead=1, groups_still_needed=8, over_sampling=6)) == 12
    assert release_allowance(state(mode="sync", groups_still_needed=4, over_sampling=6, groups_left=5)) == 5


COUNTING = []


class Counting:
    """A --data-source-path: prompt i is "q<i>", from any fresh instance."""

    def __init__(self, config):
        self.config, self.i = config, 0
        COUNTING.append(self)

    def get_samples(self, num_samples):
        from services.api import Sample

        out = []
        for _ in range(num_samples):
            out.append([Sample(prompt=f"q{self.i}", label=str(self.i), metadata={"i": self.i})])
            self.i += 1
        return out


class Exhausted(Counting):
    def get_samples(self, num_samples):
        return [] if self.i >= 2 else super().get_samples(num_samples)


def test_a_custom_data_source_is_read_by_position_and_replays_after_a_restart():
    from services.data.source import CustomPromptSource, make_prompt_source

    cfg = RunConfig(data_source_path=f"{__name__}.Counting", n_samples_per_prompt=2)
    src = make_prompt_source(cfg)
    assert isinstance(src, CustomPromptSource)
    msg, cur = src.next_release(0, 3, 7, [])  # position 3 of a fresh source: drawn in order up to it
    assert (msg.prompt, msg.label, msg.metadata, msg.group_index, msg.n_samples) == ("q3", "3", {"i": 3}, 7, 2)
    assert cur == {"epoch": 0, "cursor": 4, "next_group_index": 8}
    assert src.next_release(0, 1, 5, [])[0].prompt == "q1"  # pure: an earlier position again
    restarted = make_prompt_source(cfg)
    assert restarted.next_release(0, 3, 7, [])[0].prompt == "q3" and len(COUNTING) == 2
    with pytest.raises(DataError, match="returned no group: the source is exhausted"):
        make_prompt_source(cfg.model_copy(update={"data_source_path": f"{__name__}.Exhausted"})).next_release(
            0, 2, 0, []
        )


def test_parquet_rows_read_as_jsonl_rows_do(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": "1+1", "a": "2", "meta": {"rm_type": "math", "level": 1}},
            {"q": "2+2", "a": "4", "meta": {"rm_type": None, "level": 2}}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_rows(tmp_path / "d.parquet", "q", "a", "meta") == [
        {"prompt": "1+1", "label": "2", "metadata": {"rm_type": "math", "level": 1}},
        {"prompt": "2+2", "label": "4", "metadata": {"rm_type": None, "level": 2}},
    ]
    chat = [{"messages": [{"role": "user", "content": "hi"}]}]  # chat prompts: a list of structs
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "chat.parquet")
    assert load_rows(tmp_path / "chat.parquet", "messages", None, None)[0]["prompt"] == chat[0]["messages"]
    with pytest.raises(DataError, match=r"d.parquet:1: row has no 'prompt' key \(set --input-key\)"):
        load_rows(tmp_path / "d.parquet", "prompt", "a", "meta")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad.parquet: not a readable Parquet file"):
        load_rows(tmp_path / "bad.parquet", "q", "a", None)


def test_a_row_whose_rm_type_cannot_score_is_named_by_file_and_row(tmp_path):
    from services.common.config.rm_types import row_rm_type_check

    p = write(tmp_path, [json.dumps({"prompt": "a", "metadata": {"rm_type": "math"}}),
                         json.dumps({"prompt": "b", "metadata": {"rm_type": "remote_rm"}})])  # fmt: skip
    with pytest.raises(DataError, match=r"d.jsonl:2: metadata.rm_type 'remote_rm' needs --rm-url"):
        load_rows(p, "prompt", None, "metadata", row_rm_type_check(has_url=False))
    assert len(load_rows(p, "prompt", None, "metadata", row_rm_type_check(has_url=True))) == 2


def test_a_parquet_files_size_is_what_it_holds_once_read(tmp_path):
    """A multi-LoRA adapter's data is capped by --multi-lora-max-data-mb: a compressed Parquet
    file counts by its decoded size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from services.data.source import data_size

    rows = [{"prompt": "7" * 1000, "label": "1"}] * 2000
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "big.parquet", compression="zstd")
    assert (tmp_path / "big.parquet").stat().st_size < 200_000
    assert data_size(tmp_path / "big.parquet") >= 2000 * 1000  # every row's prompt, decoded
    assert 2**19 < data_size(tmp_path / "big.parquet", stop_above=2**19) < 2000 * 1000  # counting stops past the cap
    jsonl = write(tmp_path, ['{"prompt": "a"}'])
    assert data_size(jsonl) == jsonl.stat().st_size
