"""--task reasoning-gym: prompts from a reasoning-gym generator with a seed, held-out prompts from
a disjoint seed with no training question among them, and the dataset's own scorer as the
reward (partial credit included), through the reward hub's grader."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym", reason="the reasoning extra: pip install -e '.[reasoning]'")

from services.common.config import RunConfig  # noqa: E402
from services.rewards.graders import grade  # noqa: E402
from services.tasks import reasoning_gym  # noqa: E402

OPTIONS = {"min_word_len": 3, "max_word_len": 5}


def test_prompts_come_from_the_generator_and_held_out_prompts_are_disjoint(tmp_path):
    train, held_out = reasoning_gym.write_datasets(tmp_path, "spell_backward", OPTIONS, 300, 40, seed=5)
    train_rows = [json.loads(line) for line in train.read_text().splitlines()]
    held_rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    assert len(train_rows) == 300 and len(held_rows) == 40
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in held_rows}
    assert len({r["prompt"] for r in held_rows}) == 40
    row = train_rows[0]
    word = row["metadata"]["word"]
    assert row["prompt"].endswith(word) and row["label"] == word[::-1] and 3 <= len(word) <= 5
    assert row["metadata"]["source_dataset"] == "spell_backward" and row["metadata"]["rm_type"] == "reasoning_gym"
    again, _ = reasoning_gym.write_datasets(tmp_path / "again", "spell_backward", OPTIONS, 300, 40, seed=5)
    assert again.read_text() == train.read_text()  # the seed makes the prompts
    # the scorer gets the entry itself back from where the row says it came from
    for r in (train_rows[7], held_rows[3]):
        assert grade("reasoning_gym", False, r["label"], r["label"], r["metadata"], r["prompt"]) == 1.0
        assert grade("reasoning_gym", False, r["label"][:-1], r["label"], r["metadata"], r["prompt"]) < 1.0


def test_the_reward_is_the_datasets_scorer():
    meta = {"source_dataset": "spell_backward", "word": "splat"}
    assert grade("reasoning_gym", False, "talps", "talps", meta) == 1.0
    assert grade("reasoning_gym", False, " talps\n", "talps", meta) == 1.0
    assert grade("reasoning_gym", False, "talp", "talps", meta) == pytest.approx(0.8)  # partial credit
    assert grade("reasoning_gym", False, "xxxxx", "talps", meta) == 0.0
    assert grade("reasoning_gym", True, "so \\boxed{talps}", "talps", meta) == 1.0


def test_the_answer_is_the_tag_or_the_first_line_and_what_follows_earns_nothing():
    """The policy learned that the scorer ignored whatever followed the word (its answers ran to
    the token limit): the answer is the last <answer> tag, else the first line, as the datasets expect."""
    meta = {"source_dataset": "spell_backward", "word": "splat"}
    assert grade("reasoning_gym", False, "talps\nqqqqqqqq", "talps", meta) == 1.0  # the next lines are not read
    padded = grade("reasoning_gym", False, "talpsqqqq", "talps", meta)
    assert padded < grade("reasoning_gym", False, "talps", "talps", meta)  # padding on the line costs
    assert grade("reasoning_gym", False, "<think>sun -> nus</think>\n\ntalps", "talps", meta) == 1.0
    assert grade("reasoning_gym", False, "hmm <answer>x</answer> so <answer> talps </answer> ok", "talps", meta) == 1.0
    assert grade("reasoning_gym", False, "\n\n", "talps", meta) == 0.0
    with pytest.raises(ValueError, match="source_dataset"):
        grade("reasoning_gym", False, "talps", "talps", {})


def test_exact_scoring_gives_full_marks_or_nothing(tmp_path):
    """--rg-scoring exact: 1 where the dataset's scorer gives full marks, else 0, so that no partial
    credit pays for an answer that runs on (spell_backward's gives the word and more 0.8, and
    about 1 where its sum of 1/len per letter rounds up or down: 6, 7, 9, 10 and 11 letters)."""
    meta = {"source_dataset": "spell_backward", "word": "splat", "rg_scoring": "exact"}
    assert grade("reasoning_gym", False, "talps", "talps", meta) == 1.0
    assert grade("reasoning_gym", False, "TALPS\nmore", "talps", meta) == 1.0  # the scorer's own case rule
    assert grade("reasoning_gym", False, "talp", "talps", meta) == 0.0
    assert grade("reasoning_gym", False, "talpsq", "talps", meta) == 0.0  # 0.8 under the dataset's scorer
    assert grade("reasoning_gym", False, "talpsq", "talps", {**meta, "rg_scoring": "dataset"}) == pytest.approx(0.8)
    for word in ("abcdefghi", "abcdefghijk", "abcdefg"):  # sums of 1/len that round past 1.0, or just under it
        long = {**meta, "word": word[::-1]}
        assert grade("reasoning_gym", False, word + "zz", word, {**long, "rg_scoring": "dataset"}) > 0.99
        assert grade("reasoning_gym", False, word + "zz", word, long) == 0.0
        assert grade("reasoning_gym", False, word, word, long) == 1.0
    train, held = reasoning_gym.write_datasets(tmp_path, "spell_backward", OPTIONS, 50, 10, seed=5, scoring="exact")
    for path in (train, held):
        row = json.loads(path.read_text().splitlines()[0])
        assert row["metadata"]["rg_scoring"] == "exact"
        assert grade("reasoning_gym", False, row["label"][:-1], row["label"], row["metadata"], row["prompt"]) == 0.0
    with pytest.raises(ValueError, match="rg_scoring"):  # a row's own metadata: a misspelling is said, not ignored
        grade("reasoning_gym", False, "talps", "talps", {**meta, "rg_scoring": "Exact"})
    assert RunConfig(task="reasoning-gym", rg_scoring="exact").data.rg_scoring == "exact"
    with pytest.raises(ValueError):
        RunConfig(task="reasoning-gym", rg_scoring="partial")


def test_an_unknown_dataset_or_bad_settings_say_so():
    with pytest.raises(ValueError, match="--rg-config"):
        RunConfig(task="reasoning-gym", rg_config="[3, 5]")
    with pytest.raises(ValueError):
        reasoning_gym.make_rows("no_such_dataset", {}, 3, seed=0)
