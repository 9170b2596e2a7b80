"""The named crash points (services.common.crash.POINTS) are exactly the ones the code passes,
so the crash suite (tests/crash) covers every one of them; and the injection parses."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.crash import MULTI_LORA_POINTS, POINTS


def test_every_declared_point_is_in_the_code_and_every_point_in_the_code_is_declared():
    import re

    root = Path(__file__).resolve().parents[2] / "services"
    used = set()
    for path in root.rglob("*.py"):
        used |= set(re.findall(r'crash\.point\("([\w-]+)", "(\w+)"\)', path.read_text()))
    declared = [(s, p) for points in (POINTS, MULTI_LORA_POINTS) for s, ps in points.items() for p in ps]
    assert used == set(declared) and len(declared) == len(set(declared))


def test_an_unknown_point_is_refused(monkeypatch):
    import importlib

    import services.common.crash as crash

    monkeypatch.setenv(crash.ENV, "buffer:no_such_point:1")
    with pytest.raises(ValueError, match="no crash point 'no_such_point' in 'buffer'"):
        importlib.reload(crash)
    monkeypatch.delenv(crash.ENV)
    importlib.reload(crash)
    assert crash.ARMED is None
