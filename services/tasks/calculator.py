"""A bundled tool-use task: add two numbers, with a calculator the model may call.

    asyncrl train-async --config deploy/configs/calculator.yaml

The prompt is a sum ("482+365="), the label its value ("847"). The model may answer at once
("847"), or call the calculator first: it writes a call, `<>` (the question's sum) or
`<482+365>` (a sum of its own); the producer reads the call from the ids the model sampled,
computes it and appends the result and a bar, `847|`, tokens the model did not write (loss mask
0, log-prob 0); the model then writes its answer, `847`. One call per answer. The reward scores
the final answer (the text after the calculator's result, or the whole response without a call)
with reverse-digits' soft positional score, so a call with a wrong argument earns what its answer
earns. Adding 3-digit numbers is beyond the tiny model; calling and copying a result is not: the
reward rises as the model learns to call the calculator (`rollout/tool_call_ratio`, and
`eval/calculator-tool_call_ratio` held out).

The tiny model is the character-level one (services/tasks/char_model.py), warm-started on right
answers, most of them (CALL_SHARE) through a call: after the warm start the model calls about
two times in three but copies the result badly; RL makes it call always and copy well. Its
config (deploy/configs/calculator.yaml) has no entropy bonus: with the default job's, one seed in
three stopped calling in its first steps (docs/learning.md).
"""

from __future__ import annotations

import random
import re
import uuid
from pathlib import Path

from asyncrl_proto.messages import Sample
from services.envs.trajectory import Trajectory
from services.tasks.reverse_digits import distinct_rows, score, write_split

NAME = "calculator"
CALL_OPEN, CALL_CLOSE, RESULT_END = "<", ">", "|"
MAX_OPERAND = 999
NUM_TRAIN_PROMPTS = 20_000
NUM_EVAL_PROMPTS = 128
CALL_SHARE = 0.8
"""The share of warm-start examples that answer through a call."""
MAX_RESPONSE_LEN = 24
"""Tokens of a whole answer, call and result included ("<999+999>1998|1998" and EOS: 19)."""

_CALL = re.compile(r"\s*(\d{1,6})\s*([+-])\s*(\d{1,6})\s*")


def make_rows(num: int, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    """`num` distinct sums "a+b=", none of whose prompts is in `exclude`."""
    return distinct_rows(num, seed, exclude, lambda p: {"prompt": p, "label": calculate("", p)},
                         lambda rng: f"{rng.randint(0, MAX_OPERAND)}+{rng.randint(0, MAX_OPERAND)}=")  # fmt: skip


def write_datasets(data_dir: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Training and held-out prompt files; no held-out sum is a training prompt."""
    eval_rows = make_rows(NUM_EVAL_PROMPTS, seed + 1)
    train_rows = make_rows(NUM_TRAIN_PROMPTS, seed, exclude={r["prompt"] for r in eval_rows})
    return write_split(data_dir, NAME, train_rows, eval_rows)


def calculate(call: str, question: str) -> str:
    """The calculator: "a+b" or "a-b" on integers, the question's when the call is empty;
    anything else answers "?"."""
    m = _CALL.fullmatch(call or question.rstrip("="))
    if m is None:
        return "?"
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a + b if op == "+" else a - b)


def warm_start_pairs(rows: list[dict], seed: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of right answers, CALL_SHARE of them through a call of the question."""
    rng = random.Random(seed)
    call = CALL_OPEN + CALL_CLOSE + "{0}" + RESULT_END + "{0}"
    return [(r["prompt"], call.format(r["label"]) if rng.random() < CALL_SHARE else r["label"]) for r in rows]


async def generate(config, sample: Sample, engine, sampling_params: dict) -> Sample:
    """The model's turn; if it ends in a call, the calculator's result; then the model's answer.
    Token in, token out: the call is the engine's own ids, the result is appended as ids."""
    tok = engine.tokenizer
    traj = Trajectory(sample, sample.metadata.pop("_input_ids"))
    traj.tool_calls = 0
    rid = f"s{sample.index}-{uuid.uuid4().hex[:8]}"
    budget = int(sampling_params.get("max_new_tokens", MAX_RESPONSE_LEN))
    close_ids = tok.encode(CALL_CLOSE, add_special_tokens=False)
    first = dict(sampling_params, stop_token_ids=list(sampling_params.get("stop_token_ids") or []) + close_ids)
    ids = traj.model_turn(await engine.generate(traj.context, first, rid=f"{rid}-t0"))
    call = tok.decode(ids[:-1]) if ids and ids[-1] in close_ids else None  # ended by the call's close
    if call is not None and CALL_OPEN in call and not traj.aborted:
        traj.tool_calls += 1
        result = calculate(call[call.rindex(CALL_OPEN) + 1 :], str(sample.prompt)) + RESULT_END
        traj.env_turn(tok.encode(result, add_special_tokens=False), result)
        left = budget - traj.response_tokens
        if left > 0:
            params = dict(sampling_params, max_new_tokens=left)
            traj.model_turn(await engine.generate(traj.context, params, rid=f"{rid}-t1"))
    return traj.finish()


async def reward(config, sample: Sample) -> float:
    """The soft positional score of the final answer against the sum: the text after the
    calculator's result, or the whole response when there was no call."""
    turns = sample.metadata.get("turns") or [sample.response]
    if not sample.metadata.get("tool_calls"):
        return score(turns[0], str(sample.label))
    return score(turns[1] if len(turns) > 1 else "", str(sample.label))  # "": no budget left to answer after the call
