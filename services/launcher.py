"""The single-machine launcher behind `asyncrl train` / `asyncrl train-async`.

Prepares the run (task data, tiny model, run directory), starts an embedded nats-server unless
--nats-url is given, the engines, and every service as its own OS process; writes the resolved
config to the run's KV bucket; shows one progress line per training step; and on completion,
on a failed child or on Ctrl-C stops every process it started, by PID, in reverse order.
Outputs in the run directory: config.json, pids.json, exits.json, services.json, metrics.jsonl,
eval.jsonl (eval), result.json (held-out reward at step 0 and at the end), audit.json, logs/, and
secrets/ (mode 0700): the run token and, for the embedded server, one NATS identity per role.

Trust: the embedded nats-server gets one user per service role with exactly its subjects
(services.common.natsauth); every child gets its own identity and the run token through its
environment, never its command line; the HTTP routes of every service and engine need the run
token. A child that stays unhealthy is restarted like one that exited (services.supervisor).
A run fails (non-zero exit) when the trainer reports an error, when too many samples FAILED, or
when the ledger does not balance at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx

from asyncrl_proto import EvalRequest, EvalResult, ProgressRecord, WeightsLive, decode
from asyncrl_proto.codec import MalformedMessage
from services.buffer.state import ledger_counts
from services.common import procs
from services.common.bus import STORE_DIR_ENV, Bus
from services.common.config import RunConfig
from services.common.engine_commands import builtin_engine_command, builtin_engine_flags, sglang_server_command
from services.common.httpauth import HTTP_ROLES, HTTP_TOKEN_ENV, Keys, engine_token
from services.common.natsserver import EmbeddedNats, NatsCluster, local_nats
from services.common.run_store import num
from services.common.schedule import is_eval_point
from services.common.secrets import RM_TOKEN_ENV, NatsCredentials, without_identity
from services.common.snapshot import COMPLETE_MARKER, is_complete, numbered
from services.common.validate import EvalPoints, eval_result_problem, finite_metrics
from services.common.versions import VersionBound
from services.prepare import Prepared, create_streams, prepare_launch
from services.raycluster import Placement
from services.supervisor import LaunchError, Supervisor

FINAL_EVAL_TIMEOUT_S = 300.0


def sglang_engine_commands(c: RunConfig, ports: list[int]) -> list[tuple[list[str], dict]]:
    """One `sglang.launch_server` command per engine: the checkpoint, a port, version 0,
    metrics on, its own slice of GPUs, then every --sglang-<flag> of the run."""
    g, extra = c.infra.rollout_num_gpus_per_engine, c.infra.sglang_server_args
    tp = [] if {"--tp-size", "--tp"} & {a.split("=")[0] for a in extra} else ["--tp-size", str(g)]
    args = ["--weight-version", "0", *tp, *extra]
    return [(sglang_server_command(c.data.hf_checkpoint, port, c.data.seed + i, args),
             {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in range(i * g, (i + 1) * g))})
            for i, port in enumerate(ports)]  # fmt: skip


class Launcher:
    def __init__(self, prepared: Prepared, out=print, progress=None):
        """out(line): every line the run prints; progress(step, total, record, held-out): each
        step's progress (services/console.py), a line formatted by format_progress without it."""
        self.config = config = prepared.config
        self.out = out
        self.progress = progress or (lambda step, total, rec, heldout: out(format_progress(step, total, rec)))
        self.heldout: float | None = None
        """The last held-out reward (the first set's mean): the progress line shows it."""
        self.run_dir = Path(config.infra.run_dir)
        self.run_token = prepared.run_token
        self.creds: dict[str, NatsCredentials] = prepared.creds
        self.nats_auth = prepared.nats_auth
        self.procs = Supervisor(self.run_dir, config.infra.service_restarts, config.infra.health_restart_s, out,
                                headers={"Authorization": f"Bearer {self.run_token}"}, secrets=[self.run_token],
                                restart_window_s=config.infra.restart_window_s,
                                before_restart=self._restart_command)  # fmt: skip
        self.live_version = 0  # the engines' version (weights.live): a restarted engine starts on it
        self.published: VersionBound | None = None  # the newest version the trainer published (set with the bus)
        self.nats_restarts: dict[int, list[float]] = {}  # per node: a rolling restart is one restart each
        self.router_url: str | None = None
        self.services: dict[str, str] = {}
        self.nats: EmbeddedNats | NatsCluster | None = None
        self.nats_url = config.infra.nats_url
        self.evals: dict[int, EvalResult] = {}
        self.eval_points = EvalPoints()
        """The points the trainer requested (read on the EVAL stream's request subject): only their results count."""
        self.done: ProgressRecord | None = None
        self.multi_lora = config.multi_lora.n_adapters > 0
        """Multi-LoRA: the run ends when the trainer says every adapter is completed."""
        self.engines_paused: list[str] = []
        self.placement: Placement | None = None
        """--use-ray: where engines, producers and the trainer run (services/raycluster.py)."""
        self.t0 = time.time()

    # ---- start -----------------------------------------------------------------------------
    def _env(self, role: str | None = None) -> dict:
        """A child's environment: ours without any NATS identity or token of our own, plus the
        run's HTTP keys (hashes: who may call it) and, for a service, its role's NATS identity and
        HTTP token (never on its command line). No child gets the run token."""
        env = without_identity()
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", str(self.config.infra.torch_num_threads))
        env.update(Keys.of_run(self.run_token).env())
        if role in ("rollout", "eval") and os.environ.get(RM_TOKEN_ENV):  # the roles that score samples
            env[RM_TOKEN_ENV] = os.environ[RM_TOKEN_ENV]
        if role in HTTP_ROLES:  # the roles that call the engines
            env[HTTP_TOKEN_ENV] = engine_token(self.run_token, role, self.config.infra.engines_take_one_key)
        if role is not None:
            env.update(self.creds[role].env())
            if self.nats is not None:
                env[STORE_DIR_ENV] = str(self.nats.jetstream_dir)
        return env

    def _spawn(self, name: str, cmd: list[str], url: str, health: str, role: str | None = None,
               extra_env: dict | None = None, essential: bool = True) -> None:  # fmt: skip
        """Start child `name`, listening at `url` (services.json) and health-checked at url + `health`."""
        env = {**self._env(role), **(extra_env or {})}
        self.procs.spawn(name, cmd, env, health_url=url + health, essential=essential)
        self.services[name] = url

    def _address(self, name: str, side: str) -> tuple[str, int]:
        """Where a child binds: with --use-ray its host's node IP and a free port there (`side`:
        trainer or rollout), else 127.0.0.1. Its command is the same either way (_placed)."""
        return self.placement.host(name, side) if self.placement else ("127.0.0.1", procs.free_port())

    def _placed(self, name: str, cmd: list[str]) -> list[str]:
        return self.placement.wrap(name, cmd) if self.placement and name in self.placement.children else cmd

    def start_nats(self) -> None:
        """The embedded NATS server (or cluster), unless the run uses --nats-url's."""
        if self.nats_auth is None:
            return
        infra = self.config.infra
        self.nats = local_nats(self.run_dir / "nats", self.run_dir / "logs", self.nats_auth,
                               nodes=infra.nats_cluster, run_id=infra.run_id, max_file_store=infra.nats_max_file_store,
                               sync_interval=infra.nats_sync).start()  # fmt: skip
        self.nats_url = self.nats.url
        self.procs.extra_pids |= {self.nats.pid_name(i): node.proc.pid for i, node in enumerate(self.nats.nodes)}
        self.procs.write_pids()
        nodes = {self.nats.pid_name(i): {"url": n.url, "monitor": f"http://127.0.0.1:{n.http_port}" if n.http_port else None}
                 for i, n in enumerate(self.nats.nodes)}  # fmt: skip
        (self.run_dir / "nats" / "nodes.json").write_text(json.dumps(nodes, indent=2))

    def start_engines(self) -> list[str]:
        """The engines' URLs: attached (--rollout-external-engine-addrs), or launched here -
        built-in engines, or SGLang servers with every --sglang-<flag> passed through."""
        c = self.config
        if c.infra.rollout_external_engine_addrs:
            from services.common.sglang_client import normalize_url

            return [normalize_url(a) for a in c.infra.rollout_external_engine_addrs]
        if c.infra.engine == "sglang":
            return self._start_sglang()
        pins = procs.split_cpus(c.infra.rollout_num_engines) if c.infra.pin_cpus and not self.placement else None
        for i in range(c.infra.rollout_num_engines):
            host, port = self._address(f"engine-{i}", "rollout")
            lora = (c.multi_lora.n_adapters, c.multi_lora.max_rank)
            flags = builtin_engine_flags(c, c.data.seed + i, f"engine-{i}", lora)
            flags |= {"--host": host} if self.placement else {}
            role = "engine" if c.engines_read_bucket else None
            if role:  # it fetches weights or adapters with a read-only identity
                flags |= {"--nats-url": self.nats_url, "--run-id": c.infra.run_id,
                          "--weights-cache-dir": str(self.run_dir / "engine-cache" / f"engine-{i}")}  # fmt: skip
            cmd = self._placed(f"engine-{i}", builtin_engine_command(c.data.hf_checkpoint, port, flags))
            self._spawn(f"engine-{i}", cmd, f"http://{host}:{port}", "/health_generate", role=role,
                        extra_env={procs.CPU_ENV: pins[0][i]} if pins else None)  # fmt: skip
        return [self.services[f"engine-{i}"] for i in range(c.infra.rollout_num_engines)]

    def _start_sglang(self) -> list[str]:
        import importlib.util

        c = self.config
        if importlib.util.find_spec("sglang") is None:
            raise LaunchError(
                "--engine sglang needs SGLang installed (pip install 'sglang[all]') on a machine with GPUs; "
                "or attach to running servers with --rollout-external-engine-addrs HOST:PORT ..."
            )
        # SGLang takes its API key only on its command line (documented in the README)
        key = ["--api-key", self.run_token]
        ports = [procs.free_port() for _ in range(c.infra.rollout_num_engines)]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for i, (cmd, env) in enumerate(sglang_engine_commands(c, ports)):
            self._spawn(f"engine-{i}", cmd + key, urls[i], "/health", extra_env=env)
        if c.infra.use_sglang_router:
            if importlib.util.find_spec("sglang_router") is None:
                raise LaunchError("--use-sglang-router needs the sglang-router package (pip install sglang-router)")
            port = procs.free_port()
            self.router_url = f"http://127.0.0.1:{port}"
            self._spawn("router", [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                   "--port", str(port), "--worker-urls", *urls, *c.infra.sglang_router_args, *key],
                        self.router_url, "/health")  # fmt: skip
        return urls

    def start_service(self, name: str, instance: str | None = None) -> None:
        label = instance or name
        placed = self.placement is not None and name in ("rollout", "trainer")  # the rest stay with the launcher
        host, port = self._address(label, name) if placed else ("127.0.0.1", procs.free_port())
        infra = self.config.infra
        pins = procs.split_cpus(infra.rollout_num_engines) if infra.pin_cpus and name == "trainer" else None
        self._spawn(label, self._placed(label, [
            sys.executable, "-m", f"services.{name.replace('-', '')}", "--nats-url", self.nats_url, "--run-id",
            self.config.infra.run_id, "--http-host", host, "--http-port", str(port), "--instance-id", label,
        ]), f"http://{host}:{port}", "/healthz", role=name,
            extra_env={procs.CPU_ENV: pins[1]} if pins and not placed else None)  # fmt: skip

    def start_dashboard(self) -> None:
        """The run's dashboard (services/dashboard): read-only, behind the run token, with the admin's
        NATS identity to read the ledger, weights.live and the dead letters."""
        infra = self.config.infra
        if not infra.dashboard:
            return
        port = infra.dashboard_port or procs.free_port()
        url = f"http://{'127.0.0.1' if infra.http_host in ('0.0.0.0', '::') else infra.http_host}:{port}"
        self._spawn("dashboard", [sys.executable, "-m", "services.dashboard", str(self.run_dir), "--live",
                                  "--http-host", infra.http_host, "--http-port", str(port)],
                    url, "/healthz", extra_env=self.creds["admin"].env(), essential=False)  # fmt: skip

    def wait_ready(self) -> None:
        # an SGLang server loads and captures CUDA graphs: minutes, not seconds
        timeout_s = 900.0 if self.config.infra.engine == "sglang" else 180.0
        deadline = time.monotonic() + timeout_s
        pending = dict(self.services)
        with httpx.Client(timeout=2.0, headers=self.procs.headers) as http:
            while pending:
                self.check_children()
                pending = {x: u for x, u in pending.items() if not self.procs.child(x).given_up}  # the run goes on
                for label, url in list(pending.items()):
                    path = {"engine": "/health_generate", "router": "/health"}.get(label.split("-")[0], "/readyz")
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get(url + path).status_code == 200:
                            del pending[label]
                            self.procs.child(label).healthy_once = True
                if pending and time.monotonic() > deadline:
                    raise LaunchError(f"not ready after {timeout_s:.0f}s: {sorted(pending)} (see {self.run_dir}/logs)")
                if pending:
                    time.sleep(0.1)

    def check_children(self, allow_exit: tuple[str, ...] = ()) -> None:
        """Restart a crashed child (same command, same ports) or nats-server, up to
        --service-restarts times; a child that keeps crashing fails the run with its last log lines."""
        for i, node in enumerate(self.nats.nodes if self.nats else []):
            if node.proc and node.proc.poll() is not None:
                self._restart_nats(i, node)
        self.procs.check_exits(allow_exit)

    def _restart_nats(self, i: int, node: EmbeddedNats) -> None:
        """A nats-server node that exited comes back on its own store and ports (in a cluster it
        catches up with the others; clients moved to them meanwhile)."""
        name = self.nats.pid_name(i)
        if not self.procs.take_restart(self.nats_restarts.setdefault(i, [])):
            raise LaunchError(
                f"{name} exited {self.config.infra.service_restarts + 1} times in "
                f"{self.config.infra.restart_window_s:.0f}s; see {node.log_path}"
            )
        self.out(f"  {name} exited with code {node.proc.returncode}; restarting on the same store")
        node.start()
        self.procs.extra_pids[name] = node.proc.pid
        self.procs.write_pids()

    # ---- run -------------------------------------------------------------------------------
    async def run(self) -> dict:
        c = self.config
        self.start_nats()
        if c.trainer.use_ray:
            self.placement = Placement(c, self.run_dir)  # in the main thread: Ray's driver wants it
        urls = self.start_engines()
        self.config = c = c.model_copy(
            update={"rollout_engine_urls": urls, "nats_url": self.nats_url, "rollout_router_url": self.router_url}
        )
        (self.run_dir / "config.json").write_text(json.dumps(c.model_dump(mode="json"), indent=2))
        bus = await Bus.connect(self.nats_url, c.infra.run_id, "launcher", creds=self.creds["admin"])
        try:
            await create_streams(bus, c)
            await asyncio.to_thread(self.wait_ready)  # engines first: every service talks to them
            await bus.subscribe(bus.subjects.progress, self._on_progress)
            self.published = VersionBound(bus)
            await bus.subscribe(bus.subjects.weights_live, self._on_live)
            await bus.subscribe(bus.subjects.eval_requests, self._on_eval_request)
            await bus.subscribe(bus.subjects.eval_results, self._on_eval)
            for name in ("buffer", "weight-sync", "eval") + (("adapters",) if self.multi_lora else ()):
                self.start_service(name)
            for i in range(c.infra.rollout_num_producers):
                self.start_service("rollout", f"rollout-{i}")
            self.start_service("trainer")
            self.start_dashboard()
            await asyncio.to_thread(self.wait_ready)
            self._print_services()
            await self._watch(bus)
            await self._wait_last_eval()
            self.engines_paused = await asyncio.to_thread(self._paused_engines)
        finally:
            await bus.close()
        return self.summary()

    def _paused_engines(self) -> list[str]:
        """Built-in engines that are paused now (none should be at the end of a run)."""
        if self.config.infra.engine != "builtin" or self.config.infra.rollout_external_engine_addrs:
            return []
        paused = []
        with httpx.Client(timeout=5.0, headers=self.procs.headers) as http:
            for label, url in self.services.items():
                if label.startswith("engine-"):
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        if http.get(url + "/status").json().get("paused"):
                            paused.append(label)
        return paused

    async def _watch(self, bus) -> None:
        async with httpx.AsyncClient() as http:
            while self.done is None:
                self.check_children(allow_exit=("trainer",))
                await self.procs.check_health(http)
                if self.procs.child("trainer").proc.poll() == 0 and self.done is None:
                    await self._read_final_progress(bus)  # finished while we were cut off from NATS?
                    if self.done is None:
                        raise LaunchError("the trainer exited without its final record; see logs/trainer.log")
                await asyncio.sleep(0.2)
        if self.done.error:
            raise LaunchError(f"trainer failed: {self.done.error}")

    def _is_last(self, rec: ProgressRecord) -> bool:
        """The trainer's last record: done after the last step (multi-LoRA: every adapter completed)."""
        return rec.done and (rec.step == self.config.rollout.total_steps or self.multi_lora)

    async def _read_final_progress(self, bus) -> None:
        raw = await bus.get_last(bus.subjects.progress_stream, bus.subjects.progress)
        with contextlib.suppress(MalformedMessage):
            rec = decode(raw.data, ProgressRecord) if raw is not None else None
            if rec is not None and self._is_last(rec):
                self.done = rec

    async def _wait_last_eval(self) -> None:
        """Wait for the last eval point the trainer dispatched (none without --eval-interval)."""
        last = self.done.last_eval if self.done else None
        deadline = time.monotonic() + FINAL_EVAL_TIMEOUT_S
        while last is not None and last not in self.evals:
            self.check_children(allow_exit=("trainer",))
            if time.monotonic() > deadline:
                raise LaunchError(f"the final evaluation did not finish within {FINAL_EVAL_TIMEOUT_S:.0f}s")
            await asyncio.sleep(0.2)

    async def _on_live(self, msg) -> None:
        """The engines' version, for restarts: only a version the trainer published (a forged
        `weights.live` would otherwise make a restarted engine look for weights that never were)."""
        with contextlib.suppress(MalformedMessage):
            version = decode(msg.data, WeightsLive).version
            if version > self.live_version and await self.published.allows(version):
                self.live_version = version

    def _restart_command(self, child) -> list[str]:
        """An engine restarts on the newest weights the trainer pushed (the live ones or newer,
        never older), never its launch weights, which would serve samples many versions stale
        until the next push. The snapshot is hard-linked into weights/restart-<engine> first:
        the trainer keeps only its newest snapshots and may delete this one while the engine
        starts. The rest restart as they started."""
        if not child.name.startswith("engine-") or self.placement:  # placed: its node may not see weights/
            return child.launch_cmd
        weights = self.run_dir / "weights"
        versions = [v for v, _ in numbered(weights.glob("v*")) if v >= self.live_version > 0]
        for version in reversed(versions):
            stable = weights / f"restart-{child.name}"
            if link_snapshot(weights / f"v{version}", stable):
                cmd = list(child.launch_cmd)
                cmd[cmd.index("--model-path") + 1] = str(stable)
                cmd[cmd.index("--weight-version") + 1] = str(version)
                self.out(f"  {child.name} restarts on the weights v{version} (live: v{self.live_version})")
                return cmd
        # none to link (none pushed yet, or no hard links here): its launch weights, at version 0,
        # which weight-sync's convergence replaces with the live ones within seconds
        return child.launch_cmd

    async def _on_progress(self, msg) -> None:
        with contextlib.suppress(MalformedMessage):
            rec = decode(msg.data, ProgressRecord)
            if self._is_last(rec):
                self.done = rec
            elif not rec.done and self.multi_lora:  # adapter steps: each on its own axis
                name = rec.record.get("adapter", "")
                self.out(f"[{name} step {rec.record.get(f'{name}/step', '?')}] reward "
                         f"{rec.record.get(f'{name}/raw_reward_mean', float('nan')):.3f}")  # fmt: skip
            elif not rec.done and 0 <= rec.step < self.config.rollout.total_steps:
                self.progress(rec.step, self.config.rollout.total_steps, rec.record, self.heldout)

    async def _on_eval_request(self, msg) -> None:
        with contextlib.suppress(MalformedMessage):
            req = decode(msg.data, EvalRequest)
            self.eval_points.request(req.step, req.version)

    async def _on_eval(self, msg) -> None:
        with contextlib.suppress(MalformedMessage):
            res = decode(msg.data, EvalResult)
            c = self.config
            points = (c.rollout.total_steps, c.eval.interval, c.rollout.num_rollout_per_epoch, c.infra.mode)
            skipped = res.skipped_reason is not None
            if (eval_result_problem(res.step, c.rollout.total_steps)
                    or self.eval_points.launcher_problem(res.step, res.version, skipped,
                                                         lambda step: is_eval_point(step, *points))):  # fmt: skip
                return  # not a result for a point the trainer requested (the trainer dead-letters it)
            if skipped and res.step not in self.eval_points.requested:  # the trainer's own skip: no figures
                res.metrics = {k: v for k, v in res.metrics.items() if k.startswith("eval/skipped_") or k == "eval/step"}
            res.metrics = finite_metrics(res.metrics)[0]
            self.evals[res.step] = res
            main = {k: v for k, v in res.metrics.items() if k.count("/") == 1 and not k.startswith("eval/duration")}
            shown = ", ".join(f"{k} {v:.3f}" for k, v in main.items() if k != "eval/step")
            sets = self.config.eval.prompt_data
            if sets and res.skipped_reason is None and f"eval/{sets[0]}" in res.metrics:  # the first set's mean
                self.heldout = res.metrics[f"eval/{sets[0]}"]
            name = int(res.metrics.get("eval/step", res.step))
            self.out(
                f"  eval/step {name} (after {res.step} steps, weights v{res.version}): {shown} [{res.duration_s:.1f}s]"
            )

    def _print_services(self) -> None:
        self.out(f"run {self.config.infra.run_id} in {self.run_dir}")
        self.out(f"  nats: {self.nats_url}")
        for label, url in self.services.items():
            self.out(f"  {label:<12} pid {self.procs.child(label).proc.pid:<7} {url}")
        (self.run_dir / "services.json").write_text(json.dumps(self.services, indent=2))
        if "dashboard" in self.services:
            self.out(f"dashboard: {self.services['dashboard']}/ (log in with the run token, "
                     f"{self.run_dir / 'secrets' / 'run-token'}; `asyncrl status {self.run_dir}` in a terminal)")

    def summary(self) -> dict:
        key = f"eval/{self.config.eval.prompt_data[0]}" if self.config.eval.prompt_data else None
        first = self.evals.get(0)  # the baseline: no step trained
        last = self.evals[max(self.evals)] if self.evals else None  # the latest weights evaluated
        r0 = first.metrics.get(key) if first and key else None
        r1 = last.metrics.get(key) if last and key else None
        result = {
            "run_id": self.config.infra.run_id,
            "run_dir": str(self.run_dir),
            "mode": self.config.infra.mode,
            "steps": self.config.rollout.total_steps,
            "wall_s": time.time() - self.t0,
            "final_weight_version": int(self.done.record.get("weight_version", 0)) if self.done else 0,
            "heldout_dataset": self.config.eval.prompt_data[0] if self.config.eval.prompt_data else None,
            "heldout_reward_step0": r0,
            "heldout_reward_final": r1,
            "heldout_reward_final_after_steps": max(self.evals) if self.evals else None,
            "heldout_reward_gain": (r1 - r0) if r0 is not None and r1 is not None else None,
            "engines_paused_at_end": self.engines_paused,
            "evals": {str(k): v.metrics for k, v in sorted(self.evals.items())},  # keyed by steps trained before
        }
        (self.run_dir / "result.json").write_text(json.dumps(result, indent=2))
        return result

    # ---- stop --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.procs.stop_all()
        if self.placement:
            self.placement.close()
        if self.nats:
            self.nats.stop()
            self.procs.record_exits({self.nats.pid_name(i): n.proc for i, n in enumerate(self.nats.nodes)})


def link_snapshot(src: Path, dst: Path) -> bool:
    """Hard-link a complete snapshot's files into `dst` (replacing what was there): a copy that
    costs nothing and outlives the deletion of `src`. False if `src` is not (or no longer) whole."""
    shutil.rmtree(dst, ignore_errors=True)
    try:
        if not is_complete(src):
            return False
        shutil.copytree(src, dst, copy_function=os.link, ignore=shutil.ignore_patterns(COMPLETE_MARKER))
        # the marker last: a deletion removes it first (remove_snapshot), so linking it means
        # no deletion had begun when the files above were listed
        os.link(src / COMPLETE_MARKER, dst / COMPLETE_MARKER)
        return True
    except OSError:  # deleted meanwhile (or a filesystem without hard links)
        shutil.rmtree(dst, ignore_errors=True)
        return False


def format_progress(step: int, total: int, rec: dict) -> str:
    def f(key, fmt="{:.3f}"):
        return num(rec.get(key), fmt)

    return (
        f"[step {step + 1:>4}/{total}] reward {f('rollout/reward/mean')}"
        f" | staleness avg {f('rollout/fully_async/avg_staleness', '{:.2f}')} max {f('rollout/fully_async/max_staleness', '{:.0f}')}"
        f" | queue {f('rollout/fully_async/queue_size', '{:.0f}')}"
        f" | v{rec.get('weight_version', '-')}"
        f" | {f('perf/step_time_s', '{:.2f}')}s/step (wait {f('perf/rollout_wait_s', '{:.2f}')}s, train {f('perf/train_time_s', '{:.2f}')}s)"
    )


def ledger_line(r: dict) -> str:
    """ledger_counts as a line: "N prompts released, N trained once, N failed, ..., N trained twice"."""
    names = {"released": "prompts released", "trained": "trained once", "in_flight_at_end": "in flight at the end"}
    return ", ".join(f"{n} {names.get(k, k.replace('_', ' '))}" for k, n in ledger_counts(r).items())


def launch(config: RunConfig, out=print, progress=None) -> dict:
    """Run a whole job; returns the summary. Every started process is stopped on every path.
    After training, with the services stopped and the broker still up, the ledger is audited
    (RUN_DIR/audit.json)."""
    launcher = Launcher(prepare_launch(config, log=out), out=out, progress=progress)
    # SIGTERM stops the run the way Ctrl-C does, and so does SIGINT, even when a shell started this
    # run in the background (which ignores it); each one's handler before is put back at the end
    old = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        result = asyncio.run(launcher.run())
        launcher.procs.stop_all()
        from services.audit import collect

        report = asyncio.run(
            collect(launcher.nats_url, launcher.config.infra.run_id, launcher.run_dir, launcher.creds["admin"])
        )
        (launcher.run_dir / "audit.json").write_text(json.dumps(report, indent=2))
        # result.json again, now with the audit's answer: scripts read the same verdict the console shows
        result["ledger_balanced"] = report["balanced"]
        adapters = report.get("adapters")  # multi-LoRA: the ledger of every adapter registration
        result["ledger"] = (
            ledger_counts(report)
            if adapters is None
            else {name: ledger_counts(part) | {"balanced": part["balanced"]} for name, part in adapters.items()}
        )
        (launcher.run_dir / "result.json").write_text(json.dumps(result, indent=2))
        for name, part in (adapters or {}).items():
            out(f"ledger of adapter {name}: {ledger_line(part)} ({'balanced' if part['balanced'] else 'NOT balanced'})")
        if adapters is None:
            out(f"ledger: {ledger_line(report)} ({'balanced' if report['balanced'] else 'NOT balanced'}; "
                f"asyncrl audit {launcher.run_dir})")  # fmt: skip
        if not report["balanced"]:
            raise LaunchError(
                "the ledger does not balance:\n  "
                + "\n  ".join(report["problems"][:20])
                + f"\n(asyncrl audit {launcher.run_dir} prints it all)"
            )
    finally:
        launcher.shutdown()
        for s, handler in old.items():
            signal.signal(s, handler)
    return result
