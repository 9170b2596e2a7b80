"""--task calculator: the bundled tool-use task. The producer reads a call from the ids the model
sampled, appends the calculator's result as ids out of the loss, and the reward scores the answer
written after it; held-out prompts are answered the same way (the eval service uses the task's
generate function)."""

from __future__ import annotations

import json

import pytest

from asyncrl_proto.messages import Sample
from services.common.config import RunConfig
from services.envs.generate import EngineHandle, generate_function
from services.model.tokenizer import Tokenizer
from services.tasks import calculator
from services.tasks.char_model import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("calc_tok")
    build_char_tokenizer(out, 64)
    return Tokenizer(str(out))


class ScriptedEngine:
    """Answers /generate with the given texts in turn, as SGLang does: output ids with their
    log-probs; a stop token id among `stop_token_ids` ends the turn after it."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.requests = tok, list(texts), []

    async def generate(self, body: dict) -> dict:
        self.requests.append(body)
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False)
        params = body["sampling_params"]
        stop = set(params.get("stop_token_ids") or [])
        cut = next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))
        ids = ids[: min(cut, params["max_new_tokens"])]
        reason = "stop" if cut <= params["max_new_tokens"] else "length"
        return {"text": self.tok.decode(ids), "output_ids": ids,
                "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                              "finish_reason": {"type": reason}, "weight_version": "3"}}  # fmt: skip


async def _run(tok, prompt, texts, max_new=24):
    engine = ScriptedEngine(tok, texts)
    ids = tok.prompt_ids(prompt, False, None)
    s = Sample(index=0, prompt=prompt, label=str(eval(prompt.rstrip("="))), metadata={"_input_ids": ids})
    s = await calculator.generate(RunConfig(), s, EngineHandle(engine, tok), {"max_new_tokens": max_new,
                                  "temperature": 1.0, "stop_token_ids": [2]})  # fmt: skip
    return s, ids, engine


@pytest.mark.asyncio
async def test_a_call_gets_the_calculators_result_as_ids_out_of_the_loss(tokenizer):
    s, prompt_ids, engine = await _run(tokenizer, "482+365=", ["<>", "847"])
    assert s.response == "<>847|847" and s.metadata["tool_calls"] == 1
    result = tokenizer.encode("847|", add_special_tokens=False)
    call, answer = tokenizer.encode("<>", add_special_tokens=False), tokenizer.encode("847", add_special_tokens=False)
    assert s.tokens == prompt_ids + call + result + answer  # token in, token out: nothing re-tokenized
    assert s.loss_mask == [1] * len(call) + [0] * len(result) + [1] * len(answer)
    assert s.rollout_log_probs == [-0.5] * len(call) + [0.0] * len(result) + [-0.5] * len(answer)
    assert s.metadata["turn_versions"] == [[3], [3]] and s.weight_versions == [3]
    # the second turn sees every id so far, and only the budget that is left
    assert engine.requests[1]["input_ids"] == prompt_ids + call + result
    assert engine.requests[1]["sampling_params"]["max_new_tokens"] == 24 - len(call) - len(result)
    assert await calculator.reward(None, s) == 1.0


@pytest.mark.asyncio
async def test_a_call_with_its_own_sum_and_a_direct_answer(tokenizer):
    s, _, _ = await _run(tokenizer, "482+365=", ["<400+5>", "405"])
    assert s.metadata["env_turns"] == ["405|"]
    assert await calculator.reward(None, s) == 0.0  # the answer is graded, not the call
    s, _, engine = await _run(tokenizer, "482+365=", ["847"])
    assert s.metadata["tool_calls"] == 0 and s.loss_mask == [1, 1, 1] and len(engine.requests) == 1
    assert await calculator.reward(None, s) == 1.0
    # an answer that leaves no budget after its call earns nothing for the call's digits
    s, _, _ = await _run(tokenizer, "2+3=", ["<2+3>"], max_new=5)
    assert s.metadata["tool_calls"] == 1 and s.metadata["turns"] == ["<2+3>"]
    assert await calculator.reward(None, s) == 0.0


def test_the_calculator_and_its_data(tmp_path):
    assert calculator.calculate("", "12+30=") == "42" and calculator.calculate("7-9", "1+1=") == "-2"
    assert calculator.calculate("2*3", "1+1=") == "?" and calculator.calculate("<1+1", "1+1=") == "?"
    train, held_out = calculator.write_datasets(tmp_path, seed=3)
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    held = [json.loads(x) for x in held_out.read_text().splitlines()]
    assert len(held) == calculator.NUM_EVAL_PROMPTS and not {r["prompt"] for r in rows} & {r["prompt"] for r in held}
    assert all(str(eval(r["prompt"].rstrip("="))) == r["label"] for r in rows[:100] + held)
    pairs = calculator.warm_start_pairs(rows[:400], seed=1)
    calls = [a for _, a in pairs if a.startswith("<")]
    assert 0.7 < len(calls) / len(pairs) < 0.9  # CALL_SHARE of them through a call
    assert all(a == f"<>{label}|{label}" for (_, a), r in zip(pairs, rows, strict=False) if a.startswith("<")
               for label in [r["label"]])  # fmt: skip


def test_the_task_brings_its_generate_function_and_reward():
    config = RunConfig(task="calculator")
    assert generate_function(config) is calculator.generate
    assert generate_function(RunConfig()).__name__ == "default_generate"
    assert generate_function(RunConfig(task="calculator", custom_generate_function_path=
                                       "services.tasks.multiturn.generate")).__module__ == "services.tasks.multiturn"
