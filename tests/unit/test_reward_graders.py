"""The reward hub's graders on hand-picked cases (services/rewards/graders.py), and the
names --rm-type may take (names.py), as Miles routes them."""

from __future__ import annotations

import time

import pytest

from services.common.config import ConfigError, RunConfig
from services.rewards.answers import decide, normalize
from services.rewards.exact import HUGE, Collection, value
from services.rewards.graders import grade, last_boxed, minerva_normalize
from services.common.config.rm_types import rm_type_problem


def test_the_last_boxed_answer_with_nested_braces():
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("\\boxed {7}") == "7"
    assert last_boxed("no box here") is None
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("\\boxed 5") is None


@pytest.mark.parametrize("answer", ["\\frac{1}{2}", "0.5", "1/2", "\\dfrac{1}{2}", "\\frac12"])
def test_math_takes_equal_forms_of_one_answer(answer):
    for label in ("\\frac{1}{2}", "0.5", "1/2", "\\boxed{\\frac{1}{2}}"):
        assert grade("math", False, f"so the answer is \\boxed{{{answer}}}", label, {}) == 1.0


@pytest.mark.parametrize(("response", "label"), [
    ("\\boxed{3}", "4"),  # wrong
    ("the answer is 1/2", "1/2"),  # no box: nothing graded (Miles's math)
    ("\\boxed{\\frac{1}{2}", "1/2"),  # malformed LaTeX: the box never closes
    ("\\boxed{\\frac{1}{}}", "1/2"),  # malformed LaTeX inside the box
    ("\\boxed{}", "1/2"),  # empty
    ("\\boxed{1/2}", None),  # no label
])  # fmt: skip
def test_math_gives_zero_to_wrong_missing_or_malformed_answers(response, label):
    assert grade("math", False, response, label, {}) == 0.0


def test_math_accepts_symbolic_and_set_answers():
    assert grade("math", False, "\\boxed{(x+1)^2}", "x^2+2x+1", {}) == 1.0
    assert grade("math", False, "\\boxed{10.0}", "10", {}) == 1.0
    assert grade("math", False, "\\boxed{\\sqrt{2}}", "1.4142", {}) == 0.0


def test_boxed_prefix_grades_the_boxed_answer():
    # f1 on the whole response vs on the box
    response = "I think it is Paris, the capital. \\boxed{Paris}"
    assert grade("f1", True, response, "Paris", {}) == 1.0
    assert 0 < grade("f1", False, response, "Paris", {}) < 1
    assert grade("f1", True, "no box, Paris", "Paris", {}) == 0.0
    assert grade("math", True, "\\boxed{0.5}", "1/2", {}) == 1.0
    assert grade("dapo", True, "\\boxed{42}", "42", {}) == {"score": 1.0, "acc": 1.0}


def test_dapo_keeps_its_answer_line_rule_and_plus_minus_one():
    assert grade("dapo", False, "reasoning...\nAnswer: 42", "42", {}) == {"score": 1.0, "acc": 1.0}
    assert grade("dapo", False, "Answer: $1,000$ dollars", "1000", {}) == {"score": 1.0, "acc": 1.0}
    assert grade("dapo", False, "Answer: 41", "42", {}) == {"score": -1.0, "acc": 0.0}
    assert grade("dapo", False, "42", "42", {}) == {"score": -1.0, "acc": 0.0}  # no "Answer:" line
    late = "Answer: 42" + "x" * 400  # not in the last 300 characters
    assert grade("dapo", False, late, "42", {}) == {"score": -1.0, "acc": 0.0}
    assert grade("dapo", False, "Answer: 42.0", "42", {}) == {"score": -1.0, "acc": 0.0}  # string equality, as DAPO
    with pytest.raises(ValueError):
        grade("dapo", False, "Answer: x", "not a number", {})  # DAPO's labels are integers
    with pytest.raises(ValueError, match="integer"):
        grade("dapo", False, "Answer: 12", "12.5", {})
    assert minerva_normalize("x = \\boxed{12}") == "12"
    assert minerva_normalize("\\text{5 apples}") == "5apples"


def test_deepscaler_grades_after_the_thinking():
    assert grade("deepscaler", False, "<think>\\boxed{3}</think> so \\boxed{1/2}", "0.5", {}) == 1.0
    assert grade("deepscaler", False, "###Response \\boxed{2}", "2", {}) == 1.0
    assert grade("deepscaler", False, "\\boxed{2}", "2", {}) == 0.0  # neither marker: a format failure
    assert grade("deepscaler", False, "</think> 2", "2", {}) == 0.0  # no box after it


def test_f1_is_squads_token_f1():
    assert grade("f1", False, "The Eiffel Tower!", "eiffel tower", {}) == 1.0
    assert grade("f1", False, "eiffel tower in paris", "the eiffel tower", {}) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert grade("f1", False, "no", "yes", {}) == 0.0
    assert grade("f1", False, "something else", "yes", {}) == 0.0
    assert grade("f1", False, "", "tower", {}) == 0.0


def test_gpqa_reads_the_chosen_letter():
    choices = {"choices": ["red", "green", "blue", "black"]}
    assert grade("gpqa", False, "The answer is C.", "C", {}) == 1.0
    assert grade("gpqa", False, "<think>maybe A</think> B is correct", "B", {}) == 1.0
    assert grade("gpqa", False, "final answer: D", 3, choices) == 1.0  # a 0-based index
    assert grade("gpqa", False, "answer: C", "blue", choices) == 1.0  # the choice's text
    assert grade("gpqa", False, "answer: A", "blue", choices) == 0.0
    assert grade("gpqa", False, "it is blue", "blue", choices) == 1.0  # no letter: the text
    assert grade("gpqa", False, "answer: A", "C", {}) == 0.0
    assert grade("gpqa", False, "2 electrons, so none of these", 2, choices) == 0.0  # an index is no answer text
    assert grade("gpqa", False, "answer: E", "A", choices) == 0.0  # E is not a choice of four: the last valid letter


@pytest.mark.parametrize(("answer", "label"), [
    ("\\$20", "20"), ("20", "\\$20"), ("\\$1,000", "1000"),  # an escaped dollar, either side
    ("east", "East"), ("\\text{North East}", "north east"), ("\\text{Yes}", "yes"),  # word answers, any case
    ("5\\text{ cm}", "5"), ("30^\\circ", "30"), ("50\\%", "50"), ("x = \\dfrac12", "0.5"), ("7 3/4", "31/4"),
])  # fmt: skip
def test_math_normalises_as_the_math_normaliser_does(answer, label):
    assert grade("math", False, f"so \\boxed{{{answer}}}", label, {}) == 1.0


@pytest.mark.parametrize(("answer", "label", "score"), [
    ("tea", "eat", 0.0), ("dog", "god", 0.0),  # a word is not a product of its letters
    ("2ab", "2ba", 1.0), ("\\pi r^2", "r^2\\pi", 1.0),  # letters in an expression are variables
    ("0.333333", "\\frac{1}{3}", 0.0), ("3.1416", "\\pi", 0.0),  # an approximation is not the value
    ("3 days", "3 weeks", 0.0), ("x>2", "(2,\\infty)", 0.0), ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\begin{pmatrix}0.5\\\\1\\end{pmatrix}", "\\begin{pmatrix}\\frac12\\\\1\\end{pmatrix}", 1.0),  # no word
])  # fmt: skip
def test_math_compares_words_values_and_units(answer, label, score):
    assert grade("math", False, f"\\boxed{{{answer}}}", label, {}) == score


def test_the_cheap_checks():
    assert normalize("5\\text{ cm}") == ("5", frozenset({"cm"}))
    assert normalize("\\left( \\dfrac12, 1{,}000 \\right)") == ("(\\frac{1}{2},1000)", frozenset())
    assert value("x^2+2x+1") == value("(x+1)^2") != value("x^2+1")
    assert isinstance(value("(1,2]"), Collection) and value("(1,2]") != value("(1,2)")
    assert value("9^{9^{9^9}}") is HUGE and value("\\sqrt{2}") is None and value("1/2x") is None
    assert decide("\\sqrt{2}+1", "\\sqrt{3}") is False  # apart in floats
    assert decide("\\sqrt{8}", "2\\sqrt{2}") is None  # close in floats: math-verify decides


@pytest.mark.parametrize("answer", [
    "{" * 80 + "1" + "}" * 80, "(" * 60 + "x" + ")" * 60, "\\sqrt{" * 40 + "2" + "}" * 40, "9^{9^{9^{9}}}", "100000!",
    "\\frac{1}{" * 50 + "2" + "}" * 50, "1e99999", "\\text{" * 5000 + "1" + "}" * 5000, "2^{10^{10}}",
])  # fmt: skip
def test_deep_or_huge_answers_never_reach_the_timeout(answer):
    start = time.perf_counter()
    assert grade("math", False, f"\\boxed{{{answer}}}", "7", {}) == 0.0
    assert time.perf_counter() - start < 1.0  # math-verify's own timeout is 5 s


def test_dapo_drops_the_end_of_text_token():
    assert grade("dapo", False, "Answer: 42<|endoftext|>", "42", {}) == {"score": 1.0, "acc": 1.0}


def test_gpqa_reads_letters_to_j_but_not_the_pronoun_i():
    assert grade("gpqa", False, "The answer is J", "J", {}) == 1.0
    assert grade("gpqa", False, "answer: I", "I", {}) == 1.0
    assert grade("gpqa", False, "B, I guess", "B", {}) == 1.0
    assert grade("gpqa", False, "The answer: I think it is C", "C", {}) == 1.0
    assert grade("gpqa", False, "I'm sure: D", "D", {}) == 1.0
    assert grade("gpqa", False, "The answer is I.", "I", {"choices": list("abcd")}) == 0.0  # only four choices


def test_rm_type_names():
    assert rm_type_problem("math") is None and rm_type_problem("boxed_gpqa") is None
    assert rm_type_problem("reverse-digits") is None
    assert "unknown" in rm_type_problem("mathh")
    assert rm_type_problem("ifbench") is None and rm_type_problem("boxed_ifbench") is None
    assert "--rm-url" in rm_type_problem("remote_rm", has_url=False)


@pytest.mark.parametrize(("flags", "error"), [
    ({"rm_type": "mathh"}, "--rm-type 'mathh' is unknown"),
    ({"rm_type": "remote_rm"}, "needs --rm-url"),
    ({"rm_type": "dapo"}, "set --reward-key score"),
    ({"reward_timeout_s": 0}, "reward_timeout_s"),
])  # fmt: skip
def test_the_config_refuses_what_cannot_score(flags, error):
    with pytest.raises((ConfigError, ValueError), match=error):
        RunConfig(**flags)
    RunConfig(rm_type="remote_rm", rm_url="http://127.0.0.1:1/rm")
    RunConfig(rm_type="mathh", custom_rm_path="pkg.fn")  # a custom reward decides itself
