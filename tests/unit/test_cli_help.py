"""Every `asyncrl ... --help` a user can type prints its help and exits 0 (the README tells users to
run them); the training commands show their flags under one heading per configuration section."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common.config import FLAGS, SECTIONS
from services.common.config_load import flag_name
from services.common.entry import SERVICES

COMMANDS = [
    [],
    ["train"],
    ["train-async"],
    ["init-run"],
    ["service"],
    *[["service", name] for name in SERVICES],
    ["engine"],
    ["audit"],
    ["status"],
    ["dashboard"],
    ["build-model"],
    ["eval-adapter"],
    ["secrets"],
]


def _help(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *argv, "--help"], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a) or "asyncrl")
def test_every_help_works(argv):
    r = _help(argv)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert r.stdout.strip(), "no help printed"


def test_training_flags_are_grouped_by_section():
    out = _help(["train-async"]).stdout
    headings = [f"{s.__name__.removesuffix('Section').lower().replace('multilora', 'multi-LoRA')} flags:"
                for s in SECTIONS]  # fmt: skip
    positions = [out.index(h) for h in headings]
    assert positions == sorted(positions), "sections out of order"
    # each flag is listed under its own section's heading
    for name in ("save_interval", "max_weight_staleness", "rollout_temperature", "eval_interval", "nats_url"):
        i = SECTIONS.index(FLAGS[name].section)
        start = positions[i]
        end = positions[i + 1] if i + 1 < len(positions) else len(out)
        assert f"\n  {flag_name(name)}" in out[start:end], name
    assert len(FLAGS) == sum(len(s.model_fields) for s in SECTIONS)  # every field a flag, no two alike
