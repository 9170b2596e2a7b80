"""Pipeline benchmark: the same work in `train` (synchronous) and `train-async --fully-async`,
side by side in one invocation, through the real CLI (every service a process, real NATS).

Prints both wall-clocks of the training loop (first batch request to last step), their ratio,
and the ideal ratio for this workload, (rollout time + train time) / max(rollout, train),
with rollout and train times measured from the synchronous run.

    python bench/pipeline.py [--steps 40] [--out docs/bench/pipeline.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOAD = ["--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--async-data-buffer-capacity-factor", "1",
            "--skip-eval-before-train", "--seed", "1234", "--rollout-seed", "42"]  # fmt: skip


def run(command: list[str], run_dir: Path) -> list[dict]:
    argv = [sys.executable, "-m", "services.cli", *command, *WORKLOAD, "--run-dir", str(run_dir)]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    a = p.parse_args()
    steps = ["--num-rollout", str(a.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        print(f"running {a.steps} steps of B=16 x n=8 synchronously ...", flush=True)
        sync = run(["train", *steps], Path(tmp) / "sync")
        print("running the same work fully async ...", flush=True)
        fully = run(["train-async", "--fully-async", *steps], Path(tmp) / "fully")
    wall_sync = sync[-1]["perf/elapsed_s"]
    wall_async = fully[-1]["perf/elapsed_s"]
    rollout = sum(r["perf/rollout_wait_s"] for r in sync)
    train = sum(r["perf/train_time_s"] + r["perf/weight_push_s"] for r in sync)
    ideal = (rollout + train) / max(rollout, train)
    result = {
        "steps": a.steps,
        "samples_per_step": sync[0]["rollout/num_samples"],
        "sync_wall_s": round(wall_sync, 2),
        "fully_async_wall_s": round(wall_async, 2),
        "speedup": round(wall_sync / wall_async, 3),
        "sync_rollout_s": round(rollout, 2),
        "sync_train_s": round(train, 2),
        "ideal_speedup": round(ideal, 3),
        "fraction_of_ideal": round((wall_sync / wall_async - 1) / (ideal - 1), 3) if ideal > 1 else None,
        "fully_async_avg_staleness": round(
            sum(r.get("rollout/fully_async/avg_staleness", 0.0) for r in fully) / len(fully), 2
        ),
    }
    print(f"\n{'':24}{'sync':>10}{'fully async':>14}")
    print(f"{'training loop wall (s)':24}{wall_sync:>10.1f}{wall_async:>14.1f}")
    print(f"sync breakdown: rollout {rollout:.1f}s + train {train:.1f}s")
    print(f"speedup sync/fully-async: {result['speedup']:.2f}x   ideal for this workload: {ideal:.2f}x")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
