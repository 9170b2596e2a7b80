"""The TRL arm of bench/peer_trl.py: Hugging Face TRL's GRPOTrainer on an asyncrl job's recipe,
model, prompts and reward, timed the way the asyncrl arm is read (the training loop's wall-clock,
held-out evaluations left out of it), and TRL's generation path for the setup check.

Needs the `peer` extra (pip install 'asyncrl[peer]': trl, which brings transformers, accelerate
and datasets); nothing here is imported by asyncrl itself.

What maps to what (`grpo_config`), and what TRL cannot match (`UNMATCHED`, printed with every
table): the job's RunConfig is resolved from the same command line the asyncrl arm runs, so both
arms read one recipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import PrinterCallback, TrainerCallback
from transformers.utils import logging as hf_logging

from asyncrl_proto.messages import Sample, SampleStatus
from services.rewards import resolve_reward, score_sample

UNMATCHED = (
    "off-policy data: TRL's GRPOTrainer generates each batch with the weights it then trains (strictly on-policy, "
    "num_iterations=1), so its PPO ratio is exactly 1 and the clip (epsilon) never binds; asyncrl trains groups "
    "up to --max-weight-staleness versions old against the engine's log-probs, where the clip does bind",
    "advantage scale: TRL divides by the group's sample std (Bessel) + 1e-4, asyncrl by the population std + 1e-6: "
    "TRL's advantages are sqrt(n/(n-1)) smaller (x0.935 at n=8), which Adam mostly absorbs but which weighs the "
    "entropy bonus about 7% more against the policy term",
)
"""Differences no GRPOConfig field removes; printed beside every table."""

hf_logging.disable_progress_bar()  # from_pretrained's loading bar, once per model load

SEQUENCE_ENTROPY = ("entropy bonus under --loss-aggregation sequence: TRL's entropy_coef term is always the mean "
                    "over tokens, asyncrl's is aggregated like the loss (mean of per-answer means)")  # fmt: skip

UNSUPPORTED = {
    "use_tis": False, "use_decoupled_ppo": False, "keep_old_actor": False, "rollout_stop_token_ids": [],
    "global_batch_size": None, "num_steps_per_rollout": None, "apply_chat_template": False,
    "custom_rm_path": None, "custom_generate_function_path": None, "env": None, "group_rm": False,
}  # fmt: skip
"""Recipe fields the TRL arm cannot reproduce: a job that sets one is refused, never approximated."""


# ---- the recipe ----------------------------------------------------------------------------------
def check_supported(config) -> None:
    bad = {k: config.flag(k) for k, default in UNSUPPORTED.items() if config.flag(k) != default}
    if config.trainer.kl_coef and config.trainer.kl_loss_type != "low_var_kl":
        bad["kl_loss_type"] = config.trainer.kl_loss_type  # TRL's KL term is k3 (low_var_kl) only
    if bad:
        raise SystemExit(f"the TRL arm cannot reproduce this recipe: {bad}")


def unmatched(config) -> list[str]:
    """What differs between the arms for this recipe (printed and recorded with every TRL run)."""
    notes = list(UNMATCHED)
    if config.trainer.entropy_coef and config.trainer.loss_aggregation == "sequence":
        notes.append(SEQUENCE_ENTROPY)
    return notes


def grpo_config(config, out_dir: Path, seed: int, steps: int) -> dict:
    """GRPOConfig keyword arguments from asyncrl's resolved RunConfig, field by field."""
    r, t = config.rollout, config.trainer
    batch = r.batch_size * r.n_samples_per_prompt
    return {
        "output_dir": str(out_dir), "seed": seed, "max_steps": steps,
        # one generation batch of B prompts x n samples, one optimizer step on all of it (asyncrl's default)
        "per_device_train_batch_size": batch, "generation_batch_size": batch, "num_generations": r.n_samples_per_prompt,
        "gradient_accumulation_steps": 1, "num_iterations": 1,
        "learning_rate": t.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": t.weight_decay,
        "adam_beta1": t.adam_beta1, "adam_beta2": t.adam_beta2, "max_grad_norm": t.clip_grad,
        "epsilon": t.eps_clip, "epsilon_high": t.eps_clip_high, "entropy_coef": t.entropy_coef,
        "loss_type": "dapo" if t.loss_aggregation == "token" else "grpo",
        "scale_rewards": "group" if t.grpo_std_normalization and r.n_samples_per_prompt > 1 else "none",
        "beta": t.kl_coef,
        "temperature": r.temperature, "top_p": r.top_p, "top_k": max(r.top_k, 0),
        "max_completion_length": r.max_response_len,
        "shuffle_dataset": config.data.rollout_shuffle,
        # asyncrl trains in float32 without activation checkpointing, on the CPU here
        "bf16": False, "fp16": False, "activation_checkpointing": False, "use_cpu": True,
        "logging_steps": 1, "report_to": "none", "save_strategy": "no", "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }  # fmt: skip


# ---- model and tokenizer -------------------------------------------------------------------------
def load_tokenizer(model_dir: Path, rows: list[dict], config):
    """transformers' tokenizer on the checkpoint's own tokenizer.json, checked against asyncrl's
    client-side Tokenizer: the prompt ids the producer sends the engine, BOS, EOS and pad."""
    from transformers import AutoTokenizer

    from services.model.hf_io import read_config
    from services.model.tokenizer import Tokenizer

    hf, ours = AutoTokenizer.from_pretrained(model_dir), Tokenizer(model_dir)
    # the digit tasks' tokenizer_config says 64 whatever the model's context (the long-tail model has 512): only
    # transformers reads it, to warn about longer prompts, and nothing truncates
    hf.model_max_length = read_config(model_dir).max_position_embeddings
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(hf, attr) != getattr(ours, attr):
            raise SystemExit(f"tokenizer mismatch: transformers' {attr} {getattr(hf, attr)} != {getattr(ours, attr)}")
    prompts = [r["prompt"] for r in rows]
    got = hf(text=prompts)["input_ids"]
    for p, ids in zip(prompts, got, strict=True):
        if ids != ours.prompt_ids(p, config.data.apply_chat_template):
            raise SystemExit(f"tokenizer mismatch on {p!r}: {ids} != {ours.prompt_ids(p, False)}")
    return hf


def logprob_gap(model_dir: Path, rows: list[dict], tokenizer) -> float:
    """Largest |log p| difference between transformers' Llama and asyncrl's own model (the trainer's
    and the engine's) on the prompts' tokens plus their labels: both load the same weights."""
    from transformers import AutoModelForCausalLM

    from services.model.hf_io import load_model

    hf, ours = AutoModelForCausalLM.from_pretrained(model_dir), load_model(model_dir)
    gap = 0.0
    with torch.no_grad():
        for r in rows[:64]:
            ids = torch.tensor([tokenizer(text=[r["prompt"] + r["label"]])["input_ids"][0] + [tokenizer.eos_token_id]])
            a = torch.log_softmax(ours(ids, torch.ones_like(ids)).float(), -1)
            b = torch.log_softmax(hf(ids).logits.float(), -1)
            gap = max(gap, (a - b).abs().max().item())
    return gap


# ---- grading -------------------------------------------------------------------------------------
def grade(config, reward_fn, prompts: list[str], texts: list[str], labels: list) -> list[float]:
    """Rewards by the run's own reward function (the hub routes the task's rm type to the task's
    reward), through score_sample as the producer and the eval service grade."""

    async def all_of() -> list[float]:
        samples = [Sample(index=i, prompt=p, label=lab, response=t, status=SampleStatus.COMPLETED)
                   for i, (p, t, lab) in enumerate(zip(prompts, texts, labels, strict=True))]  # fmt: skip
        for s in samples:
            if not await score_sample(reward_fn, config, s):
                raise RuntimeError(f"reward failed on {s.prompt!r}: {s.metadata}")
        return [float(s.reward) for s in samples]

    return asyncio.run(all_of())


class TaskReward:
    """TRL's reward function: the task's reward on each completion; it also counts the groups of a
    step whose rewards are all equal (zero advantage: nothing to learn), as asyncrl's
    rollout/zero_std/* counts them."""

    def __init__(self, config, n: int):
        self.config, self.n, self.fn = config, n, resolve_reward(config)
        self.__name__ = "task_reward"
        self.steps: list[dict] = []

    def __call__(self, prompts, completions, completion_ids, label, **_kw) -> list[float]:
        rewards = grade(self.config, self.fn, prompts, completions, label)
        groups = [rewards[i : i + self.n] for i in range(0, len(rewards), self.n)]
        self.steps.append({"reward": statistics.fmean(rewards),
                           "zero_adv": sum(all(x == g[0] for x in g) for g in groups) / len(groups),
                           "len": statistics.fmean(len(c) for c in completion_ids)})  # fmt: skip
        return rewards


# ---- TRL's generation path -----------------------------------------------------------------------
@contextlib.contextmanager
def sampling(trainer, params: dict | None):
    """TRL's generation config, or one with `params` (asyncrl's eval sampling) in its place."""
    from transformers import GenerationConfig

    if params is None:
        yield
        return
    saved = trainer.generation_config, trainer.generation_kwargs
    kw = dict(trainer.generation_kwargs, max_new_tokens=params["max_new_tokens"], temperature=params["temperature"],
              top_p=params["top_p"], top_k=max(params.get("top_k", -1), 0))  # fmt: skip
    trainer.generation_kwargs, trainer.generation_config = kw, GenerationConfig(**kw, disable_compile=True)
    try:
        yield
    finally:
        trainer.generation_config, trainer.generation_kwargs = saved


def sample_answers(trainer, rows: list[dict], n: int, seed: int, params: dict | None = None,
                   chunk: int = 256) -> list[dict]:  # fmt: skip
    """n completions per row through GRPOTrainer's own generation (`_generate_single_turn`: left-padded
    `model.generate` with its GenerationConfig, cut after the first EOS), graded by the task's reward;
    on a forked RNG, so that evaluating leaves training's random stream as it was."""
    prompts = [r["prompt"] for r in rows for _ in range(n)]
    labels = [r["label"] for r in rows for _ in range(n)]
    ids = trainer.processing_class(text=prompts)["input_ids"]
    max_new = (params or trainer.generation_kwargs)["max_new_tokens"]
    out: list[list[int]] = []
    with torch.random.fork_rng(devices=[]), sampling(trainer, params):
        torch.manual_seed(seed)
        for i in range(0, len(ids), chunk):
            done, _ = trainer._generate_single_turn(ids[i : i + chunk], None, {}, n)
            out += done
    texts = trainer.processing_class.batch_decode(out, skip_special_tokens=True)
    rewards = grade(trainer.peer_config, trainer.peer_reward.fn, prompts, texts, labels)
    eos = set(trainer.eos_token_ids)
    return [{"reward": rw, "len": len(c), "eos": bool(c) and c[-1] in eos, "truncated": not (c and c[-1] in eos)
             and len(c) >= max_new} for rw, c in zip(rewards, out, strict=True)]  # fmt: skip


def make_trainer(config, model_dir: Path, train_rows: list[dict], tokenizer, seed: int, steps: int, out_dir: Path,
                 callbacks=()):  # fmt: skip
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    reward = TaskReward(config, config.rollout.n_samples_per_prompt)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in train_rows])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**grpo_config(config, out_dir, seed, steps)),
                          train_dataset=data, processing_class=tokenizer, callbacks=list(callbacks))  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # with tqdm off it prints every step's logs
    trainer.peer_config, trainer.peer_reward = config, reward
    return trainer


# ---- the timed run -------------------------------------------------------------------------------
class LoopClock(TrainerCallback):
    """Times GRPOTrainer's training loop from its first step to its last, with the held-out
    evaluations (step 0, every `interval` steps, the last step) stopped out of the clock; keeps
    each step's wall-clock and TRL's logged metrics."""

    def __init__(self, evaluate, interval: int, total: int):
        self.evaluate, self.interval, self.total = evaluate, interval, total
        self.points: list[tuple[int, float, float]] = []
        self.step_s: list[float] = []
        self.logs: list[dict] = []
        self.eval_s = 0.0
        self.loop_s = 0.0

    def _eval(self, step: int, loop_s: float) -> None:
        t = time.perf_counter()
        self.points.append((step, loop_s, self.evaluate(step)))
        self.eval_s += time.perf_counter() - t

    def on_train_begin(self, args, state, control, **kw):
        self._eval(0, 0.0)
        self.t0 = self.last = time.perf_counter()
        self.paused = 0.0

    def on_step_end(self, args, state, control, **kw):
        now = time.perf_counter()
        self.step_s.append(now - self.last)
        self.loop_s = now - self.t0 - self.paused
        if state.global_step % self.interval == 0 or state.global_step == self.total:
            before = self.eval_s
            self._eval(state.global_step, self.loop_s)
            self.paused += self.eval_s - before
        self.last = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append({"step": state.global_step, **(logs or {})})


TRL_TRACE = {"entropy": "entropy", "clip_ratio/region_mean": "clipfrac", "frac_reward_zero_std": "trl_zero_std",
             "grad_norm": "grad_norm", "completions/mean_length": "len_mean"}  # fmt: skip
"""TRL's logged metrics kept per step, under the names the record uses."""


def run_trl(config, model_dir: Path, train_rows: list[dict], held_rows: list[dict], eval_params: dict, seed: int,
            steps: int, interval: int, eval_samples: int) -> dict:  # fmt: skip
    """One TRL run of `steps` steps from `model_dir`: its held-out curve (step, loop seconds, reward),
    loop and step times, and per step its training reward, zero-advantage group share, entropy and
    clip fraction."""
    tokenizer = load_tokenizer(model_dir, held_rows[:256] + train_rows[:256], config)
    holder: dict = {}

    def evaluate(step: int) -> float:
        answers = sample_answers(holder["trainer"], held_rows, eval_samples, seed * 100_003 + step, eval_params)
        return statistics.fmean(a["reward"] for a in answers)

    clock = LoopClock(evaluate, interval, steps)
    with tempfile.TemporaryDirectory(prefix="asyncrl-peer-trl-") as tmp:
        trainer = make_trainer(config, model_dir, train_rows, tokenizer, seed, steps, Path(tmp), [clock])
        holder["trainer"] = trainer
        t0 = time.time()
        trainer.train()
    per_step = trainer.peer_reward.steps
    trace = [{"step": i + 1, **s} for i, s in enumerate(per_step)]
    for log in clock.logs:
        if 1 <= log["step"] <= len(trace):
            trace[log["step"] - 1].update({name: log[k] for k, name in TRL_TRACE.items() if k in log})
    return {"points": clock.points, "loop_wall_s": clock.loop_s, "step_time_s": statistics.median(clock.step_s),
            "eval_s": clock.eval_s, "run_wall_s": time.time() - t0, "torch_threads": torch.get_num_threads(),
            "zero_adv_mean": statistics.fmean(s["zero_adv"] for s in per_step),
            "clipfrac_mean": statistics.fmean(t.get("clipfrac", 0.0) for t in trace), "trace": trace,
            "grpo_config": {k: v for k, v in grpo_config(config, Path("."), seed, steps).items() if k != "output_dir"},
            "unmatched": unmatched(config)}  # fmt: skip
