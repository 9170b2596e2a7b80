"""`asyncrl eval-adapter`: the held-out reward of saved LoRA adapters, after a run.

    asyncrl eval-adapter --hf-checkpoint MODEL_DIR --adapter DIR [--adapter DIR ...] [--base]
        --prompt-data FILE.jsonl [--rm-type NAME | --custom-rm-path mod.fn] [--tool-key KEY] [--json OUT]

Reads the base model (an HF checkpoint directory), PEFT LoRA directories (as `save_adapter`
writes them under `<run_dir>/adapters/<name>/<registration>/v<version>`), a JSONL prompt file and
a reward, read as the producer reads them (a row's `metadata.rm_type` picks its reward; --rm-type
scores the rows that name none; --custom-rm-path scores every row; --tool-key's tools reach the
chat template). Produces, per adapter (and the base alone with --base), the mean reward and the
failed samples: a table on stdout and, with --json, a JSON file.

Generation runs in this process, on CPU, with no engine: every adapter in turn sits in slot 0 of
a `MultiLora` on the one base model. A sample ends at an EOS token ("stop") or at
--rollout-max-response-len or the context length ("length": TRUNCATED). The token choice is the
engine's (greedy below temperature 1e-6, else a draw from softmax(logits / T)), with one
generator per sample seeded from (--seed, sample index), so that a sample's draws do not depend on
the other samples of its batch, and the base and an adapter that adds nothing (B = 0) give the
very same samples. The mean is over every sample, a failed one counting 0, as `eval/<set>`.

Flags, reward, prompts and adapter files are checked before the model is loaded; anything wrong
exits with 2 and one line that says what to do. torch is imported only then: `--help` is instant.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

PROG = "asyncrl eval-adapter"
GEN_BATCH_ROWS = 64
"""Samples generated together, in one KV cache."""
NOT_RUN_FLAGS = ("adapter", "base", "max_prompts", "seed", "json_out")
"""parser()'s flags that are not RunConfig flags: every other flag it parses goes into the RunConfig (a new
flag of this command alone belongs here)."""


class AdapterEvalError(ValueError):
    """A flag, file or adapter this command cannot use; the message says what to do."""


@dataclass
class AdapterScore:
    adapter: str | None
    """The adapter directory as given; None: the base model alone."""
    prompts: int
    samples: int
    mean_reward: float
    failed: int
    truncated: int
    sample_list: list = field(default_factory=list, repr=False)
    """The scored Samples (not written to JSON)."""

    def row(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.repr}


@dataclass
class Generated:
    output_ids: list[int]
    logprobs: list[float]
    finish: str
    """"stop" (an EOS token) or "length" (max new tokens or the context length)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Score saved LoRA adapters: the mean reward of each on held-out prompts."
    )
    p.add_argument(
        "--hf-checkpoint", required=True, metavar="MODEL_DIR", help="the base model: an HF checkpoint directory"
    )
    p.add_argument("--adapter", action="append", default=[], metavar="DIR",
                   help="a PEFT LoRA directory (repeat for several)")  # fmt: skip
    p.add_argument("--base", action="store_true", help="also score the base model alone")
    p.add_argument("--prompt-data", required=True, metavar="FILE", help="JSONL file of held-out prompts")
    rm = p.add_mutually_exclusive_group()
    rm.add_argument("--rm-type", metavar="NAME", help="a built-in reward: a task's or a reward hub type "
                    "(services/common/config/rm_types.py), for the rows whose metadata names no rm_type (needed "
                    "unless every row names one)")  # fmt: skip
    rm.add_argument(
        "--custom-rm-path", metavar="MOD.FN", help="import path of a reward function (config, sample) -> float"
    )
    p.add_argument("--reward-key", default=None, metavar="KEY", help="key to read when a reward is a dict")
    p.add_argument("--rm-url", default=None, metavar="URL", help="remote_rm: the reward model's URL")
    p.add_argument("--input-key", default="prompt", metavar="KEY", help="JSONL key of the prompt")
    p.add_argument("--label-key", default="label", metavar="KEY", help="JSONL key of the label")
    p.add_argument("--metadata-key", default="metadata", metavar="KEY",
                   help="JSONL key of a row's metadata (its rm_type picks the row's reward)")  # fmt: skip
    p.add_argument("--tool-key", default=None, metavar="KEY",
                   help="JSONL key of a row's tool schemas, passed to the chat template as `tools`")  # fmt: skip
    p.add_argument("--apply-chat-template", action="store_true", help="format prompts with the chat template")
    p.add_argument("--n-samples-per-prompt", type=int, default=1, metavar="N", help="samples per prompt")
    p.add_argument("--max-prompts", type=int, default=None, metavar="N", help="score only the file's first N prompts")
    p.add_argument("--rollout-max-response-len", type=int, default=16, metavar="N", help="max new tokens per sample")
    p.add_argument(
        "--rollout-temperature", type=float, default=1.0, metavar="T", help="sampling temperature (0: greedy)"
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the samples' draws")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="also write the results here")
    return p


def check_args(a: argparse.Namespace) -> None:
    positive = {"--n-samples-per-prompt": a.n_samples_per_prompt, "--max-prompts": a.max_prompts,
                "--rollout-max-response-len": a.rollout_max_response_len}  # fmt: skip
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise AdapterEvalError(f"{flag} must be a positive count, got {value}")
    t = a.rollout_temperature
    if not (t >= 0 and t != float("inf")):
        raise AdapterEvalError(f"--rollout-temperature must be a finite number >= 0 (0: greedy), got {t}")
    if a.seed < 0:
        raise AdapterEvalError(f"--seed must be >= 0, got {a.seed}")
    if not a.adapter and not a.base:
        raise AdapterEvalError("nothing to score: pass --adapter DIR (repeatable) and/or --base")
    if not Path(a.hf_checkpoint).is_dir():
        raise AdapterEvalError(f"--hf-checkpoint {a.hf_checkpoint}: no such directory (pass the run's base model)")
    if a.json_out and not Path(a.json_out).resolve().parent.is_dir():
        raise AdapterEvalError(f"--json {a.json_out}: its directory does not exist (create it first)")


def load_prompts(config, max_prompts: int | None) -> list[dict]:
    """The prompt rows, each with its metadata (its rm_type picks its reward) and, with --tool-key,
    its tools, as the producer reads them; a row whose rm_type cannot score is refused with its
    file and row, and so is one that names none when no --rm-type scores it."""
    from services.common.config.rm_types import row_rm_type_check
    from services.data.source import DataError, load_rows

    r, d = config.rollout, config.data
    try:
        rows = load_rows(d.prompt_data, d.input_key, d.label_key, d.metadata_key, tool_key=d.tool_key)
    except (DataError, OSError, UnicodeDecodeError) as e:
        raise AdapterEvalError(f"{e} (pass a JSONL file with one {{{d.input_key!r}: ...}} object a line)") from None
    rows = rows[:max_prompts] if max_prompts else rows
    if r.custom_rm_path:
        return rows  # a custom reward scores every row (it reads a row's rm_type itself, if it wants)
    check = row_rm_type_check(bool(r.rm_url))
    for i, row in enumerate(rows, 1):
        if (problem := check(row)) is not None:
            raise AdapterEvalError(f"{d.prompt_data}: prompt {i}: {problem}")
        if r.rm_type is None and not row["metadata"].get("rm_type"):
            raise AdapterEvalError(f"{d.prompt_data}: prompt {i} names no metadata.rm_type: pass --rm-type for the "
                                   "rows that name none, or --custom-rm-path")  # fmt: skip
    return rows


def read_adapters(paths: list[str]) -> list[tuple]:
    """(path, spec, tensors) of every adapter directory; AdapterEvalError for one that is not a
    PEFT LoRA directory."""
    from services.model.lora import LoraError, load_adapter

    out = []
    for path in paths:
        if not Path(path).is_dir():
            raise AdapterEvalError(f"--adapter {path}: no such directory (pass a PEFT LoRA directory, as the trainer "
                                   "writes under <run_dir>/adapters/<name>/<registration>/v<version>)")  # fmt: skip
        try:
            spec, tensors = load_adapter(path)
        except LoraError as e:
            raise AdapterEvalError(f"--adapter {path}: {e} (pass a PEFT LoRA directory: adapter_config.json and "
                                   "adapter_model.safetensors)") from None  # fmt: skip
        out.append((path, spec, tensors))
    return out


def prompt_ids(tokenizer, rows: list[dict], chat_template: bool, vocab_size: int, context_length: int) -> list:
    """Each row's token ids, as the rollout producer makes them (services/rollout/service.py)."""
    out = []
    for i, row in enumerate(rows, 1):
        try:
            ids = tokenizer.prompt_ids(row["prompt"], chat_template, row.get("tools"))
        except Exception as e:  # a prompt of the wrong shape, a template that fails on it
            raise AdapterEvalError(f"prompt {i}: cannot tokenize it ({type(e).__name__}: {e})") from None
        if not ids or min(ids) < 0 or max(ids) >= vocab_size:
            raise AdapterEvalError(f"prompt {i}: its token ids are empty or outside the vocabulary [0, {vocab_size})")
        if len(ids) >= context_length:
            raise AdapterEvalError(f"prompt {i}: {len(ids)} tokens do not fit the context length {context_length}")
        out.append(ids)
    return out


# ---- generation ------------------------------------------------------------------------------------
def generate(model, lora, slot: int, prompts: list[list[int]], seeds: list[int], *, max_new_tokens: int,
             temperature: float, eos_ids: set[int], context_length: int) -> list[Generated]:  # fmt: skip
    """One response per prompt, all in one KV cache, with adapter `slot` (-1: the base)."""
    import torch

    from services.model.llama import KVCache

    n = len(prompts)
    max_len = min(context_length, max(map(len, prompts)) + max_new_tokens)
    cache = KVCache(model.cfg, n, max_len, dtype=next(model.parameters()).dtype)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    out = [Generated([], [], "") for _ in range(n)]

    logits = torch.empty(n, model.cfg.vocab_size)
    feed = dict(enumerate(prompts))  # row -> the ids it runs next: its prompt, then its last token
    while feed:
        by_length: dict[int, list[int]] = {}
        for i, ids in feed.items():
            by_length.setdefault(len(ids), []).append(i)
        for rows in by_length.values():  # rows of one length run together: the prompts, then one token each
            start = torch.tensor([len(prompts[i]) + len(out[i].output_ids) - len(feed[i]) for i in rows])
            use = lora.rows([slot] * len(rows)) if lora is not None and slot >= 0 else contextlib.nullcontext()
            with torch.no_grad(), use:
                ids_nt = torch.tensor([feed[i] for i in rows])
                logits[rows] = model.forward_cached(ids_nt, cache, torch.tensor(rows), start)[:, -1].float()
        active, feed = list(feed), {}
        tokens, chosen = _choose(logits[active], temperature, [gens[i] for i in active])
        for i, tok, lp in zip(active, tokens, chosen, strict=True):
            o = out[i]
            o.output_ids.append(tok)
            o.logprobs.append(lp)
            if tok in eos_ids:
                o.finish = "stop"
            elif len(o.output_ids) >= max_new_tokens or len(prompts[i]) + len(o.output_ids) >= max_len:
                o.finish = "length"
            else:
                feed[i] = [tok]
    return out


def _choose(logits_nv, temperature: float, gens: list) -> tuple[list[int], list[float]]:
    """The engine's token choice (services/engine/sampling.py without penalties or top-k/p):
    greedy below temperature 1e-6, else a draw from softmax(logits / T), each row from its own
    generator. Returns the tokens and their log-probabilities under softmax(logits / T)."""
    import torch

    greedy = temperature < 1e-6
    scaled = logits_nv / (1.0 if greedy else temperature)
    logp = torch.log_softmax(scaled, dim=-1)
    if greedy:
        tokens = scaled.argmax(-1)
    else:
        probs = torch.softmax(scaled, dim=-1)
        tokens = torch.stack([torch.multinomial(probs[r], 1, generator=g)[0] for r, g in enumerate(gens)])
    return tokens.tolist(), logp.gather(-1, tokens[:, None]).squeeze(-1).tolist()


# ---- scoring ---------------------------------------------------------------------------------------
def score_model(model, lora, slot: int, tokenizer, rows: list[dict], ids: list[list[int]], config, reward_fn,
                seed: int, adapter: str | None) -> AdapterScore:  # fmt: skip
    """Generate n samples per prompt with one adapter (or the base) and score them."""
    from asyncrl_proto.messages import Sample, SampleStatus, scalar_reward
    from services.common.config.view import for_plugins
    from services.rewards import score_sample

    n = config.rollout.n_samples_per_prompt
    samples = [Sample(index=p * n + j, group_index=p, prompt=row["prompt"], label=row["label"],
                      metadata=dict(row["metadata"])) for p, row in enumerate(rows) for j in range(n)]  # fmt: skip
    prompts = [ids[s.group_index] for s in samples]
    eos = set(model.cfg.eos_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    # each sample's generator: torch seeds it with the low 32 bits only, so --seed and the index
    # are mixed within them (1_000_003 is odd: another --seed, another stream)
    seeds, results = [(seed * 1_000_003 + s.index) % 2**32 for s in samples], []
    for i in range(0, len(prompts), GEN_BATCH_ROWS):
        results += generate(model, lora, slot, prompts[i : i + GEN_BATCH_ROWS], seeds[i : i + GEN_BATCH_ROWS],
                            max_new_tokens=config.rollout.max_response_len, temperature=config.rollout.temperature,
                            eos_ids=eos, context_length=model.cfg.max_position_embeddings)  # fmt: skip
    for s, p_ids, g in zip(samples, prompts, results, strict=True):
        text_ids = g.output_ids[:-1] if g.finish == "stop" else g.output_ids  # a stop token is not text (SGLang)
        s.tokens = list(p_ids) + g.output_ids
        s.response = tokenizer.decode(text_ids, skip_special_tokens=True)
        s.response_length = len(g.output_ids)
        s.rollout_log_probs = g.logprobs
        s.status = SampleStatus.COMPLETED if g.finish == "stop" else SampleStatus.TRUNCATED

    async def score_all() -> list[bool]:
        return list(await asyncio.gather(*(score_sample(reward_fn, for_plugins(config), s) for s in samples)))

    scored = asyncio.run(score_all())
    rewards = [scalar_reward(s, config.rollout.reward_key) for s in samples]
    return AdapterScore(adapter=adapter, prompts=len(rows), samples=len(samples),
                        mean_reward=sum(rewards) / len(rewards), failed=scored.count(False),
                        truncated=sum(s.status == SampleStatus.TRUNCATED for s in samples),
                        sample_list=samples)  # fmt: skip


def evaluate(a: argparse.Namespace) -> list[AdapterScore]:
    """Every check, then every adapter's score (the base's first with --base)."""
    check_args(a)
    from services.common.config import RunConfig
    from services.rewards import resolve_reward

    try:  # the RunConfig a reward receives: every flag but these is a run flag (--seed seeds the draws)
        config = RunConfig(**{k: v for k, v in vars(a).items() if k not in NOT_RUN_FLAGS})
        reward_fn = resolve_reward(config)
    except ValueError as e:  # a ConfigError too
        raise AdapterEvalError(" ".join(str(e).split())) from None
    rows = load_prompts(config, a.max_prompts)
    adapters = read_adapters(a.adapter)

    from safetensors import SafetensorError

    from services.model.hf_io import load_model
    from services.model.lora import TARGETS, LoraError, MultiLora
    from services.model.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer(a.hf_checkpoint)
        model = load_model(a.hf_checkpoint).eval()
    except (OSError, ValueError, SafetensorError) as e:
        raise AdapterEvalError(f"--hf-checkpoint {a.hf_checkpoint}: cannot load the model ({e})") from None
    context = model.cfg.max_position_embeddings
    ids = prompt_ids(tokenizer, rows, config.data.apply_chat_template, model.cfg.vocab_size, context)
    lora = None
    if adapters:
        lora = MultiLora(model, n_slots=1, max_rank=max(spec.rank for _, spec, _ in adapters), targets=TARGETS)
        for path, spec, tensors in adapters:  # every adapter checked before any is scored
            try:
                lora.set_slot(0, spec, tensors)
            except LoraError as e:
                raise AdapterEvalError(f"--adapter {path} does not fit the base model in {a.hf_checkpoint}: {e} "
                                       "(pass the --hf-checkpoint it was trained on)") from None  # fmt: skip
    scores = []
    if a.base:
        scores.append(score_model(model, lora, -1, tokenizer, rows, ids, config, reward_fn, a.seed, None))
    for path, spec, tensors in adapters:
        lora.set_slot(0, spec, tensors)
        scores.append(score_model(model, lora, 0, tokenizer, rows, ids, config, reward_fn, a.seed, path))
    return scores


def table(scores: list[AdapterScore]) -> str:
    names = [s.adapter if s.adapter is not None else "(base model)" for s in scores]
    width = max(len("adapter"), *map(len, names))
    lines = [f"{'adapter':<{width}}  {'prompts':>7}  {'samples':>7}  {'mean reward':>11}  {'failed':>6}"]
    for name, s in zip(names, scores, strict=True):
        lines.append(f"{name:<{width}}  {s.prompts:>7}  {s.samples:>7}  {s.mean_reward:>11.4f}  {s.failed:>6}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    try:
        scores = evaluate(a)
    except AdapterEvalError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(table(scores))
    if a.json_out:
        doc = {"hf_checkpoint": a.hf_checkpoint, "prompt_data": a.prompt_data,
               "reward": a.rm_type or a.custom_rm_path or "metadata.rm_type",
               "n_samples_per_prompt": a.n_samples_per_prompt,
               "rollout_max_response_len": a.rollout_max_response_len,
               "rollout_temperature": a.rollout_temperature, "seed": a.seed,
               "results": [s.row() for s in scores]}  # fmt: skip
        Path(a.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0
