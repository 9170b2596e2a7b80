"""asyncrl beside a peer: Hugging Face TRL's GRPOTrainer on the same job, from the same weights.

Two jobs (--job): `default`, deploy/configs/quickstart.yaml (reverse-digits, 600 steps of 16
prompts x 8 samples), and `longtail`, deploy/configs/longtail.yaml (reverse-longtail, 300 steps).
Both arms read one recipe, the RunConfig asyncrl resolves from the job's command line (batch, n,
lr, clip, entropy bonus, loss aggregation, temperature, max response length, steps; the mapping is
bench/trl_arm.py's `grpo_config`, the differences no TRL setting removes are printed with the
table), and start from one model: the task's tiny Llama, warm-started by asyncrl's own
build_task_model with the run's seed (the sha256 of asyncrl's run's initial weights is checked
against it). Prompts are the same files (bench/learning.py's training and held-out sets), tokenized
to the ids asyncrl's producer sends its engine, and both arms grade with the task's reward function.

  asyncrl  the real job through the CLI (bench/learning.py's run_one: `asyncrl train-async
           --fully-async --config JOB`), its figures read from its metrics.jsonl and eval.jsonl;
           several processes, one torch thread each (the long-tail job pins engine and trainer)
  TRL      GRPOTrainer in ONE process, unpinned, torch using both cores; the training loop's
           wall-clock from its first step to its last, the held-out evaluations (same steps,
           same prompts, same samples per prompt, TRL's own generate) stopped out of the clock

Per arm: median loop time and median step time, time to --threshold on the held-out set (median
with a 95% bootstrap interval; a run that never reaches it counts its whole loop and is censored),
final held-out reward (median and interval), and asyncrl/TRL ratios with their intervals. Per run
it keeps what tells a plateau apart: training reward, the share of groups with zero advantage (all
rewards equal), entropy and the clip fraction (TRL is strictly on-policy: its ratio is 1 and the
clip never binds; asyncrl's does while its groups are a version old).

Before a seed's runs, the setup check (bench/peer_check.py) samples the warm-started model from
both sides and fails the bench (exit 1) when they differ beyond noise. Seeds alternate the arms
(asyncrl seed 1, TRL seed 1, asyncrl seed 2, ...); every run and check is appended to --record as
it finishes and never run twice, so the bench resumes across sessions. Needs the `peer` extra.
The summary (--out) names the record it was read from. docs/bench/peer_trl_runs_stopids.jsonl holds
the default job's runs since the tiny model stops at its special tokens; the default --record holds
the long-tail runs and the default job's runs from before that.

    python bench/peer_trl.py [--job default|longtail] [--seeds 1-5] [--steps N] [--eval-interval N]
                             [--eval-prompts N] [--check-samples 1024] [--record docs/bench/peer_trl_runs.jsonl]
                             [--report-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from learning import ROOT, code_revision, load_record, run_one, seeds_of, write_data
from longtail import median_ci, ratio_ci, reach_time
from peer_check import check_lines, setup_check

JOBS = {
    "default": {"config": "deploy/configs/quickstart.yaml", "task_module": "services.tasks.reverse_digits",
                "eval_prompts": 1024, "threshold": 0.5},
    "longtail": {"config": "deploy/configs/longtail.yaml", "task_module": "services.tasks.reverse_longtail",
                 "eval_prompts": 128, "threshold": 0.3},
}  # fmt: skip
"""The jobs: config, task (its prompts and reward), held-out prompts and target (bench/learning.py's
and bench/longtail.py's)."""
ARMS = ("asyncrl", "trl")
DATA_ROOT = Path(tempfile.gettempdir()) / "asyncrl-learning-data"
MODEL_ROOT = Path(tempfile.gettempdir()) / "asyncrl-peer-trl-models"


# ---- the shared recipe and model -----------------------------------------------------------------
def job_argv(a, seed: int, data: tuple[Path, Path]) -> list[str]:
    """The asyncrl arm's training flags (bench/learning.py's run_one, without the run directory)."""
    train, held = data
    return ["--fully-async", "--config", str(ROOT / a.config), "--num-rollout", str(a.steps), "--eval-interval",
            str(a.eval_interval), "--seed", str(seed), "--rollout-seed", str(seed), "--prompt-data", str(train),
            "--eval-prompt-data", "heldout", str(held), "--n-samples-per-eval-prompt", str(a.eval_samples)]  # fmt: skip


def job_config(a, seed: int, data: tuple[Path, Path]):
    """The RunConfig the asyncrl arm's command line resolves to (the CLI's own parser)."""
    from services.cli import _resolve

    return _resolve("asyncrl train-async", job_argv(a, seed, data), sync=False)


def warm_model(config, job: str, seed: int) -> tuple[Path, str]:
    """The warm-started initial model of this job and seed, built once by asyncrl's own
    build_task_model (the launcher's: the task's tiny Llama, --seed, --warmup-sft-steps); its sha256."""
    from services.prepare import build_task_model

    out = MODEL_ROOT / job / f"seed{seed}-sft{config.data.warmup_sft_steps}"
    if not (out / ".complete").exists():
        build_task_model(config, out, log=lambda m: print(f"  {m}", flush=True))
    return out, json.loads((out / ".complete").read_text())["sha256"]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- the arms ----------------------------------------------------------------------------------
def _per_step(recs: list[dict], batch: int) -> list[dict]:
    """asyncrl's per-step figures under the TRL record's names."""
    out = []
    for r in recs:
        zero = sum(v for k, v in r.items() if k.startswith("rollout/zero_std/count_"))
        out.append({"step": r["step"] + 1, "reward": r.get("rollout/reward/mean"), "zero_adv": zero / batch,
                    "len": r.get("rollout/response_length/mean"), "entropy": r.get("train/entropy"),
                    "clipfrac": r.get("train/pg_clipfrac"), "grad_norm": r.get("train/grad_norm"),
                    "staleness": r.get("rollout/fully_async/avg_staleness")})  # fmt: skip
    return out


def run_asyncrl(a, seed: int, data: tuple[Path, Path], config) -> dict:
    """The real job through the CLI (bench/learning.py's run_one), plus its step time (the median
    wall-clock between the trainer's step records: as TRL's, generation included), per-step clip
    fraction and zero-advantage groups, and the sha256 of the initial weights it built."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-peer-") as tmp:
        run_dir = Path(tmp) / "run"
        res = run_one("fully-async", seed, a.steps, [], a, data, run_dir)
        recs = read_rows(run_dir / "metrics.jsonl")
        sha = json.loads((run_dir / "model" / "initial" / ".complete").read_text())["sha256"]
    trace = _per_step(recs, config.rollout.batch_size)
    clip = [t["clipfrac"] for t in trace if t["clipfrac"] is not None]
    res.pop("trace", None)
    elapsed = [0.0] + [r["perf/elapsed_s"] for r in recs]  # each step's wall-clock, its wait for rollouts included
    steps = [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)]
    return {**res, "step_time_s": statistics.median(steps), "model_sha256": sha,
            "train_step_s": statistics.median(r["perf/step_time_s"] for r in recs),
            "zero_adv_mean": statistics.fmean(t["zero_adv"] for t in trace),
            "clipfrac_mean": statistics.fmean(clip) if clip else None, "trace": trace}  # fmt: skip


def run_trl(a, seed: int, data: tuple[Path, Path], config, model: Path, sha: str) -> dict:
    import trl_arm

    from services.eval.datasets import load_eval_sets

    [(ds, _rows)] = load_eval_sets(config)
    res = trl_arm.run_trl(config, model, read_rows(data[0]), read_rows(data[1]), ds.sampling_params(), seed, a.steps,
                          a.eval_interval, a.eval_samples)  # fmt: skip
    return {**res, "model_sha256": sha}


def run_key(r: dict) -> str:
    return json.dumps([r.get("kind", "run"), r["job"], r.get("arm"), r["seed"], r.get("steps"), r.get("eval_interval"),
                       r.get("eval_prompts"), r.get("eval_samples"), r.get("completions_wanted")])  # fmt: skip


def cell(a, kind: str, seed: int, arm: str | None = None) -> dict:
    """The identity of a run (or check) in the record."""
    if kind == "setup_check":
        return {"kind": kind, "job": a.job, "seed": seed, "completions_wanted": a.check_samples,
                "eval_prompts": a.eval_prompts}  # fmt: skip
    return {"kind": "run", "job": a.job, "arm": arm, "seed": seed, "steps": a.steps, "eval_interval": a.eval_interval,
            "eval_prompts": a.eval_prompts, "eval_samples": a.eval_samples}  # fmt: skip


def append(record: Path, res: dict) -> None:
    record.parent.mkdir(parents=True, exist_ok=True)
    with record.open("a") as f:
        f.write(json.dumps(res) + "\n")


def run_seed(a, seed: int, data: tuple[Path, Path], record: Path, done: set[str]) -> bool:
    """The setup check (unless recorded), then each arm not yet recorded, in --arms order;
    False when the check failed (and --ignore-check is not set): the arms are not run."""
    config = job_config(a, seed, data)
    if "trl" in a.arms or a.check_samples:
        import trl_arm

        trl_arm.check_supported(config)  # a recipe TRL cannot reproduce stops here, before any run
    model, sha = warm_model(config, a.job, seed)
    rev = code_revision()
    key = cell(a, "setup_check", seed)
    checks = [c for c in load_record(record) if c.get("kind") == "setup_check" and run_key(c) == run_key(key)]
    if a.check_samples and not checks:
        print(f"seed {seed}: setup check, {a.check_samples} completions a side ...", flush=True)
        c = setup_check(config, model, read_rows(data[0]), a.check_samples, seed, a.check_sigma)
        checks = [{**c, **key, "model_sha256": sha, "rev": rev, "finished_at": time.time()}]
        append(record, checks[0])
        print("\n".join(check_lines(checks[0])), flush=True)
    if checks and not checks[-1]["ok"] and not a.ignore_check:
        return False
    for arm in a.arms:
        key = cell(a, "run", seed, arm)
        if run_key(key) in done:
            continue
        t0, load = time.time(), os.getloadavg()[0]
        print(f"seed {seed}: {arm}, {a.steps} steps ...", flush=True)
        res = run_asyncrl(a, seed, data, config) if arm == "asyncrl" else run_trl(a, seed, data, config, model, sha)
        res["trace"] = [{k: round(v, 5) if isinstance(v, float) else v for k, v in t.items()} for t in res["trace"]]
        res = {**res, **key, "rev": rev, "finished_at": time.time(), "model_expected_sha256": sha, "load_before": load}
        append(record, res)
        print(f"  {arm} seed {seed}: final {res['points'][-1][2]:.3f}, loop {res['loop_wall_s']:.0f} s, step "
              f"{res['step_time_s']:.3f} s, {time.time() - t0:.0f} s in all", flush=True)  # fmt: skip
    return True


# ---- the report --------------------------------------------------------------------------------
def summary(runs: list[dict], threshold: float) -> dict:
    reach = [reach_time(r, threshold) for r in runs]
    loops = [r["loop_wall_s"] for r in runs]
    finals = [r["points"][-1][2] for r in runs]
    return {"n": len(runs), "loop_s": statistics.median(loops), "loop_ci95": median_ci(loops), "loops": loops,
            "step_s": statistics.median(r["step_time_s"] for r in runs),
            "reach": [t for t, _ in reach], "censored": sum(c for _, c in reach),
            "reach_s": statistics.median(t for t, _ in reach), "reach_ci95": median_ci([t for t, _ in reach]),
            "final": statistics.median(finals), "final_ci95": median_ci(finals), "finals": finals}  # fmt: skip


def table(rows: dict[str, dict], threshold: float) -> list[str]:
    lines = [f"{'arm':<9}{'n':>3}{'loop s median [95% CI]':>26}{'step s':>9}{'s to ' + str(threshold) + ' [95% CI]':>24}"
             f"{'cens':>6}{'final reward median [95% CI]':>32}"]  # fmt: skip
    for arm, s in rows.items():
        loop = f"{s['loop_s']:.1f} [{s['loop_ci95'][0]:.1f}, {s['loop_ci95'][1]:.1f}]"
        reach = f"{s['reach_s']:.1f} [{s['reach_ci95'][0]:.1f}, {s['reach_ci95'][1]:.1f}]"
        final = f"{s['final']:.3f} [{s['final_ci95'][0]:.3f}, {s['final_ci95'][1]:.3f}]"
        lines.append(
            f"{arm:<9}{s['n']:>3}{loop:>26}{s['step_s']:>9.3f}{reach:>24}{s['censored']:>4}/{s['n']}{final:>32}"
        )
    return lines


def _mean(trace: list[dict], key: str, lo: float, hi: float) -> float | None:
    """The mean of `key` over the trace's steps in the fraction [lo, hi) of the run."""
    part = trace[int(lo * len(trace)) : max(int(hi * len(trace)), int(lo * len(trace)) + 1)]
    vals = [t[key] for t in part if t.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def plateau_lines(runs: list[dict]) -> list[str]:
    """Per run, what tells a plateau apart: training reward and zero-advantage groups over the last
    quarter, entropy at the start and the end, the clip fraction over the first tenth and the run."""
    f = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"{'arm':<9}{'seed':>5}{'final':>7}{'train reward 1st/last q':>25}{'zero-adv groups last q':>24}"
             f"{'entropy 1st/last q':>20}{'clip frac 1st 10%/all':>23}{'len last q':>11}"]  # fmt: skip
    for r in sorted(runs, key=lambda r: (r["seed"], r["arm"])):
        t = r.get("trace", [])
        reward = f"{f(_mean(t, 'reward', 0, 0.25))} / {f(_mean(t, 'reward', 0.75, 1))}"
        ent = f"{f(_mean(t, 'entropy', 0, 0.25), '.2f')} / {f(_mean(t, 'entropy', 0.75, 1), '.2f')}"
        clip = f"{f(_mean(t, 'clipfrac', 0, 0.1))} / {f(_mean(t, 'clipfrac', 0, 1))}"
        lines.append(f"{r['arm']:<9}{r['seed']:>5}{r['points'][-1][2]:>7.3f}{reward:>25}"
                     f"{f(_mean(t, 'zero_adv', .75, 1), '.1%'):>24}{ent:>20}{clip:>23}{f(_mean(t, 'len', .75, 1), '.1f'):>11}")  # fmt: skip
    return lines


def how_lines(runs: list[dict], config_path: str) -> list[str]:
    with (ROOT / config_path).open() as fh:
        recipe = yaml.safe_load(fh)
    trl = [r for r in runs if r["arm"] == "trl"]
    pinned = "engine and trainer pinned to separate cores" if recipe.get("pin-cpus") else "unpinned"
    out = [f"asyncrl: the CLI's fully async job, several processes with one torch thread each, {pinned}; its loop "
           "time holds its eval service's share of the CPU (it evaluates beside training)"]  # fmt: skip
    if trl:
        threads = sorted({r["torch_threads"] for r in trl})
        evals = statistics.median(r["eval_s"] for r in trl)
        out.append(f"TRL: GRPOTrainer in ONE process, unpinned, torch threads {threads} (both cores), strictly "
                   f"on-policy; its loop time leaves out its held-out evaluations ({evals:.0f} s a run, median)")  # fmt: skip
        out += ["not matched: " + n for n in trl[-1]["unmatched"]]
    return out


def check_failures(record: list[dict], a, seeds: list[int]) -> list[dict]:
    return [c for c in record if c.get("kind") == "setup_check" and c["job"] == a.job and c["seed"] in seeds
            and c.get("eval_prompts") == a.eval_prompts and not c["ok"]]  # fmt: skip


def report(a, record: Path, seeds: list[int]) -> int:
    recs = load_record(record)
    want = {k: v for k, v in cell(a, "run", 0, "x").items() if k not in ("arm", "seed")}
    runs = [r for r in recs if r.get("kind") == "run" and r["seed"] in seeds and r["arm"] in a.arms
            and all(r.get(k) == v for k, v in want.items())]  # fmt: skip
    print(f"\njob {a.job} ({a.config}): {a.steps} steps, evaluated every {a.eval_interval} steps on {a.eval_prompts} "
          f"held-out prompts x {a.eval_samples} samples, target {a.threshold}, seeds {a.seeds}")  # fmt: skip
    rows = {arm: summary([r for r in runs if r["arm"] == arm], a.threshold) for arm in a.arms
            if any(r["arm"] == arm for r in runs)}  # fmt: skip
    print("\n".join(table(rows, a.threshold)) if rows else "no runs recorded for these settings")
    ratios = {}
    if {"asyncrl", "trl"} <= rows.keys():
        for name, key in (("loop time", "loops"), (f"time to {a.threshold}", "reach")):
            ratios[name] = ratio_ci(rows["asyncrl"][key], rows["trl"][key])
            r, lo, hi = ratios[name]
            print(f"asyncrl / TRL {name}: x{r:.2f} [{lo:.2f}, {hi:.2f}]")
    for line in how_lines(runs, a.config) if runs else []:
        print(line)
    if busy := [r for r in runs if r.get("load_before", 0.0) > a.max_load]:
        print(f"WARNING: {len(busy)} of {len(runs)} runs started with other work on the machine (1-minute load up to "
              f"{max(r['load_before'] for r in busy):.1f}): their times are not comparable, and TRL's two torch threads "
              "lose most to a busy core")  # fmt: skip
    weights = [r for r in runs if r.get("model_sha256") != r.get("model_expected_sha256")]
    for r in weights:
        print(f"FAIL: {r['arm']} seed {r['seed']} started from weights {r['model_sha256'][:12]}, not the shared "
              f"{r['model_expected_sha256'][:12]}")  # fmt: skip
    if runs:
        print("\nper run (the plateau question: groups without advantage, entropy, clip):")
        print("\n".join(plateau_lines(runs)))
    checks = [c for c in recs if c.get("kind") == "setup_check" and c["job"] == a.job and c["seed"] in seeds
              and c.get("eval_prompts") == a.eval_prompts]  # fmt: skip
    for c in checks:
        print("\n" + "\n".join(check_lines(c)))
    out = ROOT / a.out.format(job=a.job)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"job": a.job, "record": a.record, "steps": a.steps, "threshold": a.threshold, "arms": rows,
                               "ratios": ratios}, indent=2) + "\n")  # fmt: skip
    return 1 if weights or check_failures(recs, a, seeds) else 0


# ---- main --------------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=sorted(JOBS), default="default")
    p.add_argument("--arms", default="asyncrl,trl", help="asyncrl,trl (each seed runs them in this order)")
    p.add_argument("--seeds", default="1-5", help="1-5 or 1,2,5")
    p.add_argument("--steps", type=int, default=None, help="default: the job config's num-rollout")
    p.add_argument("--eval-interval", type=int, default=None, help="default: the job config's eval-interval")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default: 1024; longtail 128)")
    p.add_argument("--eval-samples", type=int, default=2, help="samples per held-out prompt")
    p.add_argument("--threshold", type=float, default=None, help="target held-out reward (default 0.5; longtail 0.3)")
    p.add_argument("--check-samples", type=int, default=1024, help="setup check: completions a side (0: no check)")
    p.add_argument("--check-sigma", type=float, default=3.0, help="setup check: standard errors a difference may reach")
    p.add_argument("--ignore-check", action="store_true", help="run the arms even when the setup check fails")
    p.add_argument(
        "--max-load",
        type=float,
        default=0.5,
        help="a run started above this 1-minute load average is flagged as timed on a busy machine",
    )
    p.add_argument("--record", default="docs/bench/peer_trl_runs.jsonl")
    p.add_argument("--out", default="docs/bench/peer_trl_{job}.json")
    p.add_argument("--report-only", action="store_true", help="summarize the record, run nothing")
    a = p.parse_args(argv)
    job = JOBS[a.job]
    with (ROOT / job["config"]).open() as fh:
        recipe = yaml.safe_load(fh)
    a.config, a.task_module = job["config"], job["task_module"]
    a.steps = a.steps or recipe["num-rollout"]
    a.eval_interval = a.eval_interval or recipe.get("eval-interval") or 50
    a.eval_prompts = a.eval_prompts or job["eval_prompts"]
    a.threshold = job["threshold"] if a.threshold is None else a.threshold
    a.arms = a.arms.split(",")
    if unknown := set(a.arms) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}: use {', '.join(ARMS)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    record, seeds = ROOT / a.record, seeds_of(a.seeds)
    if not a.report_only:
        data = write_data(DATA_ROOT, a.eval_prompts, a.task_module)
        for seed in seeds:  # seed-major: the arms alternate
            done = {run_key(r) for r in load_record(record) if "job" in r}
            if not run_seed(a, seed, data, record, done):
                print(f"seed {seed}: the setup check failed; no figures of this seed are run (--ignore-check runs "
                      "them anyway)", flush=True)  # fmt: skip
                break
    return report(a, record, seeds)


if __name__ == "__main__":
    sys.exit(main())
