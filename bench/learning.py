"""Learning benchmark: the same task and step budget in `train`, `train-async` and
`train-async --fully-async`, held-out reward against steps and against wall-clock.

Every run trains the bundled task (the quickstart settings) for --steps steps with a held-out
evaluation every --eval-interval steps, through the real CLI. Each mode runs with every seed in
--seeds, which measures the run-to-run noise. Writes a table (stdout, JSON) and a PNG plot.

    pip install matplotlib   # or: pip install -e '.[bench]'
    python bench/learning.py [--steps 300] [--seeds 1 2] [--out docs/bench/learning]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "train (sync)": ["train"],
    "train-async (one-step)": ["train-async"],
    "train-async --fully-async": ["train-async", "--fully-async"],
}


def run(mode: list[str], seed: int, steps: int, interval: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "services.cli", *mode, "--config", str(ROOT / "deploy/configs/quickstart.yaml"),
           "--no-fully-async", "--num-rollout", str(steps), "--eval-interval", str(interval),
           "--seed", str(seed), "--rollout-seed", str(seed), "--run-dir", str(run_dir)]  # fmt: skip
    if "--fully-async" in mode:
        cmd.remove("--no-fully-async")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(mode)} (seed {seed}) failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    t0 = recs[0]["time"] - recs[0]["perf/elapsed_s"]  # the training loop's start
    by_step = {r["step"] + 1: r["time"] - t0 for r in recs}
    by_step[0] = 0.0
    key = next(
        k for k in evals[0] if k.startswith("eval/") and k.count("/") == 1 and k != "eval/step" and "duration" not in k
    )
    points = sorted((e["step"], by_step.get(e["step"], 0.0), e[key]) for e in evals if not e.get("skipped"))
    return {"points": points, "loop_wall_s": recs[-1]["perf/elapsed_s"]}


def time_to_reach(points: list, target: float) -> float | None:
    for _step, t, reward in points:
        if reward >= target:
            return t
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default="docs/bench/learning", help="writes OUT.json and OUT.png")
    a = p.parse_args()
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            for name, mode in MODES.items():
                print(f"{name}, seed {seed} ...", flush=True)
                run_dir = Path(tmp) / f"{mode[-1].strip('-')}-{seed}"
                results[name].append({"seed": seed, **run(mode, seed, a.steps, a.eval_interval, run_dir)})
    finals = {m: [r["points"][-1][2] for r in rs] for m, rs in results.items()}
    starts = [r["points"][0][2] for rs in results.values() for r in rs]
    sync_final = sum(finals["train (sync)"]) / len(finals["train (sync)"])
    noise = max(max(v) - min(v) for v in finals.values()) if len(a.seeds) > 1 else 0.0
    table = {}
    print(f"\n{'mode':28}{'final reward':>14}{'loop wall s':>13}{'time to sync final':>20}")
    for name, rs in results.items():
        reach = [time_to_reach(r["points"], sync_final - noise / 2) for r in rs]
        table[name] = {
            "final_reward": finals[name],
            "final_reward_mean": sum(finals[name]) / len(finals[name]),
            "loop_wall_s": [r["loop_wall_s"] for r in rs],
            "seconds_to_sync_final": reach,
        }
        reach_s = ", ".join("-" if x is None else f"{x:.0f}" for x in reach)
        walls = ", ".join(f"{r['loop_wall_s']:.0f}" for r in rs)
        print(f"{name:28}{table[name]['final_reward_mean']:>14.3f}{walls:>13}{reach_s:>20}")
    summary = {"steps": a.steps, "seeds": a.seeds, "step0_reward_mean": sum(starts) / len(starts),
               "sync_final_reward": sync_final, "run_to_run_noise": noise, "modes": table, "runs": results}  # fmt: skip
    out = ROOT / a.out if not Path(a.out).is_absolute() else Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"noise between seeds (largest spread of a mode's final reward): {noise:.3f}")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    colors = dict(zip(results, ("tab:gray", "tab:blue", "tab:red"), strict=False))
    for name, rs in results.items():
        for i, r in enumerate(rs):
            steps, times, rewards = zip(*r["points"], strict=True)
            label = name if i == 0 else None
            by_step.plot(steps, rewards, color=colors[name], alpha=0.8, label=label)
            by_time.plot(times, rewards, color=colors[name], alpha=0.8, label=label)
    by_step.set_xlabel("training step")
    by_time.set_xlabel("wall-clock of the training loop (s)")
    for ax in (by_step, by_time):
        ax.set_ylabel("held-out reward")
        ax.grid(alpha=0.3)
    by_step.legend(loc="lower right")
    fig.suptitle("reverse-digits, tiny Llama, 2 CPU cores: same steps, three drivers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
