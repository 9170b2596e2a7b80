"""What a run prints while it trains.

Off a terminal (CI, a redirected log) every step is a full line, as the launcher formats it
(launcher.format_progress). On a terminal one progress line (tqdm) updates in place: step/total,
ETA, the step's reward, the last held-out reward, staleness and the buffer's queue; full lines
(eval points, restarts, warnings, the end) print above it.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable

from services.common.run_store import num

BAR = "{l_bar}{bar:20}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}"
"""The progress line: percent, bar, step/total, elapsed<ETA, then progress_fields."""


class Console:
    """`write(line)` prints a full line; `step(step, total, record, heldout)` reports a step."""

    def __init__(self, stream=None, fallback: Callable[[int, int, dict], str] | None = None):
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.fallback = fallback
        self._bar = None

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def step(self, step: int, total: int, rec: dict, heldout: float | None = None) -> None:
        if not self.tty:
            if self.fallback is not None:
                self.write(self.fallback(step, total, rec))
            return
        if self._bar is None:
            from tqdm import tqdm

            sized = _size(self.stream) > (0, 0)  # a terminal that says its size: follow it; else 100 x 24
            self._bar = tqdm(total=total, file=self.stream, unit="step", dynamic_ncols=sized,
                             ncols=None if sized else 100, nrows=None if sized else 24, smoothing=0.1,
                             bar_format=BAR)  # fmt: skip
        self._bar.n = min(step + 1, total)
        self._bar.set_postfix_str(progress_fields(rec, heldout), refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _size(stream) -> tuple[int, int]:
    """(columns, lines) of the stream's terminal; (0, 0) when it says none (a new pseudo-terminal,
    a test's stand-in), where tqdm would draw nothing."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return (0, 0)
    return (size.columns, size.lines) if size.columns and size.lines else (0, 0)


def progress_fields(rec: dict, heldout: float | None) -> str:
    """The progress line's figures: reward, held-out, staleness, queue."""
    reward, staleness = num(rec.get("rollout/reward/mean")), num(rec.get("rollout/fully_async/avg_staleness"), "{:.2f}")
    queue = num(rec.get("rollout/fully_async/queue_size"), "{:.0f}")
    return f"reward {reward} | held-out {num(heldout)} | staleness {staleness} | queue {queue}"
