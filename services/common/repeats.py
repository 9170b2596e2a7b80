"""Logs that count only real events: a condition that holds tick after tick is said once, then
again only when it changes, with how many times the previous one held."""

from __future__ import annotations

import logging


class Repeats:
    """One line per change of a keyed condition (`say`), and one when it ends (`clear`)."""

    def __init__(self, logger: logging.Logger):
        self.log = logger
        self._held: dict[str, tuple[str, int]] = {}  # key -> (what was said, times it held)

    def say(self, key: str, text: str, level: int = logging.WARNING, kind: str | None = None) -> bool:
        """Log `text` unless `key`'s condition is the one it said last (`kind`, by default the
        text itself: pass a kind when the text carries a figure that moves); True when logged."""
        said, times = self._held.get(key, ("", 0))
        condition = text if kind is None else kind
        if said == condition:
            self._held[key] = (said, times + 1)
            return False
        before = f" (the previous condition held {times} times)" if times > 1 else ""
        self.log.log(level, "%s%s", text, before)
        self._held[key] = (condition, 1)
        return True

    def clear(self, key: str) -> None:
        """`key`'s condition ended: the next say logs again, and a long one is summed up."""
        said, times = self._held.pop(key, ("", 0))
        if times > 1:
            self.log.info("no longer (after %d times): %s", times, said)
