"""Child processes: started with a parent-death signal, tracked by PID, stopped by PID.

Every process the launcher or a test starts goes through `spawn`, so that a crashed parent never
leaves orphans (Linux PR_SET_PDEATHSIG) and every stop is SIGTERM, a deadline, then SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from contextlib import nullcontext, suppress
from functools import partial
from pathlib import Path

_PR_SET_PDEATHSIG = 1
EXIT_FATAL = 78
"""Exit code of a service that stopped for a reason no restart can fix (EX_CONFIG): refused
credentials, an invalid configuration or secret, a full store or disk."""


RESTARTS_FILE = "restarts.jsonl"
"""RUN_DIR/restarts.jsonl: the launcher's line per restart of a child (name, at, the pid that
ended, why); `asyncrl status` and the dashboard show them."""
EXITS_FILE = "exits.json"
"""RUN_DIR/exits.json: the launcher's record of each process it stopped for good, {name: {"pid",
"code"}}: the dashboard and `asyncrl status` show a finished run's services as "exited 0"."""


def _die_with_parent() -> None:
    with suppress(OSError):  # not Linux: orphans are then stopped by PID at shutdown only
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    cmd: list[str], log_path: str | Path | None = None, env: dict[str, str] | None = None, cwd: str | Path | None = None
) -> subprocess.Popen:
    # a log may quote a secret a child prints (SGLang logs its --api-key): only its owner reads it
    log = open(log_path, "ab", opener=partial(os.open, mode=0o600)) if log_path else nullcontext(subprocess.DEVNULL)
    with log as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            preexec_fn=_die_with_parent,
        )


def replace_file(path: Path, data: str | bytes, mode: int = 0o666) -> Path:
    """`path` replaced whole by `data` (written beside it, then renamed): a reader never sees it
    half-written. A new file gets `mode` (less the umask)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> int | None:
    """SIGTERM, wait up to timeout_s, then SIGKILL. Returns the exit code."""
    if proc.poll() is not None:
        return proc.returncode
    try:
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie still answers kill(0); read its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outbound connections (Linux; else IANA's)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


_handed_out: set[int] = set()
"""Ports this process chose already: each is a child's until the process ends, bound or not yet."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port to listen on, outside the ephemeral range: a port the kernel hands out for
    bind(0) can be taken by any process's outbound connection before the service binds it, and
    stay taken for that connection's life (every restart of the service on it would fail).
    Never one this process chose before: the launcher picks every child's port before the child
    binds it, and two children drawn the same port made one of them fail every restart."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(10_000, 30_000) if not low <= p <= high and p not in _handed_out]
    for port in random.SystemRandom().sample(candidates, min(200, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # nothing free outside it: any port
        s.bind((host, 0))
        _handed_out.add(s.getsockname()[1])
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} ({proc.args[0]}) exited with {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f}s")


CPU_ENV = "ASYNCRL_CPUS"


def apply_cpu_affinity_from_env() -> None:
    """Pin this process to the CPUs listed in ASYNCRL_CPUS (e.g. "0" or "2,3"), if set: the
    launcher's --pin-cpus gives engines and the trainer separate cores, as GPUs would be."""
    cpus = os.environ.get(CPU_ENV)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",") if c.strip()})


def split_cpus(num_engines: int) -> tuple[list[str], str] | None:
    """CPU lists for each engine and for the trainer: the trainer gets the upper half of the
    machine's CPUs, the engines share the lower half. None when there is only one CPU."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return [str(cpus[i % half]) for i in range(num_engines)], ",".join(str(c) for c in cpus[half:])
