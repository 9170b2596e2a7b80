"""What the dashboard and `asyncrl status` show, read from a run: its files (config.json,
metrics.jsonl, eval.jsonl, services.json, pids.json, restarts.jsonl, the sample records, the
logs) and its streams (the ledger, weights.live, dead letters), each read incrementally: a
refresh reads only what was appended since the last one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl_proto import AdapterRegistryState, DeadLetter, WeightsLive, decode
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.subjects import ADAPTERS_KV_KEY
from services.buffer.state import Auditor, lineage_entry, prompt_of
from services.common import procs, sample_records
from services.common.procs import EXITS_FILE, RESTARTS_FILE
from services.common.run_store import admin_credentials, registrations, run_config, store_server
from services.dashboard.diagnosis import diagnose, length_guard

READ_BATCH = 5000
"""Stream messages read per request; a refresh reads batch after batch until it has them all."""
MAX_POINTS = 600
"""Points per curve at most: a longer series is averaged into this many bins on the server."""
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL|Traceback)\b")


class JsonLines:
    """A JSON-lines file read incrementally (a torn last line waits for its end)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rows, self.inode = path, 0, [], None

    def refresh(self) -> None:
        """Read what was appended (one caller at a time: the dashboard's refresh, `asyncrl status`)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        size = st.st_size
        if size < self.offset or st.st_ino != self.inode:  # replaced (a restarted trainer dropped steps): again
            self.offset, self.rows, self.inode = 0, [], st.st_ino
        if size == self.offset:
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read(size - self.offset)
        end = chunk.rfind(b"\n") + 1
        for line in chunk[:end].splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict):
                    self.rows.append(row)
        self.offset += end


def _json(path: Path) -> Any:
    """The JSON file's value; None when it is missing or not JSON (yet)."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())


def pid_alive(pid: Any) -> bool:
    """A pid from a file: a positive int of a live process (not a zombie)."""
    return isinstance(pid, int) and pid > 0 and procs.pid_alive(pid)


def is_live(run_dir: Path) -> bool:
    """The run's launcher still runs: pids.json names it, no result.json says it ended, and (where
    /proc tells) that pid is still a Python process, not a stranger that reused the number."""
    pid = (_json(run_dir / "pids.json") or {}).get("launcher")
    if (run_dir / "result.json").exists() or not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc here: the pid is all there is
    return b"python" in cmdline or b"asyncrl" in cmdline


def exit_state(code: int) -> str:
    """An exit code as the services table says it: "exited 0", "exited 3", or for a process a
    signal ended "exited on SIGTERM" (what the launcher sends at a run's end: uvicorn's servers,
    the engine's and the dashboard's, end on it again after their graceful shutdown)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"exited on {signal.Signals(-code).name}"
    return f"exited {code}"


def downsample(xs: list[float], ys: list[float], n: int = MAX_POINTS) -> tuple[list[float], list[float]]:
    """At most n points: the mean of each of n equal runs of the series."""
    if len(xs) <= n:
        return xs, ys
    bins = [(k * len(xs) // n, (k + 1) * len(xs) // n) for k in range(n)]
    return [sum(xs[lo:hi]) / (hi - lo) for lo, hi in bins], [sum(ys[lo:hi]) / (hi - lo) for lo, hi in bins]


def series(rows: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x, y) of every row holding a finite `key`, downsampled."""
    ok = [r for r in rows if isinstance(r.get(key), (int, float))
          and isinstance(r.get(x), (int, float)) and math.isfinite(r[key])]  # fmt: skip
    return downsample([float(r[x]) for r in ok], [float(r[key]) for r in ok])


class Partition:
    """One ledger and what is folded from it: the run's own, or (multi-LoRA) one adapter
    registration's, with its own trained.jsonl."""

    def __init__(self, trained_path: Path, subject: str | None = None, name: str = "", state: str = ""):
        self.name, self.state, self.subject = name, state, subject
        """`subject`: its ledger subject (None: the run's own, known once connected)."""
        self.trained = JsonLines(trained_path)
        self.auditor = Auditor()
        self.ledger_seq = 0
        self.prompt_events: dict[int, list[dict]] = collections.defaultdict(list)
        """Per prompt (group index): its ledger events, in order (the lineage view)."""
        self.step_staleness: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        """Per step: how many of its leased groups had each staleness."""
        self._audit: tuple | None = None

    async def read(self, bus, stream: str) -> None:
        """Everything its ledger got since the last read, in batches."""
        subject = self.subject or bus.subjects.ledger
        while batch := await bus.read_since(stream, subject, self.ledger_seq, READ_BATCH):
            for seq, data in batch:
                self.ledger_seq = seq
                for ev in self.auditor.read([(seq, data)]):
                    self.index(ev)
            await asyncio.sleep(0)

    def index(self, ev) -> None:
        if ev.kind == "leased" and ev.staleness is not None:
            self.step_staleness[ev.step][ev.staleness] += 1
        gi = prompt_of(ev)
        if gi >= 0:
            self.prompt_events[gi].append(lineage_entry(ev))

    def audit(self) -> dict:
        """The ledger's balance so far (recomputed only when the ledger or trained.jsonl grew)."""
        rows = self.trained.rows
        key = (self.auditor.state.seq, len(rows))
        if self._audit is None or self._audit[0] != key:
            st = self.auditor.state
            # a live run's trainer records a step as soon as it trains it; the ledger read so far may
            # not hold that step's whole lease yet (read a moment earlier): held against it once it does
            seen = {step for step, lease in st.leases.items() if lease.complete}
            trained = {int(r["step"]): list(r["groups"]) for r in rows if "step" in r and "groups" in r
                       and (int(r["step"]) <= st.committed_step or int(r["step"]) in seen)}  # fmt: skip
            self._audit = (key, self.auditor.report(trained_by_trainer=trained))
        return self._audit[1]


class RunData:
    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.config: dict = run_config(self.run_dir)
        self.metrics = JsonLines(self.run_dir / "metrics.jsonl")
        self.evals = JsonLines(self.run_dir / "eval.jsonl")
        self.restarts = JsonLines(self.run_dir / RESTARTS_FILE)
        self.main = Partition(self.run_dir / "trained.jsonl")
        self.partitions: dict[str, Partition] = {"": self.main}
        """The run's own ledger (""), and with multi-LoRA each adapter registration's ("name@rid")."""
        self.live_seq = 0
        self.live: list[dict] = []
        """weights.live, in order: version, at, and each engine's switch (paused_at, resumed_at)."""
        self.dead_seq = 0
        self.dead_letters: list[dict] = []
        self.streams_error: str | None = None
        self.served_live = False
        """Served as a live run's dashboard (--live: the launcher's, compose's, Kubernetes'), whose
        launcher may not be on this machine."""

    # ---- files ---------------------------------------------------------------------------------
    def refresh_files(self) -> None:
        for lines in (self.metrics, self.evals, self.restarts, *(part.trained for part in self.partitions.values())):
            lines.refresh()

    def part(self, key: str = "") -> Partition:
        """A partition by key; KeyError names the ones there are."""
        if key not in self.partitions:
            raise KeyError(f"no partition {key!r}: {sorted(self.partitions)}")
        return self.partitions[key]

    @property
    def capacity(self) -> int:
        """The buffer's capacity in groups (RunConfig.buffer_capacity, from the stored config)."""
        c = self.config
        return math.floor(c.get("async_data_buffer_capacity_factor", 1.0) * c.get("rollout_batch_size", 0))

    @property
    def run_id(self) -> str:
        return str(self.config.get("run_id", ""))

    def heldout_key(self) -> str | None:
        sets = self.config.get("eval_prompt_data") or []
        return f"eval/{sets[0]}" if sets else None

    def live_now(self) -> bool:
        """The run goes on: served as live (--live) and no result.json yet, or its launcher runs here."""
        return (self.served_live and not (self.run_dir / "result.json").exists()) or is_live(self.run_dir)

    def summary(self) -> dict:
        """The one-screen facts: progress, rewards, staleness, the buffer, the balance."""
        rows, evals, c = self.metrics.rows, self.evals.rows, self.config
        last = rows[-1] if rows else {}
        total = c.get("num_rollout")
        step = int(last["step"]) + 1 if "step" in last else 0
        eta = None
        if len(rows) >= 2 and total:
            dt = (rows[-1]["time"] - rows[0]["time"]) / max(1, len(rows) - 1)
            eta = max(0.0, dt * (total - step))
        key = self.heldout_key()
        heldout = [
            (e.get("step"), e.get(key)) for e in evals if key and e.get(key) is not None and not e.get("skipped")
        ]
        result = _json(self.run_dir / "result.json")
        live = self.live_now()
        diagnosis = diagnose(rows, c, live=live)
        return {
            "run_id": self.run_id,
            "mode": "sync" if c.get("driver") == "sync" else "fully_async" if c.get("fully_async") else "one_step",
            "live": live,
            "step": step,
            "total": total,
            "eta_s": eta,
            "reward": last.get("rollout/reward/mean"),
            "heldout": heldout[-1] if heldout else None,
            "heldout_first": heldout[0] if heldout else None,
            "staleness": last.get("rollout/fully_async/avg_staleness"),
            "queue": last.get("rollout/fully_async/queue_size"),
            "weight_version": last.get("weight_version"),
            "step_time_s": last.get("perf/step_time_s"),
            "finished": result is not None,
            "result": result,
            "diagnosis": diagnosis.line,
            "diagnosis_kind": diagnosis.kind,
            "length_warning": length_guard(rows, c),
        }

    def services(self) -> list[dict]:
        """Each process: its URL, pid, whether it runs, its restarts and their causes, and its
        `state`: running, how it ended (exit_state(): the exit code the launcher recorded for this
        pid in exits.json), else "not running" while the run goes on, "stopped" once it is over."""
        urls = _json(self.run_dir / "services.json") or {}
        pids = _json(self.run_dir / "pids.json") or {}
        exits = _json(self.run_dir / EXITS_FILE) or {}
        gone = "not running" if self.live_now() else "stopped"
        restarts = collections.Counter(r.get("name") for r in self.restarts.rows)
        last_restart = {r.get("name"): r for r in self.restarts.rows}
        out = []
        for name in sorted(set(urls) | set(pids)):
            url, pid = urls.get(name), pids.get(name)
            running = pid_alive(pid)
            end = exits.get(name) if isinstance(exits.get(name), dict) else {}
            code = end.get("code") if not running and pid is not None and end.get("pid") == pid else None
            out.append({
                "name": name, "url": url, "pid": pid, "running": running, "exit_code": code,
                "state": "running" if running else gone if code is None else exit_state(code),
                "metrics": f"{url}/metrics" if url else None,
                "restarts": restarts[name], "last_restart": last_restart.get(name),
            })  # fmt: skip
        return out

    def errors(self, n: int = 10) -> list[str]:
        """The last error lines of the services' logs (newest last), with the log's name."""
        found = []
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            try:
                with log.open("rb") as f:
                    f.seek(max(0, log.stat().st_size - 65536))
                    tail = f.read().decode(errors="replace").splitlines()
            except OSError:
                continue
            found += [(log.stat().st_mtime, i, f"{log.stem}: {line[:300]}") for i, line in enumerate(tail)
                      if ERROR_LINE.search(line)]  # fmt: skip
        return [x for _, _, x in sorted(found)[-n:]]

    def sample_steps(self, key: str = "") -> list[int]:
        """The steps with a sample record: the run's, or an adapter registration's (its directory)."""
        return sample_records.steps(self.part(key).trained.path.parent)

    def step_record(self, step: int, key: str = "") -> dict | None:
        return sample_records.read(self.part(key).trained.path.parent, step)

    # ---- streams -------------------------------------------------------------------------------
    async def refresh_streams(self, bus) -> None:
        """Read everything the ledger, weights.live and the dead letters got since the last
        refresh, in batches (the event loop serves pages between them)."""
        s = bus.subjects
        await self.main.read(bus, s.ledger_stream)
        if (reg := await bus.kv_get(ADAPTERS_KV_KEY, AdapterRegistryState)) is not None:
            for name, rid, state in registrations(reg, self.run_dir):  # multi-LoRA, as the audit reads them
                key = f"{name}@{rid[:12]}"
                if key not in self.partitions:
                    trained = self.run_dir / "adapters" / name / rid / "trained.jsonl"
                    self.partitions[key] = Partition(trained, s.of(rid).ledger, name, state)
                    self.partitions[key].trained.refresh()
                self.partitions[key].state = state
                await self.partitions[key].read(bus, s.ledger_stream)
        while batch := await bus.read_since(s.weights_stream, s.weights_live, self.live_seq, READ_BATCH):
            for seq, data in batch:
                self.live_seq = seq
                with contextlib.suppress(MalformedMessage):
                    w = decode(data, WeightsLive)
                    self.live.append({"version": w.version, "at": w.updated_at, "pause_s": w.pause_s,
                                      "switched": [{"engine": e.engine, "paused_at": e.paused_at,
                                                    "resumed_at": e.resumed_at} for e in w.switched]})  # fmt: skip
        while batch := await bus.read_since(s.deadletter_stream, s.deadletter_all, self.dead_seq, READ_BATCH):
            for seq, data in batch:
                self.dead_seq = seq
                with contextlib.suppress(MalformedMessage):
                    d = decode(data, DeadLetter)
                    self.dead_letters.append({"subject": d.original_subject, "reason": d.reason[:500],
                                              "service": d.service, "at": d.ts, "bytes": d.num_bytes})  # fmt: skip

    def lineage(self, group_index: int, key: str = "") -> dict:
        """A prompt's whole history: its ledger events (each attempt: released, put, leased,
        stale, expired, recycled), the step that trained it (if committed) and the restarts of
        the run's processes that fell between its first and last event."""
        part = self.part(key)
        events = list(part.prompt_events.get(group_index, []))
        committed = part.auditor.state.committed_step
        trained_at = [e["step"] for e in events if e["kind"] == "leased" and e.get("step", -1) <= committed]
        fate = part.auditor.fate(group_index)
        restarts = []
        if events:
            hi = time.time() if fate in (None, "in flight") else events[-1]["at"]
            restarts = [r for r in self.restarts.rows if events[0]["at"] <= r.get("at", 0) <= hi]
        return {"group_index": group_index, "fate": fate, "events": events,
                "trained_step": trained_at[-1] if trained_at and fate in ("trained", "failed") else None,
                "restarts": restarts}  # fmt: skip

    def version_timeline(self) -> dict:
        """Each engine's weight version against the trainer's, over wall-clock time, and the
        pause of each update."""
        engines: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
        pauses: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for w in self.live:
            for e in w["switched"]:
                engines[e["engine"]].append((e["resumed_at"], w["version"]))
                pauses[e["engine"]].append((e["paused_at"], e["resumed_at"]))
        trainer = [(r["time"], r["weight_version"]) for r in self.metrics.rows if "time" in r and "weight_version" in r]
        return {"engines": dict(engines), "pauses": dict(pauses), "trainer": trainer}


class StreamSource:
    """A connected Bus on the run's streams, opened on first use and reopened after an error: the live
    run's NATS server, or, for a finished run, a nats-server of its own on a copy of the run's store
    (the run's files are never written)."""

    def __init__(self, run_dir: Path, live: bool):
        cfg = run_config(run_dir)
        self.run_dir, self.live, self.url, self.run_id = run_dir, live, cfg.get("nats_url"), cfg["run_id"]
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
