"""Weight-sync benchmark: how long the engines stop generating per weight update, and how long an
update takes from the trainer's publish to live, per transfer mode and model size.

Everything on the path is real: an embedded nats-server with one user per role, a built-in
engine process (`python -m services.engine`) kept busy by concurrent /generate requests, the
weight-sync service process (`python -m services.weightsync`) that pauses, loads and continues
it, in object-store mode the run's NATS Object Store bucket with the engine's read-only
identity, and in distributed mode the trainer's WeightSender (rank 0 of a gloo group with the
engine, answering weight-sync on weights.transfer). This process plays the trainer: per update
it writes an HF snapshot (save_model), stores it in the bucket (object-store) or holds a copy of
the tensors (distributed), publishes WeightsPublished as the trainer role and waits for
weights.live.

  arms      disk, unstaged   the engine loads inside the pause (as an SGLang server does:
                             --disable-staged-weight-loading)
            disk             staged: loaded beside the running weights while generating, swapped in the pause
            object-store     staged, fetched from the bucket (no shared disk)
            distributed, unstaged  broadcast from the trainer inside the pause (as to an SGLang server)
            distributed      staged: broadcast while generating, swapped in the pause
  pause     the longest time an engine spent paused per update (weight-sync's pause call to
            the continue's answer; weights.live carries it): p50 and p99 over the updates
  live      publish to weights.live (the trainer's own part before it, the object-store upload or the
            distributed copy and digest, is printed apart as "trainer")
  ideal     the pause with nothing to load: pause, flush, continue on the same busy engine, measured
            before each cell's updates (not one of the runs being judged)

Arms and sizes alternate in rounds (forward, then backward); the spread of the p50 between rounds
is printed beside it.

    python bench/weight_sync.py [--sizes tiny,25m] [--updates 20] [--rounds 2] [--load 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
from bench_models import SIZES, build_models  # bench/ is the script's folder

from asyncrl_proto import WeightsLive, WeightsPublished, decode
from services.common import procs
from services.common.bus import Bus
from services.common.config import RunConfig
from services.common.natsauth import ROLES, server_auth_conf
from services.common.natsserver import EmbeddedNats
from services.common.secrets import NatsCredentials, new_secret
from services.common.sglang_client import SGLangClient
from services.common.versions import publish_weights
from services.weights.store import WeightStore

ARMS = ("disk, unstaged", "disk", "object-store", "distributed, unstaged", "distributed")


async def keep_busy(url: str, token: str, n: int, stop: asyncio.Event) -> None:
    """n closed-loop clients generating 32 tokens each, until `stop`."""
    body = {"input_ids": [1, 5, 6, 7, 8], "sampling_params": {"max_new_tokens": 32, "temperature": 1.0}}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:

        async def client():
            while not stop.is_set():
                try:
                    async with http.post(f"{url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
                        await r.read()
                except (aiohttp.ClientError, TimeoutError):
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(client() for _ in range(n)))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def cell(arm: str, size: str, model: Path, a, tmp: Path) -> dict:
    """One arm on one model size: a fresh broker, engine and weight-sync; a.updates updates."""
    import torch

    from services.model.hf_io import load_model, save_model

    run_id = "ws" + uuid.uuid4().hex[:8]
    run_dir = tmp / run_id
    (run_dir / "logs").mkdir(parents=True)
    passwords = {r: new_secret() for r in ROLES}
    token = new_secret()
    mode = arm.split(",")[0]
    srv = EmbeddedNats(run_dir / "nats", auth_conf=server_auth_conf(run_id, passwords)).start()
    children, stop = [], asyncio.Event()

    def env(role: str) -> dict:
        return {**os.environ, "ASYNCRL_NATS_USER": role, "ASYNCRL_NATS_PASSWORD": passwords[role],
                "ASYNCRL_RUN_TOKEN": token, "OMP_NUM_THREADS": "1"}  # fmt: skip

    creds = lambda role: NatsCredentials(user=role, password=passwords[role])  # noqa: E731
    admin = await Bus.connect(srv.url, run_id, "launcher", creds=creds("admin"))
    trainer = await Bus.connect(srv.url, run_id, "trainer", creds=creds("trainer"))
    load = None
    try:
        port = procs.free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "services.engine", "--model-path", str(model), "--port", str(port),
               "--weight-version", "0", "--torch-num-threads", "1"]  # fmt: skip
        if arm.endswith("unstaged"):
            cmd.append("--disable-staged-weight-loading")
        if mode == "object-store":
            cmd += ["--nats-url", srv.url, "--run-id", run_id, "--weights-cache-dir", str(run_dir / "cache")]
        children.append(procs.spawn(cmd, log_path=run_dir / "logs" / "engine.log", env=env("engine")))
        procs.wait_for_port("127.0.0.1", port, 120, children[-1])
        cfg = RunConfig(prompt_data=str(a.data), rollout_engine_urls=[url], run_id=run_id,
                        run_dir=str(run_dir), hf_checkpoint=str(model), num_rollout=10**6, fully_async=True,
                        update_weight_transfer_mode=mode, update_weight_master_address="127.0.0.1")  # fmt: skip
        await admin.ensure_streams()
        await admin.ensure_consumers(cfg.async_.prompt_ack_wait_s)
        await admin.kv_put("config", json.dumps(cfg.model_dump(mode="json")).encode())
        load = asyncio.ensure_future(keep_busy(url, token, a.load, stop))

        # the ideal: a pause with nothing to load, on the same busy engine
        client = SGLangClient([url], api_key=token)
        ideal = []
        for _ in range(a.updates):
            t0 = time.perf_counter()
            await client.pause(url, "retract")
            await client.flush_cache_within(url, 60.0)
            await client.continue_generation(url)
            ideal.append(time.perf_counter() - t0)
        await client.close()

        lives: asyncio.Queue = asyncio.Queue()

        async def on_live(msg):
            await lives.put((time.perf_counter(), decode(msg.data, WeightsLive)))

        await admin.subscribe(admin.subjects.weights_live, on_live)
        children.append(procs.spawn([sys.executable, "-m", "services.weightsync", "--nats-url", srv.url, "--run-id",
                                     run_id], log_path=run_dir / "logs" / "weight-sync.log", env=env("weight-sync")))  # fmt: skip
        while True:  # weight-sync announces the engines' version (0) when it starts
            _, live = await asyncio.wait_for(lives.get(), 120)
            if live.version == 0:
                break
        store = WeightStore(trainer, chunk_size=cfg.async_.update_weight_buffer_size) if mode == "object-store" else None
        weights = load_model(model)
        sender = None
        if mode == "distributed":
            from services.trainer.transfer import WeightSender

            sender = WeightSender(weights, run_dir / "weights", "127.0.0.1", "gloo")
            await trainer.subscribe(trainer.subjects.weights_transfer, sender.on_request)
        pauses, to_live, uploads = [], [], []
        for v in range(1, a.updates + 1):
            with torch.no_grad():
                next(weights.parameters()).add_(0.01)  # new weights each version
            path = run_dir / "weights" / f"v{v}"
            info = await asyncio.to_thread(save_model, weights, path, model)
            uri, tensor_sha = str(path.resolve()), ""
            t0 = time.perf_counter()
            if store is not None:
                await store.upload(v, path)
                uploads.append(time.perf_counter() - t0)
                uri = store.uri(v)
            if sender is not None:
                tensor_sha = await asyncio.to_thread(sender.hold, v)
                uploads.append(time.perf_counter() - t0)
            t_pub = time.perf_counter()
            await publish_weights(trainer, WeightsPublished(version=v, step=v - 1, uri=uri, sha256=info["sha256"],
                                                           num_bytes=info["num_bytes"], created_at=time.time(),
                                                           tensor_sha256=tensor_sha))  # fmt: skip
            while True:
                t_live, live = await asyncio.wait_for(lives.get(), 300)
                if live.version == v:
                    break
            to_live.append(t_live - t_pub)
            pauses.append(live.pause_s)
            for c in children:
                if c.poll() is not None:
                    raise RuntimeError(f"{c.args[:4]} exited with {c.returncode}; see {run_dir / 'logs'}")
        return {"arm": arm, "size": size, "pause_p50": pct(pauses, 0.5), "pause_p99": pct(pauses, 0.99),
                "live_p50": pct(to_live, 0.5), "live_p99": pct(to_live, 0.99),
                "upload_p50": pct(uploads, 0.5) if uploads else None, "ideal_p50": pct(ideal, 0.5),
                "ideal_p99": pct(ideal, 0.99), "pauses": pauses}  # fmt: skip
    finally:
        stop.set()
        for c in reversed(children):
            procs.stop(c)
        if load is not None:
            await asyncio.wait_for(asyncio.gather(load, return_exceptions=True), 150)
        await trainer.close()
        await admin.close()
        srv.stop()


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.mean(xs) if len(xs) > 1 and statistics.mean(xs) else 0.0


async def run(a) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-weightsync-"))
    sizes = a.sizes.split(",")
    models = build_models(tmp / "models", sizes)
    from services.tasks.reverse_digits import write_datasets

    a.data, _ = write_datasets(tmp / "data")
    cells = [(arm, size) for size in sizes for arm in ARMS]
    results: dict[tuple[str, str], list[dict]] = {c: [] for c in cells}
    for r in range(a.rounds):
        for arm, size in cells if r % 2 == 0 else list(reversed(cells)):
            res = await cell(arm, size, models[size], a, tmp)
            results[(arm, size)].append(res)
            print(f"  round {r + 1}, {size:>5} {arm:<21} pause p50 {res['pause_p50'] * 1e3:7.1f} ms  "
                  f"p99 {res['pause_p99'] * 1e3:7.1f} ms  live p50 {res['live_p50'] * 1e3:7.1f} ms", flush=True)  # fmt: skip
    rows = []
    for (arm, size), rs in results.items():
        pauses = [p for x in rs for p in x["pauses"]]
        row = {"arm": arm, "size": size, "updates": len(pauses), "pause_p50": pct(pauses, 0.5),
               "pause_p99": pct(pauses, 0.99), "pause_p50_spread": spread([x["pause_p50"] for x in rs]),
               "live_p50": statistics.mean(x["live_p50"] for x in rs), "live_p99": max(x["live_p99"] for x in rs),
               "ideal_p50": statistics.mean(x["ideal_p50"] for x in rs),
               "ideal_p99": max(x["ideal_p99"] for x in rs)}  # fmt: skip
        if rs[0]["upload_p50"] is not None:
            row["upload_p50"] = statistics.mean(x["upload_p50"] for x in rs)
        rows.append(row)
    return {"rows": rows, "settings": {"updates": a.updates, "rounds": a.rounds, "load": a.load,
                                       "cpus": os.cpu_count()}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,25m", help=f"model sizes, of {', '.join(SIZES)}")
    p.add_argument("--updates", type=int, default=20, help="weight updates per arm, size and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--load", type=int, default=8, help="concurrent /generate clients keeping the engine busy")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    out = asyncio.run(run(a))
    print(f"\n{'size':>5} {'arm':<21} {'pause p50':>10} {'spread':>7} {'p99':>9} {'ideal p50':>10} {'ideal p99':>10}"
          f" {'live p50':>9} {'live p99':>9} {'trainer p50':>11}")  # fmt: skip
    ms = lambda x: f"{x * 1e3:.1f} ms"  # noqa: E731
    for r in out["rows"]:
        up = ms(r["upload_p50"]) if "upload_p50" in r else "-"
        print(f"{r['size']:>5} {r['arm']:<21} {ms(r['pause_p50']):>10} {r['pause_p50_spread']:>6.0%} "
              f"{ms(r['pause_p99']):>9} {ms(r['ideal_p50']):>10} {ms(r['ideal_p99']):>10} {ms(r['live_p50']):>9} "
              f"{ms(r['live_p99']):>9} {up:>11}")  # fmt: skip
    by = {(r["arm"], r["size"]): r for r in out["rows"]}
    for size in a.sizes.split(","):
        for mode in ("disk", "distributed"):
            base, staged = by.get((f"{mode}, unstaged", size)), by.get((mode, size))
            if base and staged and staged["pause_p99"] > 0:
                print(f"{size} {mode}: staging cuts the p99 pause {base['pause_p99'] / staged['pause_p99']:.1f}x "
                      f"({ms(base['pause_p99'])} -> {ms(staged['pause_p99'])})")  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
