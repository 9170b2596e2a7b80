"""Which weight snapshots the trainer deletes: the oldest beyond --keep-weight-snapshots, never
the one behind the committed step, and never one the engines may be loading (newer than their
live version) unless the engines are that far behind."""

from __future__ import annotations

from pathlib import Path

from services.common.snapshot import COMPLETE_MARKER, SNAPSHOT_LAG_FACTOR, numbered, snapshots_to_remove


def names(paths: list[Path]) -> list[int]:
    return [int(p.name[1:]) for p in paths]


def test_the_oldest_beyond_keep_go_when_the_engines_are_current():
    snaps = [Path(f"w/v{k}") for k in range(1, 9)]
    assert names(snapshots_to_remove(snaps, 3, None, live=8)) == [1, 2, 3, 4, 5]
    assert names(snapshots_to_remove(snaps, 3, Path("w/v2"), live=8)) == [1, 3, 4, 5]  # the committed one stays


def test_versions_the_engines_have_not_loaded_yet_stay():
    snaps = [Path(f"w/v{k}") for k in range(1, 9)]
    # the engines run v4: v5 (which weight-sync may be loading now) and later stay, and v4 itself
    # (an engine restarted gets the live version back from its snapshot)
    assert names(snapshots_to_remove(snaps, 3, None, live=4)) == [1, 2, 3]


def test_engines_far_behind_do_not_make_snapshots_pile_up():
    keep = 2
    snaps = [Path(f"w/v{k}") for k in range(1, 31)]
    kept = set(names(snaps)) - set(names(snapshots_to_remove(snaps, keep, None, live=0)))
    assert kept == set(range(31 - keep * SNAPSHOT_LAG_FACTOR, 31))


def test_a_version_is_its_prefix_and_ascii_digits_only(tmp_path):
    """`v²` (str.isdigit accepts it, int() refuses it), `v1.tmp` or `v` are some other file: the
    trainer, the engine, the launcher and the weight store all skip them and sort by number."""
    for name in ["v10", "v2", "v²", "v1.tmp", "v", "w3", "v-1"]:
        (tmp_path / name).mkdir()
    assert [(k, p.name) for k, p in numbered(tmp_path.glob("v*"))] == [(2, "v2"), (10, "v10")]
    assert numbered(["v3/.complete", "v²/.complete", "v1/.complete", "v4/x"], "v", "/.complete") == [
        (1, "v1/.complete"),
        (3, "v3/.complete"),
    ]


def test_an_adapter_save_directory_with_an_odd_name_is_not_a_save(tmp_path):
    """The user's --save directory may hold anything: `step_²` is no step count (it raised ValueError)."""
    from services.trainer.multi_lora import _latest_save

    for name in ["step_3", "step_12", "step_²", "step_x"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / COMPLETE_MARKER).touch()
    assert _latest_save(tmp_path) == tmp_path / "step_12"
