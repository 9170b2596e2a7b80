"""Whole runs start from one prebuilt tiny model (the one the launcher would build: seed 1234,
20 warm-start steps) instead of building their own: a run's own build costs ~8 s."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _prebuilt_model(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("ASYNCRL_HF_CHECKPOINT", str(tiny_model_dir))
