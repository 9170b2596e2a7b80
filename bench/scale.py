"""Scaling benchmark: samples/s with 1, 2, 4 and 8 producer + engine pairs against the linear ideal.

Each engine is a stand-in (bench/standin_engine.py) that speaks the SGLang HTTP subset and spends
a modelled GPU time per token (a sleep, with a batch of --max-running decoding at once), so the
figure measures asyncrl's producers, buffer and broker, not this machine's two cores doing
matrix products. Everything else is real: an embedded nats-server, the buffer service and k
producer services (`python -m services.rollout`, the real processes), fully async, the
bundled task's prompts and tokenizer. The trainer is this process: it asks the buffer for each
step's B = 4k groups (answered once the lease is durable), reads them from ROLLOUTS and commits,
without training, so the trainer's CPU is not the bound either.

  ideal        k x one stand-in engine's own capacity, measured alone (a closed loop that keeps
               --max-running requests in flight; not one of the runs being judged)
  samples/s    committed samples per second over the window after a warm-up, per k
  groups/s     the same in groups: what the buffer puts, leases and commits with k producers
               publishing at once

k is measured in alternating rounds (1, 2, 4, 8, then 8, 4, 2, 1, ...); the spread between
rounds is printed beside each figure.

    python bench/scale.py [--pairs 1,2,4,8] [--rounds 2] [--seconds 15] [--out docs/bench/scale.json]
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
import nats.errors

from asyncrl_proto import BufferCommit, BufferCommitReply, BufferGetReply, BufferGetRequest, RolloutGroup, decode
from services.common import procs
from services.common.bus import Bus
from services.common.config import RunConfig
from services.common.natsserver import EmbeddedNats

N = 4  # samples per prompt
BENCH = Path(__file__).resolve().parent


def start_engines(k: int, a, vocab: int, logs: Path) -> tuple[list[str], list]:
    ports = [procs.free_port() for _ in range(k)]
    model = ["--ms-per-token", str(a.ms_per_token), "--max-running", str(a.max_running), "--vocab-size", str(vocab)]
    script = str(BENCH / "standin_engine.py")
    ps = [
        procs.spawn(
            [sys.executable, script, "--port", str(p), "--seed", str(i), *model], log_path=logs / f"standin-{p}.log"
        )
        for i, p in enumerate(ports)
    ]
    for p, proc in zip(ports, ps, strict=True):
        procs.wait_for_port("127.0.0.1", p, 30, proc)
    return [f"http://127.0.0.1:{p}" for p in ports], ps


async def engine_capacity(url: str, a, seconds: float) -> float:
    """One stand-in alone: --max-running requests always in flight, samples/s."""
    done, stop_at = 0, time.perf_counter() + seconds
    body = {"input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": a.response_len}, "return_logprob": True}
    async with aiohttp.ClientSession() as http:

        async def worker():
            nonlocal done
            while time.perf_counter() < stop_at:
                async with http.post(f"{url}/generate", json=body) as r:
                    await r.read()
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(a.max_running)))
        return done / (time.perf_counter() - t0)


async def measure(k: int, a, url: str, data: Path, model: Path, vocab: int, tmp: Path) -> dict:
    run_id = f"scale{k}x" + uuid.uuid4().hex[:6]
    run_dir = tmp / run_id
    (run_dir / "logs").mkdir(parents=True)
    B = 4 * k
    engines, engine_procs = start_engines(k, a, vocab, run_dir / "logs")
    cfg = RunConfig(prompt_data=str(data), rollout_batch_size=B, n_samples_per_prompt=N, fully_async=True,
                    async_data_buffer_capacity_factor=2.0, rollout_max_response_len=a.response_len,
                    async_max_concurrent_samples=a.max_running, rollout_engine_urls=engines, rollout_num_engines=k,
                    num_rollout=10**6, run_id=run_id, run_dir=str(run_dir), hf_checkpoint=str(model))  # fmt: skip
    bus = await Bus.connect(url, run_id, "bench")
    children = list(engine_procs)
    try:
        await bus.ensure_streams()
        await bus.ensure_consumers(cfg.async_.prompt_ack_wait_s)
        await bus.kv_put("config", json.dumps(cfg.model_dump(mode="json")).encode())
        children.append(procs.spawn([sys.executable, "-m", "services.buffer", "--nats-url", url, "--run-id", run_id],
                                    log_path=run_dir / "logs" / "buffer.log"))  # fmt: skip
        for i in range(k):
            children.append(procs.spawn([sys.executable, "-m", "services.rollout", "--nats-url", url, "--run-id",
                                         run_id, "--instance-id", f"rollout-{i}"],
                                        log_path=run_dir / "logs" / f"rollout-{i}.log"))  # fmt: skip
        s = bus.subjects
        step, commits, marks = 0, [], []  # marks: (time, committed samples so far)
        t_end = None
        samples = 0
        while t_end is None or time.perf_counter() < t_end:
            for c in children:
                if c.poll() is not None:
                    raise RuntimeError(f"{c.args[:4]} exited with {c.returncode}; see {run_dir / 'logs'}")
            try:
                reply = await bus.request(s.buffer_get, BufferGetRequest(step=step, count=B, wait_s=5.0),
                                          BufferGetReply, timeout=15)  # fmt: skip
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.1)  # the buffer is starting
                continue
            if not reply.complete:
                continue
            for ref in reply.refs:
                raw = ref.payload
                if raw is None:
                    raw = await bus.get_payload(s.rollouts_stream, ref.stream_seq)
                samples += len(decode(raw, RolloutGroup).samples)
            commits.append(asyncio.ensure_future(
                bus.request(s.buffer_commit, BufferCommit(step=step), BufferCommitReply, timeout=15)))  # fmt: skip
            step += 1
            marks.append((time.perf_counter(), samples))
            if t_end is None and step == a.warmup_steps:
                t_end = time.perf_counter() + a.seconds
                cpu0 = {c.pid: cpu_seconds(c.pid) for c in children}
        await asyncio.gather(*commits)
        cpu = {c.pid: cpu_seconds(c.pid) - cpu0[c.pid] for c in children}
    finally:
        for c in reversed(children):
            procs.stop(c)
        await bus.close()
    (t0, s0), (t1, s1) = marks[a.warmup_steps - 1], marks[-1]
    rate = (s1 - s0) / (t1 - t0)
    share = lambda ps: sum(cpu[p.pid] for p in ps) / (t1 - t0)  # noqa: E731  in cores
    return {"pairs": k, "samples_per_s": rate, "groups_per_s": rate / N, "steps": step,
            "cpu_cores": {"buffer": share(children[k : k + 1]), "producers": share(children[k + 1 :]),
                          "engines": share(children[:k])}}  # fmt: skip


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.mean(xs) if len(xs) > 1 and statistics.mean(xs) else 0.0


async def run(a) -> dict:
    from services.tasks.reverse_digits import build_model, write_datasets

    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-scale-"))
    data, _ = write_datasets(tmp / "data")
    model = tmp / "model"
    build_model(model, warmup_sft_steps=0, log=lambda *_: None)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    pairs = [int(x) for x in a.pairs.split(",")]
    with EmbeddedNats(tmp / "nats") as srv:
        urls, ps = start_engines(1, a, vocab, tmp)
        try:
            ideal_one = await engine_capacity(urls[0], a, min(10.0, a.seconds))
        finally:
            procs.stop(ps[0])
        print(f"one stand-in engine alone: {ideal_one:.1f} samples/s "
              f"({a.max_running} x {a.response_len} tokens x {a.ms_per_token:g} ms)", flush=True)  # fmt: skip
        results: dict[int, list[dict]] = {k: [] for k in pairs}
        for r in range(a.rounds):
            for k in pairs if r % 2 == 0 else list(reversed(pairs)):
                res = await measure(k, a, srv.url, data, model, vocab, tmp)
                results[k].append(res)
                print(f"  round {r + 1}, {k} pair(s): {res['samples_per_s']:.1f} samples/s "
                      f"(ideal {k * ideal_one:.1f})", flush=True)  # fmt: skip
    rows = []
    for k in pairs:
        rates = [x["samples_per_s"] for x in results[k]]
        cores = {role: statistics.mean(x["cpu_cores"][role] for x in results[k]) for role in results[k][0]["cpu_cores"]}
        rows.append({"pairs": k, "samples_per_s": statistics.mean(rates), "spread": spread(rates), "cpu_cores": cores,
                     "groups_per_s": statistics.mean(rates) / N, "ideal": k * ideal_one,
                     "of_ideal": statistics.mean(rates) / (k * ideal_one), "rounds": rates})  # fmt: skip
    return {"ideal_one_engine": ideal_one, "rows": rows,
            "settings": {"ms_per_token": a.ms_per_token, "max_running": a.max_running,
                         "response_len": a.response_len, "seconds": a.seconds, "rounds": a.rounds}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=15.0, help="measured window per run, after the warm-up")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--ms-per-token", type=float, default=20.0, help="the stand-in's modelled decode time per token")
    p.add_argument("--max-running", type=int, default=16, help="requests one stand-in decodes at once")
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    out = asyncio.run(run(a))
    print(f"\n{'pairs':>5} {'samples/s':>10} {'spread':>7} {'groups/s':>9} {'ideal':>8} {'of ideal':>9}"
          f"   CPU cores: buffer / producers / stand-ins (of {os.cpu_count()})")  # fmt: skip
    for r in out["rows"]:
        c = r["cpu_cores"]
        print(f"{r['pairs']:>5} {r['samples_per_s']:>10.1f} {r['spread']:>6.0%} {r['groups_per_s']:>9.1f} "
              f"{r['ideal']:>8.1f} {r['of_ideal']:>8.0%}   {c['buffer']:.2f} / {c['producers']:.2f} / {c['engines']:.2f}")  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
