"""Reward graders' speed: services/rewards/graders.py called directly in this process,
and the reward hub (services/rewards/hub.py) through its worker processes.

  mix     gradings/s of `math` on an even mix of four answer kinds, half of each right and half
          wrong: `\\frac{a}{b}` against `\\frac{a}{b}`, `a.5` against `(2a+1)/2`, `x^2+a`
          against `x^2+a`, and integers; with each kind's mean and the slowest grading
  corpus  every case of the parity corpus (tests/unit/reward_parity_cases.py) graded once: the
          slowest, how many under 10 KB took more than 50 ms, and how many reached the hub's
          5 s bound (math-verify's own timeout)
  hub     samples/s through RewardHub with --in-flight samples awaited at once (the same mix),
          the graders in --workers worker processes

    python bench/rewards.py [--n 4000] [--hub-samples 5000] [--in-flight 128] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

from services.rewards import graders

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("frac", "half", "poly", "int")
SLOW_MS, SMALL_BYTES, TIMEOUT_S = 50.0, 10_000, 5.0


def mix_case(i: int, rng: random.Random) -> tuple[str, str, str]:
    """(kind, response, label) of the i-th grading: kinds in turn, right and wrong in turn."""
    kind, wrong = KINDS[i % 4], (i // 4) % 2
    a, b = rng.randint(1, 999_999), rng.randint(2, 999_999)
    if kind == "frac":
        return kind, f"so \\boxed{{\\frac{{{a}}}{{{b}}}}}", f"\\frac{{{a + wrong}}}{{{b}}}"
    if kind == "half":
        return kind, f"so \\boxed{{{a}.5}}", f"({2 * a + 1 + 2 * wrong})/2"
    if kind == "poly":
        return kind, f"so \\boxed{{x^2+{a}}}", f"x^2+{a + wrong}"
    return kind, f"so \\boxed{{{a}}}", str(a + wrong)


def _warm_up_as_a_worker() -> None:
    """graders.warm_up() as the hub's worker processes run it (they also freeze the loaded heap
    out of the garbage collector, which warm_up does only in a child process)."""
    graders.warm_up()
    gc.collect()
    gc.freeze()


def bench_mix(n: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    cases = [mix_case(i, rng) for i in range(n)]
    _warm_up_as_a_worker()
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    start = time.perf_counter()
    for kind, response, label in cases:
        t = time.perf_counter()
        graders.grade("math", False, response, label, {})
        times[kind].append(time.perf_counter() - t)
    total = time.perf_counter() - start
    every = [t for ts in times.values() for t in ts]
    return {"gradings": n, "seconds": total, "per_s": n / total,
            "mean_ms": {k: 1e3 * statistics.fmean(v) for k, v in times.items()},
            "p99_ms": 1e3 * sorted(every)[int(0.99 * (len(every) - 1))], "max_ms": 1e3 * max(every)}  # fmt: skip


def load_corpus() -> list:
    path = ROOT / "tests" / "unit" / "reward_parity_cases.py"
    if not path.exists():
        return []
    spec = importlib.util.spec_from_file_location("reward_parity_cases", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.CASES


def bench_corpus() -> dict:
    cases = load_corpus()
    _warm_up_as_a_worker()
    rows = []
    for c in cases:
        boxed, base = c.rm_type.startswith("boxed_"), c.rm_type.removeprefix("boxed_")
        t = time.perf_counter()
        try:
            graders.grade(base, boxed, c.response, c.label, dict(c.metadata))
        except Exception:  # noqa: BLE001 - a grader that raises still counts its time
            pass
        size = len(c.response.encode("utf-8", "replace")) + len(str(c.label).encode("utf-8", "replace"))
        rows.append((time.perf_counter() - t, size, c.cid))
    small = [r for r in rows if r[1] < SMALL_BYTES]
    slowest = sorted(rows, reverse=True)[:5]
    return {"cases": len(rows), "seconds": sum(r[0] for r in rows),
            "max_ms": 1e3 * max((r[0] for r in rows), default=0.0),
            "small_over_50ms": sum(r[0] * 1e3 > SLOW_MS for r in small),
            "at_timeout": sum(r[0] >= TIMEOUT_S for r in rows),
            "slowest": [(cid, round(1e3 * t, 1), size) for t, size, cid in slowest]}  # fmt: skip


async def _hub_run(n: int, in_flight: int, workers: int) -> dict:
    from asyncrl_proto.messages import Sample
    from services.common.config import RunConfig
    from services.rewards.hub import RewardHub, _pools

    config = RunConfig(rm_type="math", reward_num_workers=workers)
    hub = RewardHub(config, "math")
    rng = random.Random(1)
    samples = [Sample(prompt="p", response=r, label=label) for _, r, label in (mix_case(i, rng) for i in range(n))]
    gate = asyncio.Semaphore(in_flight)

    async def one(s):
        async with gate:
            return await hub(config, s)

    await asyncio.gather(*(one(s) for s in samples[: 4 * workers]))  # the workers started and warm
    start = time.perf_counter()
    await asyncio.gather(*(one(s) for s in samples))
    seconds = time.perf_counter() - start
    for pool in _pools.values():
        pool.close()
    return {"samples": n, "in_flight": in_flight, "workers": workers, "seconds": seconds, "per_s": n / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4000, help="gradings of the in-process mix")
    p.add_argument("--hub-samples", type=int, default=5000)
    p.add_argument("--in-flight", type=int, default=128)
    p.add_argument("--workers", type=int, default=2, help="--reward-num-workers of the hub")
    p.add_argument("--skip", nargs="*", default=[], choices=["mix", "corpus", "hub"])
    p.add_argument("--out", type=Path, help="also write the figures as JSON")
    a = p.parse_args()
    out = {}
    if "mix" not in a.skip:
        out["mix"] = m = bench_mix(a.n)
        means = "  ".join(f"{k} {v:.2f}" for k, v in m["mean_ms"].items())
        print(f"mix      {m['per_s']:8.0f} gradings/s ({m['gradings']} in {m['seconds']:.2f} s); mean ms: {means}; "
              f"p99 {m['p99_ms']:.2f} ms, max {m['max_ms']:.1f} ms")  # fmt: skip
    if "corpus" not in a.skip:
        out["corpus"] = c = bench_corpus()
        print(f"corpus   {c['cases']} cases in {c['seconds']:.2f} s; slowest {c['max_ms']:.1f} ms; "
              f"{c['small_over_50ms']} under 10 KB over 50 ms; {c['at_timeout']} at the 5 s bound")  # fmt: skip
        print(f"         slowest (id, ms, bytes): {c['slowest']}")
    if "hub" not in a.skip:
        out["hub"] = h = asyncio.run(_hub_run(a.hub_samples, a.in_flight, a.workers))
        print(f"hub      {h['per_s']:8.0f} samples/s ({h['samples']} samples, {h['in_flight']} in flight, "
              f"{h['workers']} workers, {h['seconds']:.2f} s)")  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
