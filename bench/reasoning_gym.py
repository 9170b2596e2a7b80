"""The reasoning-gym job learns within a wall-clock budget: deploy/configs/reasoning_gym.yaml
through the real CLI, one run per seed, each timed from its launch (the tiny model's build and
warm start, NATS and the services' start-up included).

Per seed it records the held-out reward at every eval point (the config's held-out scorer), the
seconds from launch to it, the share of held-out answers that ran to the length limit and their
mean length; it prints, per seed, the step-0 reward, the reward at the last eval point inside
--budget-s, the gain between them, the seconds to a gain of --target, and the truncated share at
the end. A run already in --record (same seed and extra arguments) is not run again.

    python bench/reasoning_gym.py [--seeds 1-3] [--budget-s 600] [--target 0.3]
                                  [--record docs/bench/reasoning_gym_runs.jsonl] [--report-only] [-- EXTRA CLI ARGS]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from learning import code_revision, load_record, seeds_of

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "deploy/configs/reasoning_gym.yaml"


def run_one(seed: int, extra: list[str], config: str, run_dir: Path) -> dict:
    """One run through the CLI; its held-out curve: (step, seconds from launch, reward, truncated
    share, mean answer tokens) at each eval point."""
    cmd = [sys.executable, "-m", "services.cli", "train-async", "--config", str(ROOT / config), "--seed", str(seed),
           "--rollout-seed", str(seed), "--run-dir", str(run_dir), *extra]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed} failed ({' '.join(cmd[3:])}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    name = json.loads((run_dir / "result.json").read_text())["heldout_dataset"]
    at = {rec["step"] + 1: rec["time"] - t0 for rec in recs}  # eval point k: after k steps (records count from 0)
    first = recs[0]["time"] - recs[0]["perf/elapsed_s"] - t0  # the training loop's start: step 0's eval is before it
    points = [{"step": e["step"], "s": round(at[e["step"]] if e["step"] else first, 1), "heldout": e[f"eval/{name}"],
               "truncated": e.get(f"eval/{name}-truncated_ratio"),
               "len": e.get(f"eval/{name}/response_len/mean")}
              for e in evals if f"eval/{name}" in e]  # fmt: skip
    return {"seed": seed, "extra": extra, "config": config, "dataset": name, "points": points,
            "loop_start_s": round(first, 1), "run_wall_s": round(wall, 1),
            "train_reward_last50": statistics.fmean(r["rollout/reward/mean"] for r in recs[-50:])}  # fmt: skip


def summarize(run: dict, budget_s: float, target: float) -> dict:
    pts = [p for p in run["points"] if p["s"] <= budget_s] or run["points"][:1]
    start, end = pts[0], pts[-1]
    reach = next((p["s"] for p in pts if p["heldout"] - start["heldout"] >= target), None)
    return {"seed": run["seed"], "step0": start["heldout"], "end": end["heldout"], "end_step": end["step"],
            "end_s": end["s"], "gain": end["heldout"] - start["heldout"], "s_to_target": reach,
            "truncated_end": end["truncated"], "len_end": end["len"]}  # fmt: skip


def table(rows: list[dict], budget_s: float, target: float) -> str:
    lines = [f"| seed | held-out step 0 | held-out at the last eval point within {budget_s:.0f} s (step, s) | gain | "
             f"s to +{target} | truncated at the end | mean answer tokens at the end |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        reach = f"{r['s_to_target']:.0f}" if r["s_to_target"] is not None else "not reached"
        lines.append(f"| {r['seed']} | {r['step0']:.3f} | {r['end']:.3f} ({r['end_step']}, {r['end_s']:.0f}) | "
                     f"{r['gain']:+.3f} | {reach} | {r['truncated_end']:.1%} | {r['len_end']:.2f} |")  # fmt: skip
    gains = [r["gain"] for r in rows]
    lines.append(f"\nmedian gain {statistics.median(gains):+.3f} (min {min(gains):+.3f}); {sum(g >= target for g in gains)}"
                 f" of {len(rows)} seeds gain at least +{target} within {budget_s:.0f} s")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", default="1-3")
    p.add_argument("--budget-s", type=float, default=600.0, help="wall-clock budget from launch")
    p.add_argument("--target", type=float, default=0.3, help="held-out gain to reach")
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--record", type=Path, default=ROOT / "docs/bench/reasoning_gym_runs.jsonl")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("extra", nargs="*", help="after --: more CLI arguments for every run")
    a = p.parse_args()
    seeds = seeds_of(a.seeds)
    settings = json.dumps(yaml.safe_load((ROOT / a.config).read_text()), sort_keys=True)
    sha = hashlib.sha256(settings.encode()).hexdigest()[:12]  # a record is of the settings the run had
    done = {(r["seed"], json.dumps(r["extra"]), r["config"], r.get("config_sha")) for r in load_record(a.record)}
    if not a.report_only:
        for seed in seeds:
            if (seed, json.dumps(a.extra), a.config, sha) in done:
                print(f"seed {seed}: already in {a.record}", flush=True)
                continue
            with tempfile.TemporaryDirectory(prefix="asyncrl-rg-") as tmp:
                res = run_one(seed, a.extra, a.config, Path(tmp) / "run")
            res["rev"], res["config_sha"] = code_revision(), sha
            a.record.parent.mkdir(parents=True, exist_ok=True)
            with a.record.open("a") as f:
                f.write(json.dumps(res) + "\n")
            s = summarize(res, a.budget_s, a.target)
            print(f"seed {seed}: step 0 {s['step0']:.3f} -> {s['end']:.3f} (gain {s['gain']:+.3f}) in "
                  f"{res['run_wall_s']:.0f} s", flush=True)  # fmt: skip
    runs = [
        r
        for r in load_record(a.record)
        if r["seed"] in seeds and r["extra"] == a.extra and r["config"] == a.config and r.get("config_sha") == sha
    ]
    if not runs:
        sys.exit(f"no run of {a.config} with these seeds and arguments in {a.record}")
    print(
        f"{a.config} {' '.join(a.extra)} (record {a.record.name}; {runs[0]['dataset']}, held-out scorer of the config)"
    )
    print(table([summarize(r, a.budget_s, a.target) for r in runs], a.budget_s, a.target))


if __name__ == "__main__":
    main()
