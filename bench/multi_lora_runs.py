"""Run-level multi-LoRA benchmark: whole training runs through the real CLI, as a user runs them,
training 1, 2 and 4 LoRA adapters at once against one full-model run, on the same task, model and
machine. bench/multi_lora.py measures the inference engine alone; this one measures everything a
run does (rollouts, buffer, trainer steps, adapter publishing and loading, the bus).

Arms (each a fresh `python -m services.cli train-async --fully-async` run in its own temporary
directory, the quickstart's tiny model prebuilt once and passed as --hf-checkpoint, the
reverse-digits task, no in-loop evaluation):
  full     the full model, no multi-LoRA: --num-rollout S steps of B groups x n samples
  k=1,2,4  --multi-lora-n-adapters k with k adapters registered at start (--multi-lora-adapter
           NAME YAML), each on reverse-digits with its own copy of the data, rank 8, alpha 16,
           B groups x n samples per step, and S/k steps each
Every arm trains the same samples, S x B x n (so S must be a multiple of 4): run wall times
compare directly and each arm's measuring window holds the same work.

Throughput: trained samples per second of the run, between its first and its last trained step,
from the trainer's records in <run-dir>/metrics.jsonl: the samples of every record after the
first (`rollout/num_samples`, or an adapter step's `{name}/rollout/num_samples`) / the seconds
between the first record's `time` and the last's. Start-up (model load, services,
the first step's rollouts) and shut-down (saves, audit) are outside the window; the whole run's
wall time is printed beside it. At the window's start each of k partitions may already hold
groups for its next step (up to k x B groups against B): a bias in favour of k > 1 of under 2% at
the defaults. Arms alternate in rounds
(forward, then backward); the spread between rounds is printed beside each figure. The goal: 4
adapters at least 80% of one adapter's throughput.

    python bench/multi_lora_runs.py [--steps 200] [--rollout-batch-size 8] [--n-samples 8] [--rounds 2]
                                    [--out docs/bench/multi_lora_runs.json]
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

ARMS = ("full", "k=1", "k=2", "k=4")
RANK, ALPHA = 8, 16
COMMON = ["train-async", "--fully-async", "--skip-eval-before-train", "--async-data-buffer-capacity-factor", "1"]


def write_rows(path: Path, rows: int) -> Path:
    from services.tasks import reverse_digits

    path.write_text("".join(json.dumps(r) + "\n" for r in reverse_digits.make_rows(rows, seed=3)))
    return path


def command(arm: str, a, model_dir: Path, tmp: Path, rows: int) -> tuple[list[str], dict[str, int]]:
    """The arm's CLI line and the steps each of its step axes should reach ({"": S} for full)."""
    from services.tasks import reverse_digits

    batch = ["--rollout-batch-size", str(a.rollout_batch_size), "--n-samples-per-prompt", str(a.n_samples)]
    base = [*COMMON, *batch, "--hf-checkpoint", str(model_dir), "--run-dir", str(tmp / "run")]
    if arm == "full":
        data = write_rows(tmp / "train.jsonl", rows)
        return [*base, "--num-rollout", str(a.steps), "--prompt-data", str(data)], {"": a.steps}
    k = int(arm.split("=")[1])
    each = a.steps // k
    cmd = [*base, "--num-rollout", "1", "--multi-lora-n-adapters", str(k)]
    for i in range(k):
        name = f"rev{i}"
        data = write_rows(tmp / f"{name}.jsonl", rows)
        spec = tmp / f"{name}.yaml"
        spec.write_text(f"data: {data}\nrank: {RANK}\nalpha: {ALPHA}\nrollout_batch_size: {a.rollout_batch_size}\n"
                        f"n_samples_per_prompt: {a.n_samples}\nsave: {tmp / ('save_' + name)}\n"
                        f"rm_type: {reverse_digits.NAME}\nnum_step: {each}\n")  # fmt: skip
        cmd += ["--multi-lora-adapter", name, str(spec)]
    return cmd, {f"rev{i}": each for i in range(k)}


def run_arm(arm: str, a, model_dir: Path, rows: int) -> dict:
    """One whole run; its throughput between its first and last trained step, and its wall time."""
    with tempfile.TemporaryDirectory(prefix=f"asyncrl-loraruns-{arm.replace('=', '')}-") as tmp:
        tmp = Path(tmp)
        cmd, want = command(arm, a, model_dir, tmp, rows)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "services.cli", *cmd], cwd=tmp, capture_output=True, text=True)
        wall = time.monotonic() - t0

        def fail(why: str) -> None:
            print(f"\n{arm} failed ({why}): python -m services.cli {' '.join(cmd)}\n--- stdout (tail) ---\n"
                  f"{proc.stdout[-3000:]}\n--- stderr (tail) ---\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)  # fmt: skip
            raise SystemExit(1)

        if proc.returncode != 0:
            fail(f"exit status {proc.returncode}")
        metrics = tmp / "run" / "metrics.jsonl"
        recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
        recs = [r for r in recs if "step" in r]
        steps = {axis: sum(1 for r in recs if (r.get("adapter") or "") == axis) for axis in want}
        if steps != want or len(recs) != sum(want.values()) or [r["step"] for r in recs] != list(range(len(recs))):
            fail(f"steps recorded {steps} (of {len(recs)} records), expected {want} (a trainer restart?)")
        if len(recs) < 2:
            fail("fewer than 2 trained steps: no window to measure")
        # an adapter's step: its own {name}/rollout/num_samples (batch_n_samples is the coalesced batch's)
        per_step = [int(r[f"{r['adapter']}/rollout/num_samples"] if "adapter" in r else r["rollout/num_samples"])
                    for r in recs]  # fmt: skip
        window = recs[-1]["time"] - recs[0]["time"]
        measured = sum(per_step) - per_step[0]  # the first step's samples were trained before the window
        return {"samples_per_s": measured / window if window > 0 else float("nan"), "window_s": window,
                "run_wall_s": wall, "samples": sum(per_step), "records": len(recs)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="full-model steps S; each of k adapters takes S/k")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rollout-batch-size", type=int, default=8, help="groups per step B (full model and adapters)")
    p.add_argument("--n-samples", type=int, default=8, help="samples per prompt n")
    p.add_argument("--arms", default=",".join(ARMS), help=f"a subset of {','.join(ARMS)} (full and k=1 are the "
                   "references of the ratios)")  # fmt: skip
    p.add_argument("--out", default=None)
    a = p.parse_args()
    arms = tuple(x for x in ARMS if x in a.arms.split(","))
    if unknown := set(a.arms.split(",")) - set(ARMS):
        raise SystemExit(f"unknown arms {sorted(unknown)}: use {', '.join(ARMS)}")
    if a.steps % 4 or a.steps < 4:
        raise SystemExit("--steps must be a positive multiple of 4 (k=4 gives each adapter S/4 steps)")
    from services.tasks import reverse_digits

    rows = max(400, a.steps * a.rollout_batch_size)
    print(f"{a.steps} steps x {a.rollout_batch_size} groups x {a.n_samples} samples = "
          f"{a.steps * a.rollout_batch_size * a.n_samples} samples per arm; arms {', '.join(arms)}; "
          f"{a.rounds} rounds; {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="asyncrl-loraruns-model-") as mtmp:
        model_dir = Path(mtmp) / "tiny"  # the model the launcher would build (seed 1234, 20 warm-start steps)
        reverse_digits.build_model(model_dir, seed=1234, warmup_sft_steps=20, log=lambda *_: None)
        results: dict[str, list[dict]] = {arm: [] for arm in arms}
        t_all = time.monotonic()
        for r in range(a.rounds):
            for arm in arms if r % 2 == 0 else tuple(reversed(arms)):
                res = run_arm(arm, a, model_dir, rows)
                results[arm].append(res)
                print(f"  round {r + 1}, {arm:<5} {res['samples_per_s']:8.1f} samples/s over {res['window_s']:5.1f} s "
                      f"({res['samples']} samples, {res['records']} steps); whole run {res['run_wall_s']:5.1f} s",
                      flush=True)  # fmt: skip
    sps = {arm: [x["samples_per_s"] for x in v] for arm, v in results.items()}
    mean = {arm: statistics.mean(v) for arm, v in sps.items()}
    spread = {arm: (max(v) - min(v)) / statistics.mean(v) if len(v) > 1 else 0.0 for arm, v in sps.items()}
    wall = {arm: statistics.mean(x["run_wall_s"] for x in v) for arm, v in results.items()}

    def ratio(arm: str, ref: str) -> str:
        return f"{mean[arm] / mean[ref]:6.2f}x" if ref in mean else f"{'-':>7}"

    head = f"{'arm':<6} {'samples':>8} {'samples/s':>10} {'spread':>7} {'of full':>8} {'of k=1':>8} {'run wall s':>11}"
    print("\n" + head)
    for arm in arms:
        print(f"{arm:<6} {results[arm][0]['samples']:8d} {mean[arm]:10.1f} {spread[arm]:6.0%} {ratio(arm, 'full'):>8} "
              f"{ratio(arm, 'k=1'):>8} {wall[arm]:11.1f}")  # fmt: skip
    if "k=4" in mean and "k=1" in mean:
        print(f"\n4 adapters: {mean['k=4'] / mean['k=1']:.0%} of one adapter's throughput (goal: at least 80%)")
    print(f"benchmark wall time: {time.monotonic() - t_all:.0f} s")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"samples_per_s": sps, "mean": mean, "spread": spread, "run_wall_s": wall,
                                           "runs": results, "settings": vars(a) | {"cpus": os.cpu_count()}},
                                          indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
