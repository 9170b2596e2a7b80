"""What a run prints: on a terminal one progress line updated in place (step/total, ETA, reward,
held-out, staleness, queue) with full lines only for eval points, warnings and the end; off a
terminal a full line per step, as before."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios

from services.console import Console
from services.launcher import format_progress
from tests.e2e.test_cli_run import SMALL

REC = {"rollout/reward/mean": 0.25, "rollout/fully_async/avg_staleness": 0.5, "rollout/fully_async/queue_size": 3}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_every_step_is_a_full_line():
    out = io.StringIO()
    console = Console(out, fallback=format_progress)
    for step in range(3):
        console.step(step, 3, REC, heldout=0.4)
    console.write("  eval/step 1 ...")
    console.close()
    lines = out.getvalue().splitlines()
    assert lines == [format_progress(s, 3, REC) for s in range(3)] + ["  eval/step 1 ..."]


def test_on_a_terminal_one_line_updates_in_place():
    out = Terminal()
    console = Console(out, fallback=format_progress)
    console.step(0, 10, REC)
    console.write("  eval/step 0 (after 0 steps): eval/x 0.100")
    console.step(4, 10, REC, heldout=0.1)
    console.close()
    text = out.getvalue()
    assert "[step" not in text and "\r" in text  # no per-step lines: the bar is redrawn
    assert "5/10" in text and "reward 0.250" in text and "held-out 0.100" in text
    assert "staleness 0.50" in text and "queue 3" in text
    assert "  eval/step 0 (after 0 steps): eval/x 0.100\n" in text  # full lines above the bar


def test_a_run_on_a_terminal_shows_progress_and_its_eval_points(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal of 160 columns
    run = subprocess.Popen([sys.executable, "-m", "services.cli", "train-async", *SMALL, "--num-rollout", "4",
                            "--eval-interval", "2", "--run-dir", str(tmp_path / "run")],
                           stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=tmp_path)  # fmt: skip
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the run closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert run.wait(timeout=240) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "[step " not in text, text[-2000:]  # not one line per step
    assert "4/4" in text and "\r" in text
    assert re.search(r"held-out \d\.\d{3}", text), text[-2000:]  # the last eval point's reward, a number
    assert "eval/step 0" in text and "done in" in text  # eval points and the end are full lines
