"""Which weight snapshots the trainer deletes: the oldest beyond --keep-weight-snapshots, never
the one behind the committed step, and never one the engines may be loading (newer than their
live version) unless the engines are that far behind."""

from __future__ import annotations

from pathlib import Path

from services.common.snapshot import SNAPSHOT_LAG_FACTOR, snapshots_to_remove


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
