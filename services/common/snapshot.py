"""The `.complete` marker of an HF snapshot or checkpoint: written last, deleted first, so a
reader never takes a half-written one. Free of torch, for the launcher and the eval service."""

from __future__ import annotations

from pathlib import Path

COMPLETE_MARKER = ".complete"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).exists()
