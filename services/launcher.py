"""The single-machine launcher behind `asyncrl train` / `asyncrl train-async`.

Prepares the run (task data, tiny model, run directory), starts an embedded nats-server unless
--nats-url is given, the engines, and every service as its own OS process; writes the resolved
config to the run's KV bucket; shows one progress line per training step; and on completion,
on a failed child or on Ctrl-C stops every process it started, by PID, in reverse order.
Outputs in the run directory: config.json, pids.json, services.json, metrics.jsonl (trainer),
eval.jsonl (eval), result.json (held-out reward at step 0 and at the end), logs/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from asyncrl_proto import EvalRequest, EvalResult, ProgressRecord, decode
from asyncrl_proto.codec import DecodeError
from asyncrl_proto.subjects import check_run_id
from services.common import procs
from services.common.config import RunConfig
from services.common.natsserver import EmbeddedNats
from services.common.snapshot import is_complete
from services.engine.commands import builtin_engine_command, builtin_engine_flags, sglang_server_command

SERVICE_MODULES = {
    "buffer": "services.buffer",
    "weight-sync": "services.weightsync",
    "eval": "services.eval",
    "rollout": "services.rollout",
    "trainer": "services.trainer",
}
FINAL_EVAL_TIMEOUT_S = 300.0


class LaunchError(RuntimeError):
    pass


def default_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]


def prepare_run(config: RunConfig, log=print) -> RunConfig:
    """Resolve run id and directory, write the task's data and build its model when needed."""
    run_id = check_run_id(config.run_id or default_run_id())
    run_dir = Path(config.run_dir or Path("runs") / run_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    updates: dict = {"run_id": run_id, "run_dir": str(run_dir)}
    for field in ("save", "save_hf", "load", "eval_hf_dir", "prompt_data"):  # services may run elsewhere
        if getattr(config, field):
            updates[field] = str(Path(getattr(config, field)).resolve())
    if config.task == "reverse-digits" and (config.prompt_data is None or not config.eval_prompt_data):
        from services.tasks import reverse_digits

        train, held_out = reverse_digits.write_datasets(run_dir / "data", seed=config.rollout_seed)
        if config.prompt_data is None:
            updates["prompt_data"] = str(train)
        if not config.eval_prompt_data:
            updates["eval_prompt_data"] = [reverse_digits.NAME, str(held_out)]
    if config.num_rollout is None and config.num_epoch is not None:
        data = updates.get("prompt_data", config.prompt_data)
        rows = sum(1 for line in Path(data).read_text().splitlines() if line.strip())
        updates["num_rollout"] = max(1, math.ceil(config.num_epoch * rows / config.rollout_batch_size))
        log(f"--num-epoch {config.num_epoch}: {rows} prompts per epoch -> {updates['num_rollout']} steps")
    if config.hf_checkpoint is None:
        from services.tasks import reverse_digits

        model_dir = run_dir / "model" / "initial"
        if not (model_dir / ".complete").exists():
            reverse_digits.build_model(model_dir, seed=config.seed, warmup_sft_steps=config.warmup_sft_steps, log=log)
        updates["hf_checkpoint"] = str(model_dir)
    else:
        updates["hf_checkpoint"] = str(Path(config.hf_checkpoint).resolve())
    return config.model_copy(update=updates)


async def publish_run_config(config: RunConfig) -> None:
    """Create the run's streams and write its resolved config to KV, for services started
    elsewhere (docker compose, Kubernetes, Ray) with `asyncrl service NAME`."""
    from services.common.bus import Bus

    bus = await Bus.connect(config.nats_url, config.run_id, "init-run", connect_timeout_s=120)
    try:
        await bus.ensure_streams()
        await bus.kv_put("config", json.dumps(config.model_dump(mode="json")).encode())
    finally:
        await bus.close()


def init_run(config: RunConfig, log=print) -> RunConfig:
    if not config.nats_url:
        raise LaunchError("init-run needs --nats-url: the services it prepares for read their config from NATS")
    if not config.rollout_engine_urls and not config.rollout_external_engine_addrs:
        raise LaunchError(
            "init-run needs --rollout-engine-urls (or --rollout-external-engine-addrs): where the engines listen"
        )
    config = prepare_run(config, log=log)
    if not config.rollout_engine_urls:
        from services.common.sglang_client import normalize_url

        config = config.model_copy(
            update={"rollout_engine_urls": [normalize_url(a) for a in config.rollout_external_engine_addrs]}
        )
    (Path(config.run_dir) / "config.json").write_text(json.dumps(config.model_dump(mode="json"), indent=2))
    asyncio.run(publish_run_config(config))
    log(f"run {config.run_id} prepared in {config.run_dir}; config published to {config.nats_url}")
    return config


def sglang_engine_commands(c: RunConfig, ports: list[int]) -> list[tuple[list[str], dict]]:
    """One `sglang.launch_server` command per engine: the checkpoint, a port, version 0,
    metrics on, its own slice of GPUs, then every --sglang-<flag> of the run."""
    out, g = [], c.rollout_num_gpus_per_engine
    extra = list(c.sglang_server_args)
    for i, port in enumerate(ports):
        args = ["--weight-version", "0"]
        if not {"--tp-size", "--tp"} & {a.split("=")[0] for a in extra}:
            args += ["--tp-size", str(g)]
        cmd = sglang_server_command(c.hf_checkpoint, port, c.seed + i, args + extra)
        out.append((cmd, {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in range(i * g, (i + 1) * g))}))
    return out


class Child:
    def __init__(self, name: str, cmd: list[str], env: dict, proc: subprocess.Popen):
        self.name, self.cmd, self.env, self.proc = name, cmd, env, proc
        self.restarts = 0


class Launcher:
    def __init__(self, config: RunConfig, out=print):
        self.config = config
        self.out = out
        self.run_dir = Path(config.run_dir)
        self.children: list[Child] = []
        self.nats_restarts = 0
        self.router_url: str | None = None
        self.services: dict[str, str] = {}
        self.nats: EmbeddedNats | None = None
        self.nats_url = config.nats_url
        self.evals: dict[int, EvalResult] = {}
        self.done: ProgressRecord | None = None
        self.t0 = time.time()

    # ---- start -----------------------------------------------------------------------------
    def _env(self) -> dict:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", str(self.config.torch_num_threads))
        return env

    def _spawn(self, name: str, cmd: list[str], extra_env: dict | None = None) -> subprocess.Popen:
        env = {**self._env(), **(extra_env or {})}
        proc = procs.spawn(cmd, log_path=self.run_dir / "logs" / f"{name}.log", env=env)
        self.children.append(Child(name, cmd, env, proc))
        self._write_pids()
        return proc

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def _write_pids(self) -> None:
        pids = {c.name: c.proc.pid for c in self.children}
        if self.nats and self.nats.proc:
            pids["nats-server"] = self.nats.proc.pid
        pids["launcher"] = os.getpid()
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=2))

    def start_nats(self) -> None:
        if self.nats_url:
            return
        self.nats = EmbeddedNats(self.run_dir / "nats", log_path=self.run_dir / "logs" / "nats-server.log").start()
        self.nats_url = self.nats.url
        self._write_pids()

    def start_engines(self) -> list[str]:
        """The engines' URLs: attached (--rollout-external-engine-addrs), or launched here -
        built-in engines, or SGLang servers with every --sglang-<flag> passed through."""
        c = self.config
        if c.rollout_external_engine_addrs:
            from services.common.sglang_client import normalize_url

            return [normalize_url(a) for a in c.rollout_external_engine_addrs]
        if c.engine == "sglang":
            return self._start_sglang()
        urls = []
        pins = procs.split_cpus(c.rollout_num_engines) if c.pin_cpus else None
        for i in range(c.rollout_num_engines):
            port = procs.free_port()
            cmd = builtin_engine_command(c.hf_checkpoint, port, builtin_engine_flags(c, c.seed + i))
            self._spawn(f"engine-{i}", cmd, extra_env={procs.CPU_ENV: pins[0][i]} if pins else None)
            urls.append(f"http://127.0.0.1:{port}")
            self.services[f"engine-{i}"] = urls[-1]
        return urls

    def _start_sglang(self) -> list[str]:
        import importlib.util

        c = self.config
        if importlib.util.find_spec("sglang") is None:
            raise LaunchError(
                "--engine sglang needs SGLang installed (pip install 'sglang[all]') on a machine with GPUs; "
                "or attach to running servers with --rollout-external-engine-addrs HOST:PORT ..."
            )
        urls = []
        for i, (cmd, env) in enumerate(
            sglang_engine_commands(c, [procs.free_port() for _ in range(c.rollout_num_engines)])
        ):
            self._spawn(f"engine-{i}", cmd, extra_env=env)
            urls.append(f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}")
            self.services[f"engine-{i}"] = urls[-1]
        if c.use_sglang_router:
            if importlib.util.find_spec("sglang_router") is None:
                raise LaunchError("--use-sglang-router needs the sglang-router package (pip install sglang-router)")
            port = procs.free_port()
            self._spawn("router", [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                   "--port", str(port), "--worker-urls", *urls, *c.sglang_router_args])  # fmt: skip
            self.router_url = f"http://127.0.0.1:{port}"
            self.services["router"] = self.router_url
        return urls

    def start_service(self, name: str, instance: str | None = None) -> None:
        port = procs.free_port()
        label = instance or name
        pins = procs.split_cpus(self.config.rollout_num_engines) if self.config.pin_cpus and name == "trainer" else None
        self._spawn(label, [
            sys.executable, "-m", SERVICE_MODULES[name], "--nats-url", self.nats_url, "--run-id",
            self.config.run_id, "--http-port", str(port), "--instance-id", label,
        ], extra_env={procs.CPU_ENV: pins[1]} if pins else None)  # fmt: skip
        self.services[label] = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout_s: float | None = None) -> None:
        if timeout_s is None:  # an SGLang server loads and captures CUDA graphs: minutes, not seconds
            timeout_s = 900.0 if self.config.engine == "sglang" else 180.0
        deadline = time.monotonic() + timeout_s
        pending = dict(self.services)
        with httpx.Client(timeout=2.0) as http:
            while pending:
                self.check_children()
                for label, url in list(pending.items()):
                    path = {"engine": "/health_generate", "router": "/health"}.get(label.split("-")[0], "/readyz")
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get(url + path).status_code == 200:
                            del pending[label]
                if pending and time.monotonic() > deadline:
                    raise LaunchError(f"not ready after {timeout_s:.0f}s: {sorted(pending)} (see {self.run_dir}/logs)")
                if pending:
                    time.sleep(0.1)

    def check_children(self, allow_exit: tuple[str, ...] = ()) -> None:
        """Restart a crashed child (same command, same ports) up to --service-restarts times;
        a child that keeps crashing fails the run with its last log lines."""
        if self.nats and self.nats.proc and self.nats.proc.poll() is not None:
            self._restart_nats()
        for c in self.children:
            code = c.proc.poll()
            if code is None or (c.name in allow_exit and code == 0):
                continue
            tail = _tail(self.run_dir / "logs" / f"{c.name}.log")
            if c.restarts >= self.config.service_restarts:
                raise LaunchError(f"{c.name} (pid {c.proc.pid}) exited with code {code}; last log lines:\n{tail}")
            c.restarts += 1
            self.out(
                f"  {c.name} (pid {c.proc.pid}) exited with code {code}; "
                f"restarting ({c.restarts}/{self.config.service_restarts})"
            )
            c.proc = procs.spawn(c.cmd, log_path=self.run_dir / "logs" / f"{c.name}.log", env=c.env)
            self._write_pids()

    def _restart_nats(self) -> None:
        self.nats_restarts += 1
        if self.nats_restarts > self.config.service_restarts:
            raise LaunchError(f"nats-server exited {self.nats_restarts} times; see {self.run_dir}/logs/nats-server.log")
        self.out(f"  nats-server exited with code {self.nats.proc.returncode}; restarting on the same store")
        self.nats.start()
        self._write_pids()

    # ---- run -------------------------------------------------------------------------------
    async def run(self) -> dict:
        c = self.config
        self.start_nats()
        urls = self.start_engines()
        self.config = c = c.model_copy(
            update={"rollout_engine_urls": urls, "nats_url": self.nats_url, "rollout_router_url": self.router_url}
        )
        (self.run_dir / "config.json").write_text(json.dumps(c.model_dump(mode="json"), indent=2))
        from services.common.bus import Bus

        bus = await Bus.connect(self.nats_url, c.run_id, "launcher")
        try:
            await bus.ensure_streams()
            await bus.kv_put("config", json.dumps(c.model_dump(mode="json")).encode())
            await asyncio.to_thread(self.wait_ready)  # engines first: every service talks to them
            await bus.nc.subscribe(bus.subjects.progress, cb=self._on_progress)
            await bus.nc.subscribe(bus.subjects.eval_results, cb=self._on_eval)
            for name in ("buffer", "weight-sync", "eval"):
                self.start_service(name)
            for i in range(c.rollout_num_producers):
                self.start_service("rollout", f"rollout-{i}")
            self.start_service("trainer")
            await asyncio.to_thread(self.wait_ready)
            self._print_services()
            await self._watch(bus)
            if c.mode == "sync" and c.total_steps not in self.evals:
                await bus.publish(
                    bus.subjects.eval_requests,
                    EvalRequest(
                        step=c.total_steps,
                        version=self._final_version(),
                        final=True,
                        snapshot_uri=self._final_snapshot(),
                        requested_at=time.time(),
                    ),  # fmt: skip
                )
            await self._wait_final_eval()
        finally:
            await bus.close()
        return self.summary()

    def _final_version(self) -> int:
        return int(self.done.record.get("weight_version", 0)) if self.done else 0

    def _final_snapshot(self) -> str:
        """The final weights as an HF snapshot, for the snapshot eval backends: the last step's
        --save-hf checkpoint, else the last pushed version, else (nothing pushed) the initial
        checkpoint; "" when the final weights are nowhere complete (the point is skipped)."""
        c = self.config
        saved = Path(c.save_hf) / f"step_{c.total_steps}" if c.save_hf else None
        if saved is not None and is_complete(saved):
            return str(saved)
        version = self._final_version()
        if version == 0:
            return c.hf_checkpoint
        pushed = self.run_dir / "weights" / f"v{version}"
        return str(pushed.resolve()) if is_complete(pushed) else ""

    async def _watch(self, bus) -> None:
        while self.done is None:
            self.check_children(allow_exit=("trainer",))
            if self.child("trainer").proc.poll() == 0 and self.done is None:
                await self._read_final_progress(bus)  # finished while we were cut off from NATS?
                if self.done is None:
                    raise LaunchError("the trainer exited without its final record; see logs/trainer.log")
            await asyncio.sleep(0.2)
        if self.done.error:
            raise LaunchError(f"trainer failed: {self.done.error}")

    async def _read_final_progress(self, bus) -> None:
        import nats.js.errors

        with contextlib.suppress(nats.js.errors.NotFoundError):
            raw = await bus.js.get_last_msg(bus.subjects.progress_stream, bus.subjects.progress)
            rec = decode(raw.data, ProgressRecord)
            if rec.done:
                self.done = rec

    async def _wait_final_eval(self) -> None:
        deadline = time.monotonic() + FINAL_EVAL_TIMEOUT_S
        while self.config.total_steps not in self.evals:
            self.check_children(allow_exit=("trainer",))
            if time.monotonic() > deadline:
                raise LaunchError(f"the final evaluation did not finish within {FINAL_EVAL_TIMEOUT_S:.0f}s")
            await asyncio.sleep(0.2)

    async def _on_progress(self, msg) -> None:
        with contextlib.suppress(*DecodeError):
            rec = decode(msg.data, ProgressRecord)
            if rec.done:
                self.done = rec
            else:
                self.out(format_progress(rec.step, self.config.total_steps, rec.record))

    async def _on_eval(self, msg) -> None:
        with contextlib.suppress(*DecodeError):
            res = decode(msg.data, EvalResult)
            self.evals[res.step] = res
            main = {k: v for k, v in res.metrics.items() if k.count("/") == 1 and not k.startswith("eval/duration")}
            shown = ", ".join(f"{k} {v:.3f}" for k, v in main.items() if k != "eval/step")
            self.out(f"  eval @ step {res.step} (weights v{res.version}): {shown} [{res.duration_s:.1f}s]")

    def _print_services(self) -> None:
        self.out(f"run {self.config.run_id} in {self.run_dir}")
        self.out(f"  nats: {self.nats_url}")
        for label, url in self.services.items():
            pid = self.child(label).proc.pid
            self.out(f"  {label:<12} pid {pid:<7} {url}")
        (self.run_dir / "services.json").write_text(json.dumps(self.services, indent=2))

    def summary(self) -> dict:
        key = f"eval/{self.config.eval_prompt_data[0]}" if self.config.eval_prompt_data else None
        first = self.evals.get(0)
        last = self.evals.get(self.config.total_steps)
        r0 = first.metrics.get(key) if first and key else None
        r1 = last.metrics.get(key) if last and key else None
        result = {
            "run_id": self.config.run_id,
            "mode": self.config.mode,
            "steps": self.config.total_steps,
            "wall_s": time.time() - self.t0,
            "final_weight_version": self._final_version(),
            "heldout_dataset": self.config.eval_prompt_data[0] if self.config.eval_prompt_data else None,
            "heldout_reward_step0": r0,
            "heldout_reward_final": r1,
            "heldout_reward_gain": (r1 - r0) if r0 is not None and r1 is not None else None,
            "evals": {str(k): v.metrics for k, v in sorted(self.evals.items())},
        }
        (self.run_dir / "result.json").write_text(json.dumps(result, indent=2))
        return result

    # ---- stop --------------------------------------------------------------------------------
    def stop_services(self) -> None:
        for c in reversed(self.children):
            procs.stop(c.proc, timeout_s=15.0)

    def shutdown(self) -> None:
        self.stop_services()
        if self.nats:
            self.nats.stop()


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


def format_progress(step: int, total: int, rec: dict) -> str:
    def f(key, fmt="{:.3f}", default="-"):
        v = rec.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else default

    return (
        f"[step {step + 1:>4}/{total}] reward {f('rollout/reward/mean')}"
        f" | staleness avg {f('rollout/fully_async/avg_staleness', '{:.2f}')} max {f('rollout/fully_async/max_staleness', '{:.0f}')}"
        f" | queue {f('rollout/fully_async/queue_size', '{:.0f}')}"
        f" | v{rec.get('weight_version', '-')}"
        f" | {f('perf/step_time_s', '{:.2f}')}s/step (wait {f('perf/rollout_wait_s', '{:.2f}')}s, train {f('perf/train_time_s', '{:.2f}')}s)"
    )


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def launch(config: RunConfig, out=print) -> dict:
    """Run a whole job; returns the summary. Every started process is stopped on every path.
    After training, with the services stopped and the broker still up, the ledger is audited
    (RUN_DIR/audit.json)."""
    config = prepare_run(config, log=out)
    launcher = Launcher(config, out=out)
    old_term = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the run the way Ctrl-C does
    try:
        result = asyncio.run(launcher.run())
        launcher.stop_services()
        from services.audit import collect

        report = asyncio.run(collect(launcher.nats_url, launcher.config.run_id, launcher.run_dir))
        (launcher.run_dir / "audit.json").write_text(json.dumps(report, indent=2))
        result["ledger_balanced"] = report["balanced"]
        out(
            f"ledger: {report['released_prompts']} prompts released, {report['trained']} trained once, "
            f"{sum(report['filtered'].values())} filtered, {report['aborted_dropped'] + report['stale_dropped']} dropped, "
            f"{sum(report['in_flight_at_end'].values())} in flight at the end, {report['lost']} lost, "
            f"{report['trained_twice']} trained twice ({'balanced' if report['balanced'] else 'NOT balanced'}; asyncrl audit {launcher.run_dir})"
        )
    finally:
        launcher.shutdown()
        signal.signal(signal.SIGTERM, old_term)
    return result
