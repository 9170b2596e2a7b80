"""The copy-digits task: rows in reverse-digits' format with `+` for `=`, held-out prompts apart
from the training prompts, the soft reward against the digits as given, reverse-digits'
tokenizer reading its prompts, and the built-in reward name."""

from __future__ import annotations

import asyncio
import json
import re

from asyncrl_proto.messages import Sample
from services.common.config import RunConfig
from services.rewards import resolve_reward
from services.model.tokenizer import Tokenizer
from services.tasks import copy_digits, reverse_digits


def test_rows_are_well_formed_distinct_and_avoid_the_excluded_digits():
    excluded = {r["label"] for r in copy_digits.make_rows(50, seed=1)}
    rows = copy_digits.make_rows(500, seed=0, exclude=excluded)
    assert len(rows) == 500
    for r in rows:
        assert set(r) == {"prompt", "label"}
        assert re.fullmatch(r"\d{3,5}\+", r["prompt"]), r
        assert r["label"] == r["prompt"][:-1]
    digits = [r["label"] for r in rows]
    assert len(set(digits)) == len(digits)
    assert not set(digits) & excluded
    assert copy_digits.make_rows(20, seed=0) == copy_digits.make_rows(20, seed=0)


def test_same_shape_as_reverse_digits_only_the_operator_and_the_label_differ():
    rev, cp = reverse_digits.make_rows(20, seed=3), copy_digits.make_rows(20, seed=3)
    for r, c in zip(rev, cp, strict=True):
        assert r["prompt"][:-1] == c["prompt"][:-1]  # the same digits from the same seed
        assert (r["prompt"][-1], c["prompt"][-1]) == ("=", "+")
        assert (r["label"], c["label"]) == (c["label"][::-1], c["prompt"][:-1])


def test_write_datasets_held_out_prompts_are_disjoint_from_training(tmp_path):
    train, held_out = copy_digits.write_datasets(tmp_path, seed=0)
    assert (train.name, held_out.name) == ("copy_digits_train.jsonl", "copy_digits_eval.jsonl")
    train_rows = [json.loads(line) for line in train.read_text().splitlines()]
    eval_rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    assert (len(train_rows), len(eval_rows)) == (copy_digits.NUM_TRAIN_PROMPTS, copy_digits.NUM_EVAL_PROMPTS)
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in eval_rows}


def _reward(response: str, label: str = "28170") -> float:
    return asyncio.run(copy_digits.reward(None, Sample(prompt=f"{label}+", label=label, response=response)))


def test_reward_is_soft_and_positional_against_the_copy():
    assert _reward("28170") == 1.0
    assert _reward(" 28170\n") == 1.0
    assert _reward("28179") == 0.8
    assert _reward("281") == 3 / 5
    assert _reward("2817000") == 5 / 7  # extra characters cost
    assert _reward("07182") == 0.2  # the reverse is not the copy (only the middle digit lines up)
    assert _reward("abcde") == 0.0
    assert _reward("") == 0.0


def test_the_reverse_digits_tokenizer_encodes_copy_prompts_without_unknown_tokens(tmp_path):
    reverse_digits.build_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    unk = reverse_digits.SPECIAL.index("<unk>")
    for row in copy_digits.make_rows(50, seed=0):
        ids = tok.encode(row["prompt"])
        assert unk not in ids
        assert ids[0] == reverse_digits.BOS_ID and len(ids) == len(row["prompt"]) + 1
        assert tok.decode(ids) == row["prompt"]
    plus, equals = tok.encode("+", add_special_tokens=False), tok.encode("=", add_special_tokens=False)
    assert len(plus) == 1 and plus != equals, "the two tasks' prompts must differ in a token"


def test_copy_digits_is_a_builtin_reward():
    """--rm-type copy-digits scores every sample whose metadata names no other rm_type with the
    task's own reward (the reward hub routes it)."""
    config = RunConfig(rm_type="copy-digits")
    fn = resolve_reward(config)
    for response, label in (("123", "123"), ("321", "123"), ("12", "123")):
        s = Sample(response=response, label=label)
        assert asyncio.run(fn(config, s)) == asyncio.run(copy_digits.reward(config, s))
    assert asyncio.run(fn(config, Sample(response="123", label="123"))) == 1.0
