"""Helpers for tests that run a whole job as a child process and then audit it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path


@contextlib.contextmanager
def stopped_at_exit(proc: subprocess.Popen):
    """The run is killed when the block ends while it still runs (a test that failed midway)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def finish(proc: subprocess.Popen, timeout_s: float = 300) -> str:
    """Wait for a run to end (killed if it outlives `timeout_s`); it must succeed. Its output."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    return out


def audited(run_dir: Path, trained_samples: int) -> dict:
    """`asyncrl audit RUN_DIR --json` on a finished run: balanced, nothing lost, nothing trained
    twice, exactly `trained_samples` trained. The report."""
    audit = subprocess.run([sys.executable, "-m", "services.cli", "audit", str(run_dir), "--json"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert audit.returncode in (0, 1), f"the audit failed (exit {audit.returncode}): {audit.stderr[-3000:]}"
    report = json.loads(audit.stdout)
    assert audit.returncode == 0 and report["balanced"], report["problems"]
    assert report["lost"] == 0 and report["trained_twice"] == 0
    assert report["trained"] == trained_samples
    return report
