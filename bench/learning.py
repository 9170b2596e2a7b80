"""Learning benchmark with error bars: the quickstart task and step budget in sync, one-step async
and fully async, at least 8 seeds each, through the real CLI.

Per arm it reports the mean final held-out reward with a 95% bootstrap interval, the stall rate
(the share of runs gaining less than --stall-gain over their step-0 evaluation), the median
wall-clock of the training loop to --threshold, and the staleness the runs actually had. The
held-out set (--eval-prompts prompts, disjoint from the training prompts, --eval-samples samples
each) is sized so that evaluating the same weights twice differs by less than 0.01: the bench
measures that on the initial model with the eval service's own code and prints it.

Each run keeps a trace of what tells a stall apart (entropy, advantage magnitude, gradient norm,
clip fraction, the shares of all-0 and all-1 groups, about 40 points). Each finished run is
appended to --record at once, and a run already recorded (same arm, seed,
steps and extra arguments) is not run again: a long benchmark resumes where it stopped, across
sessions. bench/staleness.py runs its sweep through the same functions.

    python bench/learning.py [--arms sync,one-step,fully-async] [--seeds 1-8] [--steps 300]
                             [--record docs/bench/learning_runs.jsonl] [--report-only] [-- EXTRA CLI ARGS]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from services.dashboard.diagnosis import WINDOW, diagnose

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "sync": ["train", "--no-fully-async"],
    "one-step": ["train-async", "--no-fully-async"],
    "fully-async": ["train-async", "--fully-async"],
}
EVAL_NAME = "heldout"
TRACE = ("rollout/reward/mean", "train/entropy", "train/advantage_abs_mean", "train/grad_norm", "train/pg_clipfrac",
         "rollout/zero_std/all_zero_percentage", "rollout/zero_std/all_one_percentage",
         "rollout/response_len/mean", "train/ppo_kl")  # fmt: skip
"""Per-step metrics kept with each run (about 40 points): what tells a stall apart."""


# ---- data --------------------------------------------------------------------------------------
def write_data(root: Path, eval_prompts: int, task_module: str = "services.tasks.reverse_digits") -> tuple[Path, Path]:
    """Training prompts and a larger held-out set, disjoint, in the task's format."""
    task = importlib.import_module(task_module)
    root = root / task.NAME
    root.mkdir(parents=True, exist_ok=True)
    train, held = root / f"train_without_heldout_{eval_prompts}.jsonl", root / f"heldout_{eval_prompts}.jsonl"
    if not (train.exists() and held.exists()):
        eval_rows = task.make_rows(eval_prompts, seed=999)
        train_rows = task.make_rows(task.NUM_TRAIN_PROMPTS, seed=0, exclude={r["label"][::-1] for r in eval_rows})
        for path, rows in ((train, train_rows), (held, eval_rows)):
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train, held


# ---- one run -----------------------------------------------------------------------------------
def run_key(arm: str, seed: int, steps: int, extra: list[str]) -> str:
    return json.dumps([arm, seed, steps, extra])


def run_one(arm: str, seed: int, steps: int, extra: list[str], a, data: tuple[Path, Path], run_dir: Path) -> dict:
    """One run through the CLI; its held-out curve (step, loop seconds, reward) and facts."""
    train, held = data
    cmd = [sys.executable, "-m", "services.cli", *ARMS[arm], "--config", str(ROOT / a.config),
           "--num-rollout", str(steps), "--eval-interval", str(a.eval_interval), "--seed", str(seed),
           "--rollout-seed", str(seed), "--run-dir", str(run_dir), "--prompt-data", str(train),
           "--eval-prompt-data", EVAL_NAME, str(held), "--n-samples-per-eval-prompt", str(a.eval_samples),
           *extra]  # fmt: skip
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = EngineSampler(run_dir, proc)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} failed ({' '.join(cmd[3:])}):\n{out[-3000:]}\n{err[-3000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    start = recs[0]["time"] - recs[0]["perf/elapsed_s"]  # the training loop's start
    at = {rec["step"] + 1: rec["time"] - start for rec in recs}
    at[0] = 0.0
    points = sorted((e["step"], at.get(e["step"], 0.0), e[f"eval/{EVAL_NAME}"]) for e in evals
                    if f"eval/{EVAL_NAME}" in e)  # fmt: skip
    every = max(1, steps // 40)  # the stall diagnostics, about 40 points per run
    trace = [{k: rec[k] for k in TRACE if k in rec} | {"step": rec["step"]} for rec in recs[::every]]
    stale = [rec["rollout/fully_async/avg_staleness"] for rec in recs if "rollout/fully_async/avg_staleness" in rec]
    stale_max = [rec["rollout/fully_async/max_staleness"] for rec in recs if "rollout/fully_async/max_staleness" in rec]
    said = diagnose(recs, json.loads((run_dir / "config.json").read_text()))  # the run's advice, as status shows it
    window = recs[-WINDOW:]  # the steps the advice reads, and the engine over the same seconds
    at_engine = sampler.facts(window[0]["time"], window[-1]["time"], len(window) - 1)
    return {**loop_facts(recs, evals), **sampler.facts(start, recs[-1]["time"], len(recs)), "arm": arm, "seed": seed, "steps": steps, "extra": extra, "points": points,
            "diagnosis": [said.kind, said.line], "window_engine_idle_share": at_engine.get("engine_idle_share"),
            "loop_wall_s": recs[-1]["perf/elapsed_s"], "run_wall_s": time.time() - t0,
            "staleness_mean": statistics.mean(stale) if stale else 0.0, "staleness_max": max(stale_max, default=0),
            "trace": trace, "finished_at": time.time()}  # fmt: skip


class EngineSampler(threading.Thread):
    """Reads the run's engine's `sglang:num_running_reqs` every SAMPLE_S while the run lives: how
    full the engine's batch is over the training loop, measured at the engine."""

    SAMPLE_S = 0.05

    def __init__(self, run_dir: Path, proc: subprocess.Popen):
        super().__init__(daemon=True)
        self.run_dir, self.proc, self.samples = run_dir, proc, []

    def run(self) -> None:
        url = None
        while self.proc.poll() is None:
            time.sleep(self.SAMPLE_S)  # a sampling period, not a synchronisation: the run goes on without it
            if url is None:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    url = json.loads((self.run_dir / "services.json").read_text())["engine-0"] + "/metrics"
                continue
            with contextlib.suppress(OSError, ValueError):
                text = urllib.request.urlopen(url, timeout=2).read().decode()
                running = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                               if line.startswith("sglang:num_running_reqs"))  # fmt: skip
                self.samples.append((time.time(), running))

    def facts(self, start: float, end: float, steps: int) -> dict:
        """Over the loop [start, end]: the engine's mean batch (requests running), the share of the
        time it ran none, and the share it ran at most a tenth of its peak batch (the stragglers of a
        batch, while the rest waits for them), in seconds per step."""
        xs = [r for t, r in self.samples if start <= t <= end]
        if not xs:
            return {}
        peak = max(xs)
        tail = sum(0 < r <= 0.1 * peak for r in xs) / len(xs)
        return {"engine_running_mean": statistics.fmean(xs), "engine_running_peak": peak,
                "engine_idle_share": sum(r == 0 for r in xs) / len(xs), "engine_tail_share": tail,
                "engine_tail_s_per_step": tail * (end - start) / steps}  # fmt: skip


def loop_facts(recs: list[dict], evals: list[dict]) -> dict:
    """Where a run's loop time went: samples and response tokens trained per second, the share
    of the loop the trainer waited for batches, each step's generation time (its first get to its
    complete lease) and its response tokens, and the held-out response lengths (median, p99) at
    the first and the last evaluation."""
    loop = recs[-1]["perf/elapsed_s"]
    tokens = [r["rollout/num_samples"] * r["rollout/response_length/mean"] for r in recs]
    held = [e for e in evals if f"eval/{EVAL_NAME}/response_len/p99" in e]
    lengths = {f"{when}_len_{stat}": held[i][f"eval/{EVAL_NAME}/response_len/{stat}"]
               for when, i in (("first", 0), ("last", -1)) for stat in ("median", "p99")} if held else {}  # fmt: skip
    return {"samples_per_s": sum(r["rollout/num_samples"] for r in recs) / loop, "tokens_per_s": sum(tokens) / loop,
            "trainer_idle": sum(r["perf/rollout_wait_s"] for r in recs) / loop,
            "rollout_time": [r.get("perf/rollout_time", 0.0) for r in recs], "step_tokens": tokens,
            "train_push_s": statistics.median(r["perf/train_time_s"] + r["perf/weight_push_s"] for r in recs),
            **lengths}  # fmt: skip


def load_record(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def code_revision() -> str | None:
    """The commit the runs measure (with "+dirty" when the tree has changes), so a record that
    spans sessions says which code each run had; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def run_all(cells: list[tuple[str, int, list[str]]], a, record: Path) -> None:
    """Run every (arm, seed, extra) not yet in the record, appending each as it finishes."""
    done = {run_key(r["arm"], r["seed"], r["steps"], r["extra"]) for r in load_record(record) if "arm" in r}
    todo = [c for c in cells if run_key(c[0], c[1], a.steps, c[2]) not in done]
    print(f"{len(cells) - len(todo)} of {len(cells)} runs already recorded in {record}; {len(todo)} to go", flush=True)
    data = write_data(Path(tempfile.gettempdir()) / "asyncrl-learning-data", a.eval_prompts, a.task_module)
    rev = code_revision()
    for i, (arm, seed, extra) in enumerate(todo, 1):
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="asyncrl-learning-") as tmp:
            res = run_one(arm, seed, a.steps, extra, a, data, Path(tmp) / "run")
        res["rev"] = rev
        record.parent.mkdir(parents=True, exist_ok=True)
        with record.open("a") as f:
            f.write(json.dumps(res) + "\n")
        gain = res["points"][-1][2] - res["points"][0][2]
        print(f"  [{i}/{len(todo)}] {arm:<11} seed {seed} {' '.join(extra):<40} final {res['points'][-1][2]:.3f} "
              f"(gain {gain:+.3f}) in {time.time() - t0:.0f} s", flush=True)  # fmt: skip


# ---- statistics --------------------------------------------------------------------------------
def bootstrap_ci(values: list[float], n: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def time_to(points: list, threshold: float) -> float | None:
    return next((t for _step, t, reward in points if reward >= threshold), None)


def summarize(runs: list[dict], threshold: float, stall_gain: float) -> dict:
    finals = [r["points"][-1][2] for r in runs]
    gains = [r["points"][-1][2] - r["points"][0][2] for r in runs]
    reach = [time_to(r["points"], threshold) for r in runs]
    lo, hi = bootstrap_ci(finals)
    reached = [t for t in reach if t is not None]
    return {"n": len(runs), "final_mean": statistics.fmean(finals), "final_ci95": [lo, hi],
            "final_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0, "gain_mean": statistics.fmean(gains),
            "stall_rate": sum(g < stall_gain for g in gains) / len(gains), "stalled_seeds":
            [r["seed"] for r, g in zip(runs, gains, strict=True) if g < stall_gain],
            "reached_threshold": len(reached), "median_s_to_threshold": statistics.median(reached) if reached else None,
            "loop_wall_s_mean": statistics.fmean(r["loop_wall_s"] for r in runs),
            "staleness_mean": statistics.fmean(r["staleness_mean"] for r in runs),
            "staleness_max": max(r["staleness_max"] for r in runs)}  # fmt: skip


def table(rows: dict[str, dict], threshold: float, stall_gain: float) -> str:
    head = (f"{'arm':<34}{'n':>3}{'final reward (95% CI)':>26}{'stalls':>8}{'median s to ' + str(threshold):>20}"
            f"{'loop s':>8}{'staleness mean (max)':>22}")  # fmt: skip
    lines = [head]
    for name, s in rows.items():
        ci = f"{s['final_mean']:.3f} [{s['final_ci95'][0]:.3f}, {s['final_ci95'][1]:.3f}]"
        reach = (
            "-"
            if s["median_s_to_threshold"] is None
            else f"{s['median_s_to_threshold']:.0f} ({s['reached_threshold']}/{s['n']})"
        )
        lines.append(f"{name:<34}{s['n']:>3}{ci:>26}{s['stall_rate']:>7.0%} {reach:>19}{s['loop_wall_s_mean']:>8.0f}"
                     f"{s['staleness_mean']:>15.2f} ({s['staleness_max']})")  # fmt: skip
    lines.append(f"stall: a gain below {stall_gain} over the step-0 evaluation")
    return "\n".join(lines)


def stall_evidence(runs: list[dict], stall_gain: float) -> str:
    """The trace of stalled runs beside the others: each diagnostic's mean over the last quarter of
    the run (a stall shows there: entropy collapsed, groups all 0 or all 1, no advantage left)."""
    if not any("trace" in r for r in runs):
        return ""

    def late(r: dict, key: str) -> float | None:
        points = [t[key] for t in r.get("trace", [])[-max(1, len(r.get("trace", [])) // 4) :] if key in t]
        return statistics.fmean(points) if points else None

    def gain(r: dict) -> float:
        return r["points"][-1][2] - r["points"][0][2]

    groups = {
        "stalled": [r for r in runs if gain(r) < stall_gain],
        "learned": [r for r in runs if gain(r) >= stall_gain],
    }
    lines = [f"{'last quarter of the run, mean':<40}" + "".join(f"{k + f' ({len(v)})':>16}" for k, v in groups.items())]
    for key in TRACE:
        cells = []
        for rs in groups.values():
            vals = [v for r in rs if (v := late(r, key)) is not None]
            cells.append(f"{statistics.fmean(vals):>16.3f}" if vals else f"{'-':>16}")
        lines.append(f"{key:<40}" + "".join(cells))
    return "\n".join(lines)


# ---- evaluation noise --------------------------------------------------------------------------
def eval_noise(a, held: Path) -> dict:
    """The same weights (the warm-started initial model) evaluated twice by the eval service's own
    code on a built-in engine: the held-out figure's noise, to compare with the gaps measured."""
    from services.common import procs
    from services.common.config_load import resolve_config
    from services.rewards import resolve_reward
    from services.common.sglang_client import SGLangClient
    from services.eval.datasets import load_eval_sets
    from services.eval.service import evaluate_dataset
    from services.model.tokenizer import Tokenizer
    from services.tasks import reverse_digits as task

    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-evalnoise-"))
    model = tmp / "model"
    task.build_model(model, log=lambda *_: None)
    config = resolve_config({"hf_checkpoint": str(model), "eval_prompt_data": [EVAL_NAME, str(held)],
                             "n_samples_per_eval_prompt": a.eval_samples},
                            str(ROOT / "deploy/configs/quickstart.yaml"))  # fmt: skip
    [(ds, rows)] = load_eval_sets(config)
    reward_fn = resolve_reward(config.model_copy(update={"rm_type": ds.rm_type}) if ds.rm_type else config)
    port = procs.free_port()
    proc = procs.spawn([sys.executable, "-m", "services.engine", "--model-path", str(model), "--port", str(port)],
                       log_path=tmp / "engine.log", env={**os.environ})  # fmt: skip
    try:
        procs.wait_for_port("127.0.0.1", port, 120, proc)
        tok = Tokenizer(model)

        async def repeated() -> list[float]:
            client = SGLangClient([f"http://127.0.0.1:{port}"])
            try:
                out = []
                for i in range(a.eval_noise_repeats):
                    m = await evaluate_dataset(client, tok, reward_fn, config, EVAL_NAME, rows, ds.sampling_params(),
                                               a.eval_samples)  # fmt: skip
                    out.append(m[f"eval/{EVAL_NAME}"])
                    print(f"  eval noise: evaluation {i + 1} of {a.eval_noise_repeats}: {out[-1]:.4f}", flush=True)
                return out
            finally:
                await client.close()

        values = asyncio.run(repeated())
    finally:
        procs.stop(proc)
    diffs = [abs(x - y) for i, x in enumerate(values) for y in values[i + 1 :]]
    sd = statistics.stdev(values)
    return {"kind": "eval_noise", "eval_prompts": a.eval_prompts, "eval_samples": a.eval_samples, "values": values,
            "first": values[0], "second": values[1], "abs_diff": diffs[0], "sd": sd,
            "pair_diff_mean": statistics.fmean(diffs), "pair_diff_max": max(diffs),
            "pair_diff_95": 1.96 * 2**0.5 * sd}  # fmt: skip


def eval_noise_line(n: dict) -> str:
    """What the record says of the held-out figure's own noise."""
    if "values" not in n:  # an older record: one pair
        return (f"eval noise: the same weights evaluated twice on {n['eval_prompts']} prompts x {n['eval_samples']} "
                f"samples: {n['first']:.4f} and {n['second']:.4f} (differ by {n['abs_diff']:.4f})")  # fmt: skip
    return (f"eval noise: the same weights evaluated {len(n['values'])} times on {n['eval_prompts']} prompts x "
            f"{n['eval_samples']} samples: SD {n['sd']:.4f}; two evaluations differ by {n['pair_diff_mean']:.4f} on "
            f"average (largest of the {len(n['values']) * (len(n['values']) - 1) // 2} pairs {n['pair_diff_max']:.4f}; "
            f"95% of pairs by less than {n['pair_diff_95']:.4f}, from the SD)")  # fmt: skip


# ---- main --------------------------------------------------------------------------------------
def seeds_of(spec: str) -> list[int]:
    if "-" in spec:
        lo, hi = spec.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in spec.split(",")]


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", default="1-8", help="1-8 or 1,2,5")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-prompts", type=int, default=1024)
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--threshold", type=float, default=0.5, help="held-out reward whose wall-clock is reported")
    p.add_argument("--stall-gain", type=float, default=0.1)
    p.add_argument("--report-only", action="store_true", help="summarize the record, run nothing")
    p.add_argument("--config", default="deploy/configs/quickstart.yaml", help="every run's --config")
    p.add_argument("--task-module", default="services.tasks.reverse_digits",
                   help="the task whose training and held-out prompts the runs get")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="sync,one-step,fully-async")
    p.add_argument("--record", default="docs/bench/learning_runs.jsonl")
    p.add_argument("--out", default="docs/bench/learning.json")
    p.add_argument("--skip-eval-noise", action="store_true")
    p.add_argument("--eval-noise-repeats", type=int, default=6,
                   help="evaluations of the same weights that measure the held-out figure's noise")
    p.add_argument("--eval-noise-only", action="store_true", help="measure the eval noise (if not recorded), run nothing else")
    add_common(p)
    a, extra = p.parse_known_args()
    if a.eval_noise_repeats < 2:
        p.error("--eval-noise-repeats must be at least 2 (a difference needs two evaluations)")
    extra = [x for x in extra if x != "--"]
    record = ROOT / a.record
    arms = a.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        raise SystemExit(f"unknown arms {sorted(unknown)}: use {', '.join(ARMS)}")
    if not a.report_only:
        if not a.skip_eval_noise and not any(
            r.get("kind") == "eval_noise" and r["eval_prompts"] == a.eval_prompts and r["eval_samples"] == a.eval_samples
            and len(r.get("values", [0, 0])) >= a.eval_noise_repeats for r in load_record(record)
        ):  # fmt: skip
            _, held = write_data(Path(tempfile.gettempdir()) / "asyncrl-learning-data", a.eval_prompts)
            noise = eval_noise(a, held)
            with record.open("a") as f:
                f.write(json.dumps(noise) + "\n")
        if not a.eval_noise_only:
            seeds = seeds_of(a.seeds)
            run_all([(arm, seed, extra) for seed in seeds for arm in arms], a, record)  # seed-major: arms side by side
    runs = [r for r in load_record(record) if r.get("arm") in arms and r["steps"] == a.steps and r["extra"] == extra]
    rows = {arm: summarize([r for r in runs if r["arm"] == arm], a.threshold, a.stall_gain)
            for arm in arms if any(r["arm"] == arm for r in runs)}  # fmt: skip
    print("\n" + table(rows, a.threshold, a.stall_gain))
    if evidence := stall_evidence(runs, a.stall_gain):
        print("\nwhat tells a stall apart (every arm's runs):\n" + evidence)
    for n in (r for r in load_record(record) if r.get("kind") == "eval_noise"):
        print(eval_noise_line(n))
    out = ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": a.steps, "extra": extra, "arms": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
