"""Does the advice line name the bound each driver is under? One run per driver on the default job
and on the long-tail job, each read two ways:

- the advice: `services.dashboard.diagnosis.diagnose` on the run's own metrics.jsonl and config,
  exactly what `asyncrl status` and the dashboard show (it reads the trainer's wait and the
  buffer's queue);
- the bound measured at the two resources, over the same last WINDOW steps the advice reads
  (the line speaks of the run's latest steps; the run-long figures are kept beside them): the
  share of those seconds the engine was busy (read at the engine, `sglang:num_running_reqs` above
  0) against the share the trainer was busy (the seconds less its wait for batches). Under the
  one-step and fully async drivers, which overlap the two, the busier one is the bound, and
  neither when they are within BALANCED_POINTS of each other (balanced). The synchronous driver
  overlaps nothing: its step is its generation phase (the trainer's wait) and then its training
  phase, and the longer phase is the bound. The staleness filter is the bound where it dropped at
  least docs/dashboard.md's share of the groups.

The long-tail job's fully async arm runs at the config's staleness bound (2) and at 1 and 4, the
arms of bench/longtail.py.

    python bench/advice.py                       # 8 runs, about 15 minutes on 2 cores
    python bench/advice.py --report-only         # the table from docs/bench/advice_runs.jsonl

Each run is appended to the record as it finishes (resumable), with the code revision it ran.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from learning import ROOT, code_revision, load_record, run_one, write_data

from services.dashboard.diagnosis import STALE_DROP_SHARE, WINDOW, window_shares

JOBS = {
    "default": ("deploy/configs/quickstart.yaml", "services.tasks.reverse_digits", 200),
    "long-tail": ("deploy/configs/longtail.yaml", "services.tasks.reverse_longtail", 150),
}
CELLS = [(job, driver, []) for job in JOBS for driver in ("sync", "one-step", "fully-async")] + [
    ("long-tail", "fully-async", ["--max-weight-staleness", str(s)]) for s in (1, 4)
]
"""(job, driver, extra flags): every run the table reads."""
BALANCED_POINTS = 0.10
"""Busy shares of engine and trainer this close (overlapping drivers) read as balanced."""


def at_resources(run: dict) -> dict:
    """The run's readings over the advice's window where the record has them (else run-long):
    the staleness filter's share of the groups offered, the trainer's idle share, the engine's."""
    if "window" in run:
        return run["window"]
    stale = run.get("stale_dropped", 0.0)
    return {"stale_share": stale / (stale + run["batch"] * run["steps"]), "trainer_idle": run["trainer_idle"],
            "engine_idle_share": run["engine_idle_share"]}  # fmt: skip


def window_readings(recs: list[dict], batch: int, engine_idle_share: float | None) -> dict:
    """The last WINDOW steps read as the advice reads them (`window_shares`), with the engine's idle
    share over the same seconds."""
    idle, stale = window_shares(recs[-WINDOW:], batch)
    return {"stale_share": stale, "trainer_idle": idle, "engine_idle_share": engine_idle_share}


def measured_bound(run: dict) -> str:
    """The bound read at the resources, not through the advice's rules."""
    read = at_resources(run)
    if read["stale_share"] >= STALE_DROP_SHARE:
        return "staleness"
    trainer_busy = 1.0 - read["trainer_idle"]
    if run["arm"] == "sync":  # one phase after the other: the longer one bounds the step
        return "generation" if read["trainer_idle"] >= trainer_busy else "trainer"
    engine_busy = 1.0 - read["engine_idle_share"]
    if abs(engine_busy - trainer_busy) < BALANCED_POINTS:
        return "balanced"
    return "generation" if engine_busy > trainer_busy else "trainer"


def run_cell(job: str, driver: str, extra: list[str], seed: int, a) -> dict:
    config, task, steps = JOBS[job]
    ns = argparse.Namespace(config=config, eval_interval=steps, eval_prompts=a.eval_prompts, eval_samples=1,
                            task_module=task)  # fmt: skip
    data = write_data(Path(tempfile.gettempdir()) / f"asyncrl-advice-{job}", a.eval_prompts, task)
    with tempfile.TemporaryDirectory(prefix="asyncrl-advice-") as tmp:
        run_dir = Path(tmp) / "run"
        res = run_one(driver, seed, steps, extra, ns, data, run_dir)
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        res["stale_dropped"] = sum(r.get("rollout/fully_async/stale_groups_filtered", 0.0) for r in recs)
        res["batch"] = json.loads((run_dir / "config.json").read_text())["rollout_batch_size"]
        res["window"] = window_readings(recs, res["batch"], res.pop("window_engine_idle_share"))
    return {"job": job, **res}


def table(runs: list[dict]) -> tuple[str, int]:
    lines = [f"{'job':<10}{'driver':<20}{'engine busy':>12}{'trainer busy':>13}{'measured':>12}{'advice':>12}  "
             f"agree  the line"]  # fmt: skip
    agree = 0
    for r in runs:
        bound, read = measured_bound(r), at_resources(r)
        said = r["diagnosis"][0]
        ok = said == bound
        agree += ok
        arm = r["arm"] + (f" S={r['extra'][-1]}" if r.get("extra") else "")
        lines.append(f"{r['job']:<10}{arm:<20}{1 - read['engine_idle_share']:>12.0%}{1 - read['trainer_idle']:>13.0%}"
                     f"{bound:>12}{said:>12}  {'yes' if ok else 'NO':<5}  {r['diagnosis'][1]}")  # fmt: skip
    return "\n".join(lines), agree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", default="docs/bench/advice_runs.jsonl")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts (the advice needs none)")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args()
    record = ROOT / a.record
    if not a.report_only:
        done = {(r["job"], r["arm"], tuple(r.get("extra", []))) for r in load_record(record) if r.get("seed") == a.seed}
        rev = code_revision()
        for job, driver, extra in CELLS:
            if (job, driver, tuple(extra)) in done:
                continue
            t0 = time.time()
            res = run_cell(job, driver, extra, a.seed, a)
            res["rev"] = res.get("rev") or rev
            record.parent.mkdir(parents=True, exist_ok=True)
            with record.open("a") as f:
                f.write(json.dumps(res) + "\n")
            print(f"  {job:<10}{driver:<13}{' '.join(extra):<26}{res['diagnosis'][0]:<12}in {time.time() - t0:.0f} s",
                  flush=True)  # fmt: skip
    runs = [r for r in load_record(record) if r.get("seed") == a.seed and "diagnosis" in r]
    text, agree = table(runs)
    print(text)
    print(f"the advice names the measured bound in {agree} of {len(runs)} runs")


if __name__ == "__main__":
    main()
