"""The three drivers on a task with a long tail of response lengths, to a target reward.

The task is reverse-longtail (deploy/configs/longtail.yaml, services/tasks/reverse_longtail.py):
the median answer is a few tokens, the p99 over a hundred, and the reward reads the whole answer.
Every arm runs the same config, model, batch, step budget and target through the real CLI, the
engine and the trainer pinned to separate cores (the config's --pin-cpus). Per arm:

  time to target   median wall-clock of the training loop to --threshold on the held-out set, with a
                   95% bootstrap interval; a run that never reaches it counts as its whole loop and is
                   marked censored
  final reward     mean final held-out reward, 95% bootstrap interval
  samples/s        trained samples (and their response tokens) per second of loop
  engine           read at the engine during the run (its sglang:num_running_reqs every 50 ms): its
                   mean batch over the in-flight cap (fill), the share of the loop it ran nothing
                   (idle), and the seconds per step it ran at most a tenth of its peak batch: a batch
                   waiting for its slowest answers (straggler)
  trainer idle     the share of the loop the trainer waited for batches; train s: train + push a step
  staleness        mean and max of the trained groups
  lengths          the held-out answers' median and p99 token lengths at step 0 and at the end

It also measures the engine's capacity on the task's lengths (bench/scheduler.py's closed loop)
and prints the trainer's (the synchronous runs' train + push): the two bounds. Fully async runs a
staleness sweep (--sweep, each value as --max-weight-staleness; the --fully-async-staleness one on
every seed, the others on --sweep-seeds). Runs are recorded as they finish (--record) and never run
twice, so the bench resumes across sessions.

    python bench/longtail.py [--seeds 1-5] [--steps 250] [--sweep 1,2,4] [--sweep-seeds 1-2] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import yaml
from learning import ROOT, add_common, bootstrap_ci, load_record, run_all, seeds_of
from scheduler import engine_capacity

from services.tasks import reverse_longtail as task

CONFIG = "deploy/configs/longtail.yaml"
ARMS = ("sync", "one-step", "fully-async")


# ---- the engine's capacity ---------------------------------------------------------------------
def engine_capacity_on_task(concurrency: int, seconds: float) -> dict:
    """The built-in engine's samples/s and tokens/s on the task's lengths (a prompt of L digits
    generating L + 1 tokens), pinned to the core the runs give it (bench/scheduler.py's closed loop;
    the initial model: the weights do not change the cost of a token)."""
    rng = random.Random(0)
    vocab = {c: 4 + i for i, c in enumerate("0123456789+=")}

    def body(_i: int) -> dict:
        d = task.digits(rng)
        return {"input_ids": [1, *(vocab[c] for c in d), vocab["="]],
                "sampling_params": {"max_new_tokens": len(d) + 1, "ignore_eos": True}, "return_logprob": True}  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="asyncrl-longtail-capacity-") as tmp:
        tmp = Path(tmp)
        task.build_model(tmp / "model", warmup_sft_steps=0, log=lambda *_: None)
        return engine_capacity(tmp / "model", tmp, seconds, concurrency, True, body)


# ---- statistics ----------------------------------------------------------------------------------
def reach_time(run: dict, threshold: float) -> tuple[float, bool]:
    """(seconds of loop to the threshold, censored): a run that never reaches it counts its whole loop."""
    t = next((t for _step, t, reward in run["points"] if reward >= threshold), None)
    return (run["loop_wall_s"], True) if t is None else (t, False)


def median_ci(values: list[float], n: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the median."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def ratio_ci(a: list[float], b: list[float], n: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """median(a) / median(b) and its 95% bootstrap interval (the arms resampled independently)."""
    rng = random.Random(seed)
    rs = sorted(statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
                for _ in range(n))  # fmt: skip
    return statistics.median(a) / statistics.median(b), rs[int(0.025 * n)], rs[int(0.975 * n) - 1]


def arm_summary(runs: list[dict], threshold: float, inflight: int) -> dict:
    reach = [reach_time(r, threshold) for r in runs]
    times = [t for t, _ in reach]
    finals = [r["points"][-1][2] for r in runs]
    mean = statistics.fmean
    sampled = [r for r in runs if "engine_running_mean" in r]  # the engine's batch, read during the run
    return {
        "n": len(runs), "times": times, "censored": sum(c for _, c in reach),
        "median_s_to_target": statistics.median(times), "median_ci95": median_ci(times),
        "final_mean": mean(finals), "final_ci95": bootstrap_ci(finals),
        "loop_s": mean(r["loop_wall_s"] for r in runs),
        "samples_per_s": mean(r["samples_per_s"] for r in runs), "tokens_per_s": mean(r["tokens_per_s"] for r in runs),
        "engine_n": len(sampled),
        "engine_fill": mean(r["engine_running_mean"] for r in sampled) / inflight if sampled else None,
        "engine_idle": mean(r["engine_idle_share"] for r in sampled) if sampled else None,
        "straggler_s": mean(r["engine_tail_s_per_step"] for r in sampled) if sampled else None,
        "trainer_idle": mean(r["trainer_idle"] for r in runs), "train_push_s": mean(r["train_push_s"] for r in runs),
        "staleness_mean": mean(r["staleness_mean"] for r in runs), "staleness_max": max(r["staleness_max"] for r in runs),
        "len_first": [mean(r["first_len_median"] for r in runs), mean(r["first_len_p99"] for r in runs)],
        "len_last": [mean(r["last_len_median"] for r in runs), mean(r["last_len_p99"] for r in runs)],
    }  # fmt: skip


def _opt(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def table(rows: dict[str, dict], threshold: float) -> str:
    head = (f"{'arm':<18}{'n':>3}{'s to ' + str(threshold) + ' (95% CI)':>21}{'cens':>5}{'final (95% CI)':>24}"
            f"{'loop s':>7}{'smp/s':>6}{'tok/s':>6}{'eng fill':>9}{'eng idle':>9}{'strag s':>8}{'tr idle':>8}"
            f"{'train s':>8}{'stale':>10}{'len med/p99 0->end':>20}")  # fmt: skip
    lines = [head]
    for name, s in rows.items():
        t = f"{s['median_s_to_target']:.0f} [{s['median_ci95'][0]:.0f}, {s['median_ci95'][1]:.0f}]"
        f = f"{s['final_mean']:.3f} [{s['final_ci95'][0]:.3f}, {s['final_ci95'][1]:.3f}]"
        lens = f"{s['len_first'][0]:.0f}/{s['len_first'][1]:.0f} -> {s['len_last'][0]:.0f}/{s['len_last'][1]:.0f}"
        lines.append(f"{name:<18}{s['n']:>3}{t:>21}{s['censored']:>5}{f:>24}{s['loop_s']:>7.0f}{s['samples_per_s']:>6.0f}"
                     f"{s['tokens_per_s']:>6.0f}{_opt(s['engine_fill'], '{:.0%}'):>9}{_opt(s['engine_idle'], '{:.0%}'):>9}"
                     f"{_opt(s['straggler_s'], '{:.3f}'):>8}{s['trainer_idle']:>8.0%}{s['train_push_s']:>8.3f}"
                     f"{s['staleness_mean']:>6.2f} ({s['staleness_max']}){lens:>20}")  # fmt: skip
    lines.append("eng fill: the engine's mean batch over the in-flight cap; eng idle: the share of the loop it ran "
                 "nothing; strag s: seconds a step the engine ran at most a tenth of its peak batch (a batch "
                 "waiting for its slowest answers); tr idle: the share of the loop the trainer waited; train s: "
                 "train + weight push per step (median)")  # fmt: skip
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------
def arm_cells(a) -> dict[str, tuple[str, list[str]]]:
    """Arm name -> (driver, extra args): the three drivers, then the fully async staleness sweep."""
    cells = {"sync": ("sync", []), "one-step": ("one-step", [])}
    for s in a.sweep:
        cells[f"fully-async S={s}"] = ("fully-async", ["--max-weight-staleness", str(s)])
    return cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", default="docs/bench/longtail_runs.jsonl")
    p.add_argument("--out", default="docs/bench/longtail.json")
    p.add_argument("--sweep", default="1,2,4", help="fully async's --max-weight-staleness values")
    p.add_argument("--fully-async-staleness", type=int, default=2,
                   help="the sweep's value compared with the other drivers (the config's)")  # fmt: skip
    p.add_argument("--sweep-seeds", default="1-3", help="the seeds the sweep's other values run")
    p.add_argument("--capacity-seconds", type=float, default=15.0)
    p.add_argument("--capacity-only", action="store_true",
                   help="measure the engine's capacity again (the newest measurement is the one used), run nothing else")
    add_common(p)
    p.set_defaults(seeds="1-5", steps=250, eval_interval=25, eval_prompts=128, threshold=0.3, config=CONFIG,
                   task_module="services.tasks.reverse_longtail")  # fmt: skip
    a = p.parse_args()
    a.sweep = [int(x) for x in a.sweep.split(",")]
    record = ROOT / a.record
    cells = arm_cells(a)
    with (ROOT / CONFIG).open() as f:
        recipe = yaml.safe_load(f)
    cfg = {"batch": recipe["rollout-batch-size"], "n": recipe["n-samples-per-prompt"]}
    if not a.report_only:
        if a.capacity_only or not any(r.get("kind") == "capacity" for r in load_record(record)):
            print("engine capacity on the task's lengths ...", flush=True)
            cap = engine_capacity_on_task(cfg["batch"] * cfg["n"], a.capacity_seconds)
            record.parent.mkdir(parents=True, exist_ok=True)
            with record.open("a") as f:
                f.write(json.dumps({"kind": "capacity", **cap, "inflight": cfg["batch"] * cfg["n"]}) + "\n")
        sweep_seeds = set(seeds_of(a.sweep_seeds))
        main_arms = {"sync", "one-step", f"fully-async S={a.fully_async_staleness}"}
        if a.capacity_only:
            return
        run_all([(arm, seed, extra) for seed in seeds_of(a.seeds) for name, (arm, extra) in cells.items()
                 if name in main_arms or seed in sweep_seeds], a, record)  # fmt: skip
    recs = load_record(record)
    capacity = [r for r in recs if r.get("kind") == "capacity"][-1]
    runs = [r for r in recs if "arm" in r and r["steps"] == a.steps]
    rows = {}
    for name, (arm, extra) in cells.items():
        mine = [r for r in runs if r["arm"] == arm and r["extra"] == extra]
        if mine:
            rows[name] = arm_summary(mine, a.threshold, cfg["batch"] * cfg["n"])
    print(f"\nengine capacity {capacity['samples_per_s']:.0f} samples/s, {capacity['tokens_per_s']:.0f} tokens/s "
          f"({capacity['inflight']} in flight, one pinned core)")  # fmt: skip
    sync = [r for r in runs if r["arm"] == "sync" and r["extra"] == []]
    if sync:
        train = statistics.fmean(x["train_push_s"] for x in sync)
        print(f"trainer capacity {cfg['batch'] * cfg['n'] / train:.0f} samples/s (median train + push per step, "
              f"{train:.3f} s, in the synchronous runs)")  # fmt: skip
    print(table(rows, a.threshold))
    fa = f"fully-async S={a.fully_async_staleness}"
    ratios = {}
    for other in ("one-step", "sync"):
        if fa in rows and other in rows:
            r, lo, hi = ratio_ci(rows[fa]["times"], rows[other]["times"])
            ratios[other] = [r, lo, hi]
            print(f"{fa} / {other}: time to {a.threshold} x{r:.2f} [{lo:.2f}, {hi:.2f}]")
    out = ROOT / a.out
    out.write_text(json.dumps({"steps": a.steps, "threshold": a.threshold, "capacity": capacity, "arms": rows,
                               "ratios": ratios}, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
