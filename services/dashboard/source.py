"""Where the dashboard reads a run's streams: the live run's NATS server, or, for a finished run,
a nats-server of its own on a copy of the run's store (the run's files are never written)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from services.common.run_store import admin_credentials, store_server


class StreamSource:
    """A connected Bus on the run's streams, opened on first use and reopened after an error."""

    def __init__(self, run_dir: Path, live: bool, nats_url: str | None, run_id: str):
        self.run_dir, self.live, self.url, self.run_id = run_dir, live, nats_url, run_id
        self._stack = contextlib.ExitStack()
        self._bus = None

    def start(self) -> None:
        """A finished run: copy its store and serve the copy (seconds for a long run's ledger)."""
        if self.live:
            return
        tmp = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncrl-dashboard-")))
        store = self.run_dir / "nats"
        if not store.exists():
            raise RuntimeError(f"{store} does not exist: the run's streams are not on this machine")
        # weight snapshots (the object bucket's stream) are not what a dashboard reads: not copied
        shutil.copytree(store, tmp / "nats", ignore=shutil.ignore_patterns("OBJ_*"))
        srv = self._stack.enter_context(store_server(self.run_dir, tmp / "nats", log_name="nats-server",
                                                     log_dir=tmp))  # nothing written into the run  # fmt: skip
        self.url = srv.url

    async def bus(self):
        from services.common.bus import Bus

        if self._bus is None:
            self._bus = await Bus.connect(self.url, self.run_id, "dashboard", connect_timeout_s=10,
                                          creds=admin_credentials(self.run_dir))  # fmt: skip
        return self._bus

    async def reset(self) -> None:
        if self._bus is not None:
            with contextlib.suppress(Exception):
                await self._bus.close()
            self._bus = None

    async def close(self) -> None:
        await self.reset()
        self._stack.close()

    def close_now(self) -> None:
        """Before any connection (a start that failed): the copy and its server, gone."""
        self._stack.close()
