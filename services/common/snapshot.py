"""The `.complete` marker of an HF snapshot or checkpoint: written last, deleted first, so a
reader never takes a half-written one; the version numbers in snapshots' names and engines'
answers. Free of torch, for the launcher, the engine and the eval service."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path

COMPLETE_MARKER = ".complete"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).exists()


def numbered(items: Iterable[str | Path], prefix: str = "v", suffix: str = "") -> list[tuple[int, str | Path]]:
    """(k, item) for each item (a path, by its name, or a name) named `<prefix><k><suffix>`, k in
    ASCII digits, by k: `v²` or `step_x` is some other file, never a version (int() refuses it)."""
    pattern = re.compile(re.escape(prefix) + "([0-9]+)" + re.escape(suffix))
    found = ((m, item) for item in items if (m := pattern.fullmatch(getattr(item, "name", item))))
    return sorted(((int(m[1]), item) for m, item in found), key=lambda kv: kv[0])


def version_number(reported) -> int:
    """A weight version (as an engine reports it) as a number: SGLang's initial "default" (the
    launch weights), None and anything else not a number are 0."""
    try:
        return int(reported)
    except (TypeError, ValueError):
        return 0


def remove_snapshot(path: str | Path) -> None:
    """Delete a snapshot, its marker first: whoever reads or links it meanwhile finds it
    incomplete instead of taking a directory whose files are going."""
    (Path(path) / COMPLETE_MARKER).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def resolved(uri: str) -> Path | None:
    """The absolute path a URI from a message names; None for one that cannot be a path (a NUL
    byte, a loop of links), which no consumer should ever load."""
    try:
        return Path(uri).resolve()
    except (ValueError, OSError, RuntimeError):
        return None


SNAPSHOT_LAG_FACTOR = 4
"""Snapshots newer than the engines' live version are kept up to this many times
--keep-weight-snapshots (then the oldest go, as before)."""


def snapshots_to_remove(snapshots: list[Path], keep: int, backing: Path | None, live: int) -> list[Path]:
    """The snapshots (`v<k>` directories, oldest first) beyond the newest `keep`, but the one
    behind the committed step, and the engines' `live` version and those newer among the newest
    SNAPSHOT_LAG_FACTOR x keep: weight-sync may be loading one of them, and an engine restarted
    gets the live one back from its snapshot. The model's snapshots and each multi-LoRA adapter's
    versions are retained by it."""
    pending = {p for p in snapshots[-keep * SNAPSHOT_LAG_FACTOR :] if int(p.name[1:]) >= live}
    return [p for p in snapshots[:-keep] if p != backing and p not in pending]
