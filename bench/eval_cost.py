"""What evaluation costs training and production: the same fully-async work without eval, with
a dedicated eval fleet, and with evals on the shared rollout engines, side by side.

For each run: the trainer's step time (mean interval between steps 2..N), the producers'
throughput (groups put into the buffer per second, from the buffer's ledger), the longest gap in
production, and how long the evals took. Shared-engine evals stop new submissions for their
duration; the fleet should leave both numbers where they are without eval.

    python bench/eval_cost.py [--steps 80] [--eval-interval 5] [--out docs/bench/eval_cost.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WORK = ["train-async", "--fully-async", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
        "--async-data-buffer-capacity-factor", "1", "--skip-eval-before-train", "--seed", "1234", "--rollout-seed", "42"]  # fmt: skip


def ledger_puts(run_dir: Path) -> list[float]:
    """Timestamps of the groups the producers delivered (read from the run's own NATS store)."""
    from services.buffer.state import ledger_events
    from services.common.bus import Bus
    from services.common.natsserver import EmbeddedNats

    cfg = json.loads((run_dir / "config.json").read_text())

    async def read(url):
        bus = await Bus.connect(url, cfg["run_id"], "bench")
        try:
            s = bus.subjects
            return [ev for d in await bus.read_stream(s.ledger_stream, s.ledger) for ev in ledger_events(d)]
        finally:
            await bus.close()

    with EmbeddedNats(run_dir / "nats", log_path=run_dir / "logs" / "bench-nats.log") as srv:
        events = asyncio.run(read(srv.url))
    return sorted(e.ts for e in events if e.kind == "put" and e.outcome != "duplicate")


def measure(name: str, extra: list[str], steps: int, tmp: Path) -> dict:
    run_dir = tmp / name
    cmd = [sys.executable, "-m", "services.cli", *WORK, "--num-rollout", str(steps), "--run-dir", str(run_dir), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    t_start, t_end = recs[1]["time"], recs[-1]["time"]
    step_s = (t_end - t_start) / (len(recs) - 2)
    puts = [t for t in ledger_puts(run_dir) if t_start <= t <= t_end]
    gaps = [b - a for a, b in zip(puts, puts[1:], strict=False)]
    evals = []
    if (run_dir / "eval.jsonl").exists():
        evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    return {
        "step_time_s": step_s,
        "groups_per_s": len(puts) / (t_end - t_start),
        "longest_production_gap_s": max(gaps) if gaps else 0.0,
        "eval_points": len(evals),
        "eval_mean_duration_s": sum(e.get("eval/duration_seconds", 0.0) for e in evals) / len(evals) if evals else 0.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=80)  # 40 steps: about 30% noise between two identical runs
    p.add_argument("--eval-interval", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    every = ["--eval-interval", str(a.eval_interval)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = {
            "no eval": [],
            "dedicated fleet": [*every, "--eval-num-gpus", "1", "--eval-hf-dir", str(tmp / "evalhf")],
            "shared engines": every,
            "no eval (again)": [],  # the run-to-run noise
        }
        results = {}
        for name, extra in runs.items():
            print(f"{name} ...", flush=True)
            results[name] = measure(name.replace(" ", "-"), extra, a.steps, tmp)
    base = results["no eval"]
    print(f"\n{'':18}{'step time s':>12}{'groups/s':>10}{'longest gap s':>15}{'evals':>7}{'eval s':>8}")
    for name, m in results.items():
        print(f"{name:18}{m['step_time_s']:>12.3f}{m['groups_per_s']:>10.1f}{m['longest_production_gap_s']:>15.2f}"
              f"{m['eval_points']:>7}{m['eval_mean_duration_s']:>8.2f}")  # fmt: skip
        m["step_time_vs_no_eval"] = m["step_time_s"] / base["step_time_s"]
        m["throughput_vs_no_eval"] = m["groups_per_s"] / base["groups_per_s"]
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        summary = {"steps": a.steps, "eval_interval": a.eval_interval, **results}
        Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
