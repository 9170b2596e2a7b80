"""Staleness sweep: what staleness costs on the quickstart task and what each off-policy
correction buys back, with intervals.

Cells: max staleness 0, 2 and 8 (`--max-weight-staleness K` with `--async-data-buffer-capacity-factor`
max(1, K): the buffer can hold that many steps of groups) x corrections
  none        --no-use-rollout-logprobs --no-use-tis (the ratio against the trainer's own log-probs)
  tis         --use-rollout-logprobs --use-tis (the ratio against the engine's, truncated IS)
  decoupled   --use-decoupled-ppo (AReaL's decoupled PPO: proximal clip, capped behaviour weight)
x at least 6 seeds, fully async, --steps each. Per cell: the mean final held-out reward with a 95%
bootstrap interval, the stall rate and the staleness the runs actually had. Runs go through
bench/learning.py's functions and into the same kind of record: each run is recorded as it
finishes and never run twice, so the sweep resumes across sessions. Writes a table (stdout,
--out JSON) and a PNG.

    python bench/staleness.py [--staleness 0,2,8] [--corrections none,tis,decoupled] [--seeds 1-6] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from learning import ROOT, add_common, load_record, run_all, seeds_of, summarize  # bench/ is the script's folder

CORRECTIONS = {
    "none": ["--no-use-rollout-logprobs", "--no-use-tis"],
    "tis": ["--use-rollout-logprobs", "--use-tis"],
    "decoupled": ["--use-decoupled-ppo"],
    # not in the default sweep: 4 optimizer steps per rollout (AReaL's minibatches), where the
    # proximal policy differs from the policy being trained from the second step on
    "tis-4mb": ["--use-rollout-logprobs", "--use-tis", "--num-steps-per-rollout", "4"],
    "decoupled-4mb": ["--use-decoupled-ppo", "--num-steps-per-rollout", "4"],
}


def cell_args(staleness: int, correction: str) -> list[str]:
    return ["--max-weight-staleness", str(staleness), "--async-data-buffer-capacity-factor", str(max(1, staleness)),
            *CORRECTIONS[correction]]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--staleness", default="0,2,8")
    p.add_argument("--corrections", default="none,tis,decoupled", help=f"of {', '.join(CORRECTIONS)}")
    p.add_argument("--record", default="docs/bench/staleness_runs.jsonl")
    p.add_argument("--out", default="docs/bench/staleness")
    add_common(p)
    p.set_defaults(seeds="1-6")
    a = p.parse_args()
    record = ROOT / a.record
    levels = [int(x) for x in a.staleness.split(",")]
    corrections = a.corrections.split(",")
    if unknown := set(corrections) - set(CORRECTIONS):
        raise SystemExit(f"unknown corrections {sorted(unknown)}: use {', '.join(CORRECTIONS)}")
    if not a.report_only:
        cells = [
            ("fully-async", seed, cell_args(k, c)) for seed in seeds_of(a.seeds) for k in levels for c in corrections
        ]
        run_all(cells, a, record)
    runs = load_record(record)
    rows = {}
    for k in levels:
        for c in corrections:
            mine = [r for r in runs if r.get("arm") == "fully-async" and r["steps"] == a.steps
                    and r["extra"] == cell_args(k, c)]  # fmt: skip
            if mine:
                rows[(k, c)] = summarize(mine, a.threshold, a.stall_gain)
                rows[(k, c)]["pg_clipfrac_mean"] = clipfrac(mine)
    print(f"\n{'max staleness':>13} {'correction':<10} {'n':>2} {'final reward (95% CI)':>26} {'stalls':>7} "
          f"{'staleness mean (max)':>21} {'clip fraction':>13}")  # fmt: skip
    for (k, c), s in rows.items():
        ci = f"{s['final_mean']:.3f} [{s['final_ci95'][0]:.3f}, {s['final_ci95'][1]:.3f}]"
        print(f"{k:>13} {c:<10} {s['n']:>2} {ci:>26} {s['stall_rate']:>6.0%} "
              f"{s['staleness_mean']:>14.2f} ({s['staleness_max']}) {s['pg_clipfrac_mean']:>13.3f}")  # fmt: skip
    out = ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"steps": a.steps, "cells": [{"max_staleness": k, "correction": c, **s} for (k, c), s in rows.items()]},
        indent=2) + "\n")  # fmt: skip
    if rows:
        plot(rows, levels, corrections, out.with_suffix(".png"))


def clipfrac(runs: list[dict]) -> float:
    """The mean over runs of each run's mean `train/pg_clipfrac` (its trace): how often the PPO clip
    bound a token's update, the trust region each correction has or lacks."""
    per_run = [statistics.mean(vals) for r in runs
               if (vals := [p["train/pg_clipfrac"] for p in r.get("trace", []) if "train/pg_clipfrac" in p])]  # fmt: skip
    return statistics.mean(per_run) if per_run else float("nan")


def plot(rows: dict, levels: list[int], corrections: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(corrections)
    for j, c in enumerate(corrections):
        xs, ys, errs = [], [], [[], []]
        for i, k in enumerate(levels):
            s = rows.get((k, c))
            if s is None:
                continue
            xs.append(i + (j - (len(corrections) - 1) / 2) * width)
            ys.append(s["final_mean"])
            errs[0].append(s["final_mean"] - s["final_ci95"][0])
            errs[1].append(s["final_ci95"][1] - s["final_mean"])
        ax.bar(xs, ys, width, yerr=errs, capsize=3, label=c)
    ax.set_xticks(range(len(levels)), [f"max staleness {k}" for k in levels])
    ax.set_ylabel("final held-out reward (95% CI)")
    ax.legend(title="correction")
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle("reverse-digits, tiny Llama, fully async: what staleness costs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
