"""Scheduler benchmark on a long-tail workload: how close each mode gets to the ideal bound.

The workload (services/tasks/longtail.py): trajectory lengths drawn from a Pareto distribution,
the same lengths for every mode. Measured in one invocation, through the real CLI:

  engine capacity    a closed loop that keeps the in-flight cap (--inflight-samples) busy on one
                     built-in engine with the same lengths: samples/s and tokens/s it can produce
  trainer capacity   B x n / (train time + weight push) per step, from the synchronous run
  ideal bound        min(engine capacity, trainer capacity), in samples/s
  each mode          trained samples/s over the training loop (steps 2..N), engine utilisation
                     (its useful tokens/s over the engine's capacity) and the fraction of the bound

Modes: fully async with `sample` granularity at each --sweep staleness bound (none: no bound),
fully async with `group` granularity, one-step async (`train-async --no-fully-async`: the next
batch generates while this one trains) and `train` (synchronous, group granularity).

    python bench/scheduler.py [--steps 30] [--inflight-samples 16] [--sweep none,1,2,4] [--out docs/bench/scheduler.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from services.common import procs
from services.tasks import longtail, reverse_digits

B, N = 8, 8


def workload_env(a) -> dict:
    return {
        "ASYNCRL_LONGTAIL_MIN": str(a.min_len),
        "ASYNCRL_LONGTAIL_MAX": str(a.max_len),
        "ASYNCRL_LONGTAIL_ALPHA": str(a.alpha),
    }


def longtail_body(i: int) -> dict:
    """Request i of the workload: a fixed prompt and services/tasks/longtail.py's length i."""
    return {"input_ids": [1, 5, 6, 7, 15],
            "sampling_params": {"max_new_tokens": longtail.response_length(i), "ignore_eos": True},
            "return_logprob": True}  # fmt: skip


async def _closed_loop(url: str, concurrency: int, seconds: float, first_index: int, body_of) -> dict:
    counter = iter(range(first_index, first_index + 10**9))
    done = {"samples": 0, "tokens": 0}
    stop_at = time.perf_counter() + seconds

    async with aiohttp.ClientSession() as http:

        async def worker():
            while time.perf_counter() < stop_at:
                async with http.post(f"{url}/generate", json=body_of(next(counter))) as r:
                    out = await r.json()
                if time.perf_counter() <= stop_at:
                    done["samples"] += 1
                    done["tokens"] += len(out["output_ids"])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = min(time.perf_counter(), stop_at) - t0
    return {"samples_per_s": done["samples"] / elapsed, "tokens_per_s": done["tokens"] / elapsed}


def engine_capacity(model: Path, tmp: Path, seconds: float, concurrency: int, pin: bool, body_of=longtail_body) -> dict:
    """A closed loop that keeps `concurrency` requests (`body_of(i)`) in flight on one built-in
    engine (on the engine's core of the runs, when pinned): its samples/s and tokens/s."""
    port = procs.free_port()
    pins = procs.split_cpus(1) if pin else None  # the engine's core in the runs below, when pinned
    env = {**os.environ, procs.CPU_ENV: pins[0][0]} if pins else os.environ.copy()
    proc = procs.spawn([sys.executable, "-m", "services.engine", "--model-path", str(model), "--port", str(port),
                        "--weight-version", "0"], log_path=tmp / "capacity-engine.log", env=env)  # fmt: skip
    try:
        procs.wait_for_port("127.0.0.1", port, 60, proc)
        asyncio.run(_closed_loop(f"http://127.0.0.1:{port}", concurrency, 2.0, 10**7, body_of))  # warm up
        return asyncio.run(_closed_loop(f"http://127.0.0.1:{port}", concurrency, seconds, 0, body_of))
    finally:
        procs.stop(proc)


def run_mode(name: str, argv: list[str], model: Path, tmp: Path, steps: int, pin: bool) -> list[dict]:
    run_dir = tmp / name
    cmd = [sys.executable, "-m", "services.cli", *argv, "--hf-checkpoint", str(model), "--num-rollout", str(steps),
           "--rollout-batch-size", str(B), "--n-samples-per-prompt", str(N), "--rollout-max-response-len", "512",
           "--async-data-buffer-capacity-factor", "1", "--skip-eval-before-train",
           "--custom-generate-function-path", "services.tasks.longtail.generate",
           "--custom-rm-path", "services.tasks.longtail.reward", "--run-dir", str(run_dir)]  # fmt: skip
    if pin:
        cmd.append("--pin-cpus")
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if r.returncode != 0:
        raise SystemExit(f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def loop_rate(recs: list[dict]) -> dict:
    """Samples and tokens per second over steps 2..N (the first step includes start-up)."""
    window = recs[1:]
    elapsed = recs[-1]["time"] - recs[0]["time"]
    samples = sum(r["rollout/num_samples"] for r in window)
    tokens = sum(r["rollout/num_samples"] * r["rollout/response_length/mean"] for r in window)
    return {"samples_per_s": samples / elapsed, "tokens_per_s": tokens / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--alpha", type=float, default=1.2)
    p.add_argument("--capacity-seconds", type=float, default=15.0)
    p.add_argument("--inflight-samples", type=int, default=16,
                   help="--async-max-concurrent-samples of the async modes: the in-flight cap the engine works with")  # fmt: skip
    p.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=True,
                   help="engine and trainer on separate cores (the runs' --pin-cpus)")  # fmt: skip
    p.add_argument("--sweep", default="none,1,2,4",
                   help="fully async's --max-weight-staleness values, sample granularity (none: no bound)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    os.environ.update(workload_env(a))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        reverse_digits.build_model(
            model, warmup_sft_steps=0, max_position_embeddings=a.max_len + 16, log=lambda *_: None
        )
        print(f"engine capacity with {a.inflight_samples} requests in flight ...", flush=True)
        engine = engine_capacity(model, tmp, a.capacity_seconds, a.inflight_samples, a.pin_cpus)
        cap = ["--async-max-concurrent-samples", str(a.inflight_samples)]
        fully = ["train-async", "--fully-async", *cap, "--rollout-submission-granularity"]
        modes = {}
        for s in a.sweep.split(","):
            bound = [] if s == "none" else ["--max-weight-staleness", s]
            modes["fully async, sample granularity" + ("" if s == "none" else f", staleness {s}")] = [
                *fully, "sample", *bound]
        modes["fully async, group granularity"] = [*fully, "group"]
        modes["one-step async"] = ["train-async", "--no-fully-async"]
        modes["train (synchronous)"] = ["train"]
        recs = {}
        for name, argv in modes.items():
            print(f"{name} ...", flush=True)
            recs[name] = run_mode(f"mode{len(recs)}", argv, model, tmp, a.steps, a.pin_cpus)
    sync = recs["train (synchronous)"][1:]
    train_s = sum(r["perf/train_time_s"] + r["perf/weight_push_s"] for r in sync) / len(sync)
    trainer = {"samples_per_s": B * N / train_s}
    ideal = min(engine["samples_per_s"], trainer["samples_per_s"])
    result = {
        "workload": {
            "B": B,
            "n": N,
            "min_len": a.min_len,
            "max_len": a.max_len,
            "alpha": a.alpha,
            "steps": a.steps,
            "inflight_samples": a.inflight_samples,
        },  # fmt: skip
        "engine_capacity": engine,
        "trainer_capacity": trainer,
        "ideal_samples_per_s": ideal,
        "bound_by": "engine" if engine["samples_per_s"] <= trainer["samples_per_s"] else "trainer",
        "modes": {},
    }
    print(f"\nengine capacity  {engine['samples_per_s']:7.1f} samples/s  {engine['tokens_per_s']:8.0f} tokens/s")
    print(f"trainer capacity {trainer['samples_per_s']:7.1f} samples/s")
    print(f"ideal bound      {ideal:7.1f} samples/s ({result['bound_by']}-bound)\n")
    print(f"{'mode':48}{'samples/s':>10}{'tokens/s':>10}{'engine util':>13}{'of ideal':>10}{'staleness':>11}")
    for name, rs in recs.items():
        rate = loop_rate(rs)
        stale = [r["rollout/fully_async/avg_staleness"] for r in rs if "rollout/fully_async/avg_staleness" in r]
        m = {**rate, "engine_utilisation": rate["tokens_per_s"] / engine["tokens_per_s"],
             "fraction_of_ideal": rate["samples_per_s"] / ideal,
             "staleness_mean": sum(stale) / len(stale) if stale else 0.0}  # fmt: skip
        result["modes"][name] = m
        print(f"{name:48}{m['samples_per_s']:>10.1f}{m['tokens_per_s']:>10.0f}{m['engine_utilisation']:>12.0%}"
              f"{m['fraction_of_ideal']:>10.0%}{m['staleness_mean']:>11.2f}")  # fmt: skip
    base = result["modes"]
    for name, m in base.items():
        if name.startswith("fully async, sample"):
            vs = {k: m["samples_per_s"] / base[k]["samples_per_s"] for k in ("one-step async", "train (synchronous)")}
            m["vs"] = vs
            print(f"{name}: x{vs['one-step async']:.2f} one-step's samples/s, x{vs['train (synchronous)']:.2f} sync's")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
