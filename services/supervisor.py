"""The launcher's child processes: started by PID, restarted when they exit or stay unhealthy,
stopped by PID in reverse order.

A child is restarted (same command, environment, ports and log) when it exits, or when its
health check (a service's /healthz, an engine's /health_generate) has failed for
--health-restart-s once it had been healthy: a live process that no longer works (a stuck
event loop, a stalled engine) is as dead as an exited one. Each child may be restarted
--service-restarts times within --restart-window-s (older restarts no longer count: a long run
survives a crash now and then). A child that exits with EXIT_FATAL says a restart cannot help (refused
credentials, an invalid configuration, a full disk): the run fails at once with its last log lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.common import crash, procs
from services.common.procs import EXIT_FATAL
from services.common.secrets import redact_text

HEALTH_POLL_S = 2.0
HEALTH_TIMEOUT_S = 5.0


class LaunchError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen
    health_url: str | None = None
    recent: list[float] = field(default_factory=list)
    """The times of its restarts inside the window."""
    healthy_once: bool = False
    """Passed a health check since its last (re)start: only then do failures count."""
    failing_since: float | None = None
    next_check: float = field(default=0.0)
    launch_cmd: list[str] = field(default_factory=list)
    """The command it was first started with (a restart may run another: before_restart)."""
    essential: bool = True
    """False for a child the run does not need (the dashboard): past its restarts it is left
    stopped, said once, and the run goes on."""
    given_up: bool = False


class Supervisor:
    def __init__(self, run_dir: Path, max_restarts: int, health_restart_s: float, out=print,
                 headers: dict[str, str] | None = None, secrets: list[str] | None = None,
                 restart_window_s: float = 600.0, before_restart=None):  # fmt: skip
        """secrets: never quoted from a child's log (an SGLang server logs its API key);
        before_restart(child) -> the command to restart it with (e.g. an engine on newer weights)."""
        self.before_restart = before_restart
        self.max_restarts, self.window_s = max_restarts, restart_window_s
        self.run_dir = run_dir
        self.secrets = secrets or []
        self.health_restart_s = health_restart_s
        self.out = out
        self.headers = headers or {}
        self.children: list[Child] = []
        self.extra_pids: dict[str, int] = {}
        self.exits: dict[str, dict] = {}
        """Each process stopped for good: its last pid and exit code (exits.json)."""

    def log_path(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def spawn(self, name: str, cmd: list[str], env: dict[str, str], health_url: str | None = None,
              essential: bool = True) -> Child:  # fmt: skip
        proc = procs.spawn(cmd, log_path=self.log_path(name), env=env)
        child = Child(name, cmd, env, proc, health_url, launch_cmd=list(cmd), essential=essential)
        self.children.append(child)
        self.write_pids()
        return child

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def write_pids(self) -> None:
        pids = {c.name: c.proc.pid for c in self.children} | self.extra_pids | {"launcher": os.getpid()}
        procs.replace_file(self.run_dir / "pids.json", json.dumps(pids, indent=2))

    def record_exits(self, stopped: dict[str, subprocess.Popen | None]) -> None:
        """exits.json, replaced whole: the pid and exit code of each process in `stopped` that has
        ended (a finished run's services show as "exited 0", not as "not running")."""
        ended = {n: p for n, p in stopped.items() if p is not None and p.returncode is not None}
        self.exits |= {n: {"pid": p.pid, "code": p.returncode} for n, p in ended.items()}
        if self.exits:
            procs.replace_file(self.run_dir / procs.EXITS_FILE, json.dumps(self.exits, indent=2))

    def tail(self, name: str, n: int = 15) -> str:
        try:
            text = "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"
        return redact_text(text, self.secrets)

    # ---- restarts ------------------------------------------------------------------------------
    def check_exits(self, allow_exit: tuple[str, ...] = ()) -> None:
        """Restart every child that exited (but those in allow_exit with code 0)."""
        for c in self.children:
            code = c.proc.poll()
            if code is None or (c.name in allow_exit and code == 0) or c.given_up:
                continue
            if code == EXIT_FATAL and c.essential:
                raise LaunchError(
                    f"{c.name} (pid {c.proc.pid}) stopped on an error a restart cannot fix; last log lines:\n"
                    f"{self.tail(c.name)}"
                )
            self.restart(c, f"exited with code {code}", fatal=code == EXIT_FATAL)

    def take_restart(self, recent: list[float]) -> bool:
        """Record a restart in `recent` (times, pruned to the window) if at most `max_restarts`
        restarts within any `window_s` seconds allow it."""
        now = time.monotonic()
        recent[:] = [t for t in recent if now - t < self.window_s]
        if len(recent) >= self.max_restarts:
            return False
        recent.append(now)
        return True

    def restart(self, c: Child, why: str, fatal: bool = False) -> None:
        """Restart `c`, unless its restarts are spent (or a restart cannot help: `fatal`): then a
        child the run needs fails it, and one it does not (the dashboard) is left stopped."""
        if fatal or not self.take_restart(c.recent):
            if not c.essential:
                c.given_up = True
                _kill(c)
                self.record_exits({c.name: c.proc})
                self.out(f"  {c.name} (pid {c.proc.pid}) {why}; not restarted again (the run goes on without it; "
                         f"see {self.log_path(c.name)})")  # fmt: skip
                return
            raise LaunchError(
                f"{c.name} (pid {c.proc.pid}) {why}, its {self.max_restarts + 1}th time in "
                f"{self.window_s:.0f}s; last log lines:\n{self.tail(c.name)}"
            )
        c.env = {k: v for k, v in c.env.items() if k != crash.ENV}  # an injected crash fires once per run
        self.out(f"  {c.name} (pid {c.proc.pid}) {why}; restarting ({len(c.recent)}/{self.max_restarts} "
                 f"in {self.window_s:.0f}s)")  # fmt: skip
        _kill(c)  # unhealthy but alive: it would not answer a SIGTERM in time either
        with (self.run_dir / procs.RESTARTS_FILE).open("a") as f:  # the dashboard's and `asyncrl status`'s record
            f.write(json.dumps({"name": c.name, "at": time.time(), "pid": c.proc.pid, "why": why}) + "\n")
        if self.before_restart is not None:
            c.cmd = self.before_restart(c)
        c.proc = procs.spawn(c.cmd, log_path=self.log_path(c.name), env=c.env)
        c.healthy_once, c.failing_since, c.next_check = False, None, 0.0
        self.write_pids()

    # ---- health --------------------------------------------------------------------------------
    async def check_health(self, http: httpx.AsyncClient) -> None:
        """Poll the children whose check is due; restart one that has failed for health_restart_s
        since it was last healthy."""
        if self.health_restart_s <= 0:
            return
        now = time.monotonic()
        due = [c for c in self.children if c.health_url and c.proc.poll() is None and now >= c.next_check]
        results = await asyncio.gather(*(self._probe(http, c.health_url) for c in due))
        for c, failure in zip(due, results, strict=True):
            c.next_check = now + HEALTH_POLL_S
            if failure is None:
                c.healthy_once, c.failing_since = True, None
                continue
            if not c.healthy_once:
                continue  # still starting (or restarting): its start-up is not a health failure
            c.failing_since = c.failing_since or now
            if now - c.failing_since >= self.health_restart_s:
                self.restart(c, f"failed its health check for {now - c.failing_since:.0f}s ({failure})")

    async def _probe(self, http: httpx.AsyncClient, url: str) -> str | None:
        try:
            r = await http.get(url, headers=self.headers, timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}"
        return None if r.status_code == 200 else f"HTTP {r.status_code}"

    # ---- stop ------------------------------------------------------------------------------------
    def stop_all(self) -> None:
        for c in reversed(self.children):
            procs.stop(c.proc, timeout_s=15.0)
        self.record_exits({c.name: c.proc for c in self.children})


def _kill(c: Child) -> None:
    if c.proc.poll() is None:
        c.proc.kill()
        c.proc.wait(timeout=10)
