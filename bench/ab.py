"""A/B benchmark: one fully async job in two variants, in alternating rounds, through the real CLI
(every service a process, real NATS), so that drift of the machine hits both variants alike.

A variant is extra CLI flags and/or environment variables. Per round and variant it records the
training loop's wall-clock (first batch request to last step), the trainer's mean wait for its
batch per step and its mean step time; it prints each round, the B/A ratio of the medians, and
the spread of the A runs among themselves (the noise a ratio must beat).

    python bench/ab.py --rounds 3 --steps 40 \\
        --a-name default --b-name "no inline" --b-env ASYNCRL_X=1 [--out docs/bench/ab.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOAD = ["train-async", "--fully-async", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
            "--async-data-buffer-capacity-factor", "1", "--skip-eval-before-train", "--seed", "1234",
            "--rollout-seed", "42"]  # fmt: skip


def run(steps: int, flags: list[str], env: dict[str, str], run_dir: Path) -> dict:
    argv = [sys.executable, "-m", "services.cli", *WORKLOAD, "--num-rollout", str(steps), *flags,
            "--run-dir", str(run_dir)]  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env})
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = records[1:]  # the first step waits for the first groups: not the steady state
    return {
        "loop_s": records[-1]["perf/elapsed_s"],
        "wait_ms": 1000 * statistics.mean(r["perf/rollout_wait_s"] for r in later),
        "step_ms": 1000 * statistics.mean(r["perf/step_time_s"] for r in later),
        "run_s": time.monotonic() - t0,
    }


def _env(pairs: list[str]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in pairs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    for v in ("a", "b"):
        p.add_argument(f"--{v}-name", default=v.upper())
        p.add_argument(f"--{v}-flags", default="", help="extra CLI flags, one string")
        p.add_argument(f"--{v}-env", action="append", default=[], help="KEY=VALUE (repeatable)")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    a = p.parse_args()
    variants = {
        "a": (a.a_name, a.a_flags.split(), _env(a.a_env)),
        "b": (a.b_name, a.b_flags.split(), _env(a.b_env)),
    }
    results: dict[str, list[dict]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            order = ("a", "b") if i % 2 == 0 else ("b", "a")  # alternate who goes first
            for v in order:
                name, flags, env = variants[v]
                r = run(a.steps, flags, env, Path(tmp) / f"{v}{i}")
                results[v].append(r)
                print(f"round {i + 1} {name:>14}: loop {r['loop_s']:6.1f} s, wait {r['wait_ms']:6.1f} ms/step, "
                      f"step {r['step_ms']:6.1f} ms", flush=True)  # fmt: skip

    def med(v: str, key: str) -> float:
        return statistics.median(r[key] for r in results[v])

    spread = (max(r["loop_s"] for r in results["a"]) - min(r["loop_s"] for r in results["a"])) / med("a", "loop_s")
    summary = {
        "steps": a.steps,
        "rounds": a.rounds,
        "a": {"name": a.a_name, "runs": results["a"]},
        "b": {"name": a.b_name, "runs": results["b"]},
        "loop_ratio_b_over_a": round(med("b", "loop_s") / med("a", "loop_s"), 3),
        "a_spread": round(spread, 3),
    }
    print(f"\nmedian loop: {a.a_name} {med('a', 'loop_s'):.1f} s, {a.b_name} {med('b', 'loop_s'):.1f} s; "
          f"ratio {a.b_name}/{a.a_name} {summary['loop_ratio_b_over_a']:.3f} "
          f"(the {a.a_name} runs differ among themselves by {100 * spread:.1f}%)")  # fmt: skip
    print(
        f"median wait per step: {med('a', 'wait_ms'):.1f} vs {med('b', 'wait_ms'):.1f} ms; "
        f"step time {med('a', 'step_ms'):.1f} vs {med('b', 'step_ms'):.1f} ms"
    )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
