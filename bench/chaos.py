"""Chaos soak: the default job (the quickstart config, no --save) while a random process of every
kind is SIGKILLed at random times, and one is frozen (SIGSTOP) for 30 s then thawed (SIGCONT).

Per seed: at least 20 faults, at most 3 kills per kind (the launcher's default restart budget is
3 per 10 minutes: the soak stays inside the defaults). Prints, per seed, the faults survived,
the steps finished, lost / trained-twice / failed counts from the run's audit, and the longest
stall (the longest gap between two consecutive steps).

    python bench/chaos.py [--seeds 1 2] [--out docs/bench/chaos.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"buffer": "buffer", "trainer": "trainer", "producer": "rollout-0", "engine": "engine-0",
         "weight-sync": "weight-sync", "eval": "eval", "nats-server": "nats-server"}  # fmt: skip
KILLS_PER_KIND = 3
FREEZE_S = 30.0


def pids(run_dir: Path) -> dict[str, int]:
    try:
        return json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError):
        return {}


def steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def soak(seed: int, work: Path) -> dict:
    rng = random.Random(seed)
    run_dir = work / f"seed{seed}"
    cmd = [sys.executable, "-m", "services.cli", "train-async", "--config", str(ROOT / "deploy/configs/quickstart.yaml"),
           "--run-dir", str(run_dir), "--seed", str(1234 + seed), "--rollout-seed", str(42 + seed)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        return _inject(rng, proc, run_dir)
    finally:
        if proc.poll() is None:  # interrupted: the launcher stops every process of the run
            proc.terminate()
            proc.wait(timeout=60)


def _inject(rng: random.Random, proc: subprocess.Popen, run_dir: Path) -> dict:
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    faults: list[dict] = []
    plan = [k for k in KINDS for _ in range(KILLS_PER_KIND)]
    rng.shuffle(plan)
    freeze_at = rng.randrange(len(plan))
    t0 = time.monotonic()
    while not (run_dir / "services.json").exists() and proc.poll() is None:
        time.sleep(0.2)
    while len(steps(run_dir)) < 20 and proc.poll() is None:  # let it train a little first
        time.sleep(0.2)
    for i, kind in enumerate(plan):
        time.sleep(rng.uniform(3.0, 8.0))
        if proc.poll() is not None:
            break
        pid = pids(run_dir).get(KINDS[kind])
        if pid is None:
            continue
        if i == freeze_at:
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(FREEZE_S, lambda p=pid: _thaw(p)).start()
            faults.append({"t": round(time.monotonic() - t0, 1), "kind": kind, "fault": "SIGSTOP 30s"})
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        faults.append({"t": round(time.monotonic() - t0, 1), "kind": kind, "fault": "SIGKILL",
                       "at_step": len(steps(run_dir))})  # fmt: skip
    code = proc.wait(timeout=3600)
    wall = time.monotonic() - t0
    records = steps(run_dir)
    times = [r["time"] for r in records]
    stall = max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)
    audit_path = run_dir / "audit.json"
    audit = json.loads(audit_path.read_text()) if audit_path.exists() else {}
    result = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}
    return {
        "seed": int(run_dir.name.removeprefix("seed")), "exit_code": code, "wall_s": round(wall, 1), "faults": len(faults),
        "kills": sum(f["fault"] == "SIGKILL" for f in faults), "freezes": sum(f["fault"] != "SIGKILL" for f in faults),
        "steps_finished": len(records), "restarts": sum("restarting" in x for x in lines),
        "lost": audit.get("lost"), "trained_twice": audit.get("trained_twice"), "failed": audit.get("failed"),
        "balanced": audit.get("balanced"), "longest_stall_s": round(stall, 1),
        "heldout_reward_step0": result.get("heldout_reward_step0"), "heldout_reward_final": result.get("heldout_reward_final"),
        "fault_log": faults, "output_tail": lines[-15:] if code else [],
    }  # fmt: skip


def _thaw(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as work:
        for seed in a.seeds:
            r = soak(seed, Path(work))
            results.append(r)
            print(f"seed {seed}: exit {r['exit_code']}, {r['faults']} faults ({r['kills']} SIGKILL, {r['freezes']} "
                  f"SIGSTOP {FREEZE_S:.0f}s), {r['restarts']} restarts, {r['steps_finished']} steps in {r['wall_s']}s; "
                  f"lost {r['lost']}, trained twice {r['trained_twice']}, failed {r['failed']}, "
                  f"balanced {r['balanced']}; longest stall {r['longest_stall_s']}s", flush=True)  # fmt: skip
            for line in r["output_tail"]:
                print("   ", line.rstrip())
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))
    if any(r["exit_code"] != 0 or r["lost"] != 0 or r["trained_twice"] != 0 for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
