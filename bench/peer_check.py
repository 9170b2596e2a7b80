"""The setup check of bench/peer_trl.py, run before its figures are trusted: the warm-started model
both arms start from, sampled on the held-out prompts by asyncrl's engine path (the built-in engine
started as the launcher starts it, the producer's sampling parameters, the eval service's
generate-and-grade code) and by TRL's (GRPOTrainer's own `model.generate` with its GenerationConfig),
N completions each. Held-out reward, mean response length (tokens, EOS included on both sides), EOS
rate and truncated share are set side by side with their standard errors; the difference is taken
prompt by prompt (both sides answer the same prompts as often), and one beyond --check-sigma of its
standard errors fails the check, as does a log-probability gap between transformers' Llama and
asyncrl's model on the same weights, or sampling settings that differ.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import tempfile
import types
from pathlib import Path

METRICS = (("reward", "held-out reward"), ("len", "mean length (tokens)"), ("eos", "EOS rate"),
           ("truncated", "truncated share"))  # fmt: skip
LOGPROB_GAP_MAX = 1e-4
"""Largest |log p| difference allowed between the two models on the same weights (float32 noise is ~1e-6)."""


def rollout_params(config) -> dict:
    """The sampling parameters asyncrl's producer sends the engine with every training prompt."""
    from services.rollout.service import RolloutService

    return RolloutService.sampling_params(types.SimpleNamespace(config=config))


def engine_answers(config, model_dir: Path, rows: list[dict], n: int, seed: int) -> list[dict]:
    """n completions per row from a built-in engine serving `model_dir` (the launcher's command and
    flags), generated and graded by the eval service's generate_dataset with the producer's params."""
    from asyncrl_proto.messages import SampleStatus
    from services.common import procs
    from services.common.engine_commands import builtin_engine_command, builtin_engine_flags
    from services.common.sglang_client import SGLangClient
    from services.eval.service import generate_dataset
    from services.model.hf_io import read_config
    from services.model.tokenizer import Tokenizer
    from services.rewards import resolve_reward

    config = config.model_copy(update={"hf_checkpoint": str(model_dir)})
    eos = set(read_config(model_dir).eos_ids)
    tok, reward_fn = Tokenizer(model_dir), resolve_reward(config)
    port = procs.free_port()
    with tempfile.TemporaryDirectory(prefix="asyncrl-peer-check-") as tmp:
        cmd = builtin_engine_command(str(model_dir), port, builtin_engine_flags(config, seed, "engine-0"))
        proc = procs.spawn(cmd, log_path=Path(tmp) / "engine.log", env={**os.environ})
        try:
            procs.wait_for_port("127.0.0.1", port, 120, proc)

            async def sample():
                client = SGLangClient([f"http://127.0.0.1:{port}"])
                try:
                    return await generate_dataset(client, tok, reward_fn, config, rows, rollout_params(config), n)
                finally:
                    await client.close()

            samples = asyncio.run(sample())
        finally:
            procs.stop(proc)
    return [{"reward": s.reward, "len": s.response_length, "eos": s.status == SampleStatus.COMPLETED and
             s.tokens[-1] in eos, "truncated": s.status == SampleStatus.TRUNCATED} for s in samples]  # fmt: skip


def trl_answers(config, model_dir: Path, train_rows: list[dict], rows: list[dict], n: int, seed: int) -> tuple:
    """n completions per row by GRPOTrainer's own generation (its GenerationConfig untouched), the
    trainer built as the TRL arm builds it; with its sampling settings and the log-prob gap."""
    import trl_arm

    tokenizer = trl_arm.load_tokenizer(model_dir, rows[:256] + train_rows[:256], config)
    with tempfile.TemporaryDirectory(prefix="asyncrl-peer-check-") as tmp:
        trainer = trl_arm.make_trainer(config, model_dir, train_rows[:64], tokenizer, seed, 1, Path(tmp))
        answers = trl_arm.sample_answers(trainer, rows, n, seed)
        g = trainer.generation_config
        params = {"max_new_tokens": g.max_new_tokens, "temperature": g.temperature, "top_p": g.top_p,
                  "top_k": g.top_k or -1, "eos_token_id": sorted(trainer.eos_token_ids), "do_sample": g.do_sample}  # fmt: skip
    return answers, params, trl_arm.logprob_gap(model_dir, rows, tokenizer)


def moments(answers: list[dict]) -> dict:
    """Per metric: mean and standard error of the mean over the completions."""
    out = {}
    for key, _ in METRICS:
        xs = [float(a[key]) for a in answers]
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        out[key] = {"mean": statistics.fmean(xs), "se": sd / math.sqrt(len(xs))}
    return out


def paired(ours: list[dict], theirs: list[dict], n: int) -> dict:
    """Per metric: TRL's mean minus asyncrl's, its standard error and z. Both sides answered the same
    prompts n times each, in the same order, so the difference is taken prompt by prompt (what a
    prompt makes easy or long cancels); with one prompt, the two sides' errors are combined."""
    out = {}
    for key, _ in METRICS:
        a, t = ([float(x[key]) for x in side] for side in (ours, theirs))
        per_prompt = [statistics.fmean(t[i : i + n]) - statistics.fmean(a[i : i + n]) for i in range(0, len(a), n)]
        diff = statistics.fmean(t) - statistics.fmean(a)
        if len(per_prompt) > 1:
            se = statistics.stdev(per_prompt) / math.sqrt(len(per_prompt))
        else:
            se = math.hypot(*(moments(side)[key]["se"] for side in (ours, theirs)))
        out[key] = {"diff": diff, "se": se, "z": diff / se if se > 0 else (0.0 if diff == 0 else math.inf)}
    return out


def setup_check(config, model_dir: Path, train_rows: list[dict], samples: int, seed: int, sigma: float) -> dict:
    """Both sides' completions on the same held-out prompts (about `samples` each), compared."""
    from services.eval.datasets import load_eval_sets
    from services.model.hf_io import read_config

    [(_ds, held)] = load_eval_sets(config)  # the held-out rows as the eval service reads them
    rows = held[: min(samples, len(held))]
    n = max(1, samples // len(rows))
    engine = engine_answers(config, model_dir, rows, n, seed)
    answers, trl_params, gap = trl_answers(config, model_dir, train_rows, rows, n, seed)
    ours, theirs, diff = moments(engine), moments(answers), paired(engine, answers, n)
    p = rollout_params(config)
    engine_params = {"max_new_tokens": p["max_new_tokens"], "temperature": p["temperature"], "top_p": p["top_p"],
                     "top_k": p["top_k"], "eos_token_id": sorted(read_config(model_dir).eos_ids), "do_sample": True}  # fmt: skip
    problems = [f"{label}: {diff[key]['z']:+.1f} standard errors apart" for key, label in METRICS
                if abs(diff[key]["z"]) > sigma]  # fmt: skip
    if gap > LOGPROB_GAP_MAX:
        problems.append(f"log-prob gap {gap:.2e} between transformers' Llama and asyncrl's model > {LOGPROB_GAP_MAX:g}")
    if engine_params != trl_params:
        problems.append(f"sampling settings differ: asyncrl {engine_params}, TRL {trl_params}")
    return {"kind": "setup_check", "seed": seed, "completions": len(rows) * n, "prompts": len(rows),
            "asyncrl": ours, "trl": theirs, "diff": diff, "sigma": sigma, "logprob_gap": gap, "params": engine_params,
            "trl_params": trl_params, "problems": problems, "ok": not problems}  # fmt: skip


def check_lines(c: dict) -> list[str]:
    """The check printed: each metric on both sides with its standard error, the difference in
    standard errors, and PASS or FAIL."""
    head = (f"setup check, seed {c['seed']} ({c['job']}): the warm-started model (sha256 {c['model_sha256'][:12]}), "
            f"{c['completions']} completions of {c['prompts']} held-out prompts on each side")  # fmt: skip
    lines = [head, f"  {'':<22}{'asyncrl engine':>20}{'TRL generate':>20}{'TRL - asyncrl, paired (z)':>32}"]
    for key, label in METRICS:
        a, t, d = c["asyncrl"][key], c["trl"][key], c["diff"][key]
        cell = f"{d['diff']:+.4f} ± {d['se']:.4f} ({d['z']:+.1f})"
        flag = "ok" if abs(d["z"]) <= c["sigma"] else "FAIL"
        lines.append(
            f"  {label:<22}{a['mean']:>11.4f} ± {a['se']:.4f}{t['mean']:>11.4f} ± {t['se']:.4f}{cell:>32}  {flag}"
        )
    p = c["params"]
    lines.append(f"  sampling: max_new_tokens {p['max_new_tokens']}, temperature {p['temperature']}, top_p {p['top_p']}, "
                 f"top_k {p['top_k']}, EOS {p['eos_token_id']} (asyncrl producer; TRL's GenerationConfig "
                 f"{'the same' if c['trl_params'] == p else c['trl_params']}); log-prob gap {c['logprob_gap']:.1e}")  # fmt: skip
    lines.append(f"  setup check {'PASS' if c['ok'] else 'FAIL: ' + '; '.join(c['problems'])}"
                 f" (a difference beyond {c['sigma']:g} standard errors fails)")  # fmt: skip
    return lines
