"""The built-in graders of the reward hub (services/rewards/hub.py), as Miles routes
`--rm-type`: pure functions of (response, label, metadata), run in a worker process (a hung or
exploding grader costs its sample, never the producer).

Each grader is an extraction (the part of the response it grades; None: nothing to grade) and a
comparison with the label. The `boxed_` prefix replaces the extraction with the response's last
`\\boxed{...}`. docs/miles-differences.md lists where a score differs from Miles's on purpose
(tests/unit/test_reward_parity.py holds the corpus).

- `math`: the last `\\boxed{}` against the label, cheapest check first: the same text; the same
  text after the MATH normaliser's rules that Miles's `grade_answer` applies (answers.py: `\\$20`
  is 20, `\\text{East}` is east, `50\\%` is 50; a word answer equals only the same words); the
  same exact value (exact.py: numbers, fractions, polynomials, tuples and sets, `0.5` = `1/2`,
  `(x+1)^2` = `x^2+2x+1`; roots in floats, to find a difference); else math-verify (HF), which
  parses LaTeX into sympy, for answers of at most 300 characters nested at most 6 deep (its
  parser is exponential in the depth of plain groups). 1 or 0.
- `deepscaler`: the text after the last `</think>` (or after `###Response`; neither: 0), then
  graded as `math`. 1 or 0.
- `dapo`: DAPO's Minerva rule: the last `Answer: ...` line in the response's last 300
  characters, normalised (Minerva's substitutions; `<|im_end|>`, `<|endoftext|>` dropped), must
  equal the integer label. {"score": 1.0 or -1.0, "acc": 1.0 or 0.0}: train on it with
  `--reward-key score`.
- `f1`: SQuAD's token F1 of the response against the label (lower case, no punctuation or
  articles). In [0, 1].
- `reasoning_gym`: the dataset's own `score_answer` (named by `metadata.source_dataset`, as
  `--task reasoning-gym` writes it) on the answer: the last `<answer>` tag, else the response's
  first line (services/tasks/reasoning_gym.py); 1 or 0 (full marks or not) where the row's
  `metadata.rg_scoring` is `exact` (`--rg-scoring exact`).
- `gpqa`: the chosen letter, A-J unless the choices say fewer (after the last `</think>`:
  "answer is C", "C is correct", else the last standalone capital; the pronoun I and the article
  a are words, not choices) against the label (a letter, a 0-based index, or a choice's text;
  `metadata.correct_letter`, `metadata.choices` or `metadata.valid_letters` refine it). 1 or 0.
- `ifbench`: AllenAI IFBench's strict rule (after the last `</think>`): 1 if the response follows
  every instruction of `metadata.instruction_id_list` with `metadata.kwargs`, else 0
  (services/rewards/ifbench/: the checkers of IFBench's 83 instruction ids).
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from services.rewards.answers import brace_pairs, decide, nesting
from services.rewards.ifbench import followed
from services.rewards.ifbench.text import no_punctuation

_BOXED = re.compile(r"\\boxed *\{")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces allowed), or None."""
    m = _BOXED.match(text, text.rfind("\\boxed"))
    close = brace_pairs(text[m.end() - 1 :]).get(0) if m else None  # the "}" that closes its "{" (index 0)
    return None if close is None else text[m.end() : m.end() - 1 + close]


# ---- math -----------------------------------------------------------------------------------


_MV_MAX_LENGTH, _MV_MAX_NESTING = 300, 6
"""Answers longer or deeper than this are not sent to math-verify: its LaTeX parser takes
hundreds of milliseconds at four levels of plain groups and its 5 s timeout at fourteen."""


@lru_cache(maxsize=1024)
def _parse(text: str):
    """math-verify's reading of an answer: escaped and bare dollars dropped (a dollar would make
    it look for `$...$` math instead of reading the answer), then boxed for its boxed rule."""
    from math_verify import parse

    return parse("\\boxed{" + text.replace("\\$", "").replace("$", "") + "}")


_HEAVY = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\w\s*\^|\^\s*\{?\s*-?\d{4,}|\d[eE][-+]?\d{3,}|\d{3,}\s*!"
                    r"|\\binom\s*\{\s*\d{4,}")
"""Towers of powers, powers past 999 (`2^{1000}`, `1e999`), factorials past 99, large binomials:
sympy would compute them."""


def _symbolic(answer: str, gold: str) -> bool:
    from math_verify import verify

    if any(len(t) > _MV_MAX_LENGTH or nesting(t) > _MV_MAX_NESTING or _HEAVY.search(t) for t in (answer, gold)):
        return False
    parsed_gold, parsed = _parse(gold), _parse(answer)
    return bool(parsed_gold and parsed and verify(parsed_gold, parsed))


def math_compare(answer: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 if an answer equals the label (a `\\boxed{}` label is unboxed) by the module's `math` rule, else 0.0."""
    gold = str(label).strip() if label is not None else ""
    answer = answer.strip()
    if not gold or not answer:
        return 0.0
    gold = (last_boxed(gold) or gold).strip()
    if answer == gold:
        return 1.0
    verdict = decide(answer, gold)
    return float(verdict if verdict is not None else _symbolic(answer, gold))


def after_think(response: str) -> str:
    """The answer of `gpqa` and `ifbench`: the text after the last `</think>`, else the whole response."""
    return response.rsplit("</think>", 1)[-1]


def deepscaler_extract(response: str) -> str | None:
    if "</think>" in response:
        tail = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        tail = response.split("###Response", 2)[1]
    else:
        return None
    return last_boxed(tail)


# ---- dapo (Minerva's normalisation) ---------------------------------------------------------

_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]  # fmt: skip
_REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
            "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2",
            "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"',
            "\\dots", "<|im_end|>", "<|endoftext|>"]  # fmt: skip
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def minerva_normalize(answer: str) -> str:
    """Minerva's normalisation of a final answer (Lewkowycz et al. 2022, appendix D)."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_extract(response: str) -> str | None:
    found = _ANSWER_LINE.findall(response[-300:])
    return found[-1] if found else None


def dapo_compare(answer: str, label: Any, metadata: dict) -> dict[str, float]:
    if len(str(label)) > 1000:
        raise ValueError(f"dapo's label must be an integer (got {len(str(label))} characters)")
    number = float(minerva_normalize(str(label)))  # DAPO's labels are integers; anything else raises
    if not number.is_integer():
        raise ValueError(f"dapo's label must be an integer (got {label!r:.40})")
    gold = str(int(number))
    right = minerva_normalize(answer) == gold
    return {"score": 1.0 if right else -1.0, "acc": 1.0 if right else 0.0}


# ---- f1 -------------------------------------------------------------------------------------


def _normalize_words(text: str) -> str:
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", no_punctuation(text.lower())).split())


def f1_compare(answer: str, label: Any, metadata: dict) -> float:
    pred, gold = _normalize_words(answer), _normalize_words(str(label if label is not None else ""))
    special = {"yes", "no", "noanswer"}
    if (pred in special or gold in special) and pred != gold:
        return 0.0
    common = Counter(pred.split()) & Counter(gold.split())
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred.split()), same / len(gold.split())
    return 2 * precision * recall / (precision + recall)


# ---- gpqa -----------------------------------------------------------------------------------

_LETTER_PATTERNS = [re.compile(p, re.IGNORECASE) for p in (
    r"(?:answer|option|choice)\s*(?:is|:)?\s*[(*]*([A-Z])\b",
    r"\b([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
    r"final\s*(?:answer|option)\s*(?:is|:)?\s*[(*]*([A-Z])\b",
)]  # fmt: skip
_PRONOUN_AFTER = re.compile(r"\s*['’]|\s+(?:am|was|think|believe|guess|would|will|can|could|should|might|must|need|"
                            r"feel|suppose|say|mean|know|see|get|have|had|do|did|chose|choose|pick|picked|go|went|"
                            r"hope|assume|agree|recall|conclude|also|just|really)\b")  # fmt: skip
_DEFAULT_LETTERS = "ABCDEFGHIJ"


def _plain(text: Any) -> str:
    return " ".join(re.sub(r"[^a-z0-9]+", " ", str(text).lower()).split())


def _choices(metadata: dict) -> list[str]:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        return [str(v) for v in choices.values()]
    return [str(c) for c in choices] if isinstance(choices, (list, tuple)) else []


def _letters(metadata: dict) -> str:
    valid = metadata.get("valid_letters")
    if isinstance(valid, (list, str)) and valid:
        return "".join(str(v).strip().upper() for v in valid)
    return string.ascii_uppercase[: len(_choices(metadata))] or _DEFAULT_LETTERS


def _correct_letter(label: Any, metadata: dict, letters: str) -> str | None:
    """As Miles reads it: `metadata.correct_letter`, else a one-letter label, overridden by a
    0-based index label; else the letter of the choice whose text is the label."""
    given = metadata.get("correct_letter")
    correct = given.strip().upper() if isinstance(given, str) and given.strip() else None
    if isinstance(label, str) and len(label.strip()) == 1 and label.strip().upper() in letters and not correct:
        correct = label.strip().upper()
    elif isinstance(label, (int, float)) and not isinstance(label, bool) and 0 <= label < len(letters):
        correct = letters[int(label)]
    choices = [_plain(c) for c in _choices(metadata)]
    if not correct and isinstance(label, str) and label.strip() and _plain(label) in choices:
        index = choices.index(_plain(label))
        correct = letters[index] if index < len(letters) else None
    return correct


_WORD_AFTER, _ARTICLE_AFTER = re.compile(r"\s*[A-Za-z'’]"), re.compile(r"\s+[a-z]")


def _names_a_choice(text: str, m: re.Match, explicit: bool) -> bool:
    """Whether a matched letter is a choice, not the pronoun I or the article a: "I think", "I'm",
    "answer is a bit" are words; "answer is I.", "(I)" and a final "I" are choices."""
    letter, end = m.group(1), m.end()
    if letter in "Ii":
        return (_PRONOUN_AFTER if explicit else _WORD_AFTER).match(text, end) is None
    return not (letter == "a" and _ARTICLE_AFTER.match(text, end))


def chosen_letter(text: str, letters: str) -> str | None:
    for pattern in _LETTER_PATTERNS:
        m = next((m for m in pattern.finditer(text) if _names_a_choice(text, m, explicit=True)), None)
        if m and m.group(1).upper() in letters:
            return m.group(1).upper()
    standalone = [m.group(1) for m in re.finditer(r"\b([A-Z])\b", text)
                  if m.group(1) in letters and _names_a_choice(text, m, explicit=False)]  # fmt: skip
    return standalone[-1] if standalone else None


def gpqa_compare(answer: str, label: Any, metadata: dict) -> float:
    letters = _letters(metadata)
    correct, chosen = _correct_letter(label, metadata, letters), chosen_letter(answer, letters)
    if correct is not None and chosen is not None:
        return 1.0 if chosen == correct else 0.0
    targets = [metadata.get("correct_answer"), metadata.get("answer_text")]
    if isinstance(label, str) and len(label.strip()) > 1:  # a letter or an index is no answer text
        targets.append(label)
    choices = _choices(metadata)
    if correct is not None and len(correct) == 1 and correct in letters and letters.index(correct) < len(choices):
        targets.append(choices[letters.index(correct)])
    text = f" {_plain(answer)} "
    if any(t is not None and _plain(t) and f" {_plain(t)} " in text for t in targets):
        return 1.0
    return 1.0 if chosen is not None and isinstance(label, str) and chosen == label.strip().upper() else 0.0


# ---- reasoning_gym --------------------------------------------------------------------------


_rg_datasets: dict = {}
"""reasoning-gym datasets this worker re-created, by (name, size, seed, settings)."""


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def reasoning_gym_extract(response: str) -> str:
    """The answer as reasoning-gym's datasets expect it: the last `<answer>...</answer>`, else the
    first non-empty line after the last `</think>`. What follows the answer earns nothing (a
    scorer that gives credit by position would otherwise pay for padding after it)."""
    if tagged := _ANSWER_TAG.findall(response):
        return tagged[-1].strip()
    return next((line.strip() for line in after_think(response).splitlines() if line.strip()), "")


def reasoning_gym_score(answer: str, label: Any, metadata: dict, prompt: Any) -> float:
    """The dataset's own score_answer (named by metadata.source_dataset) on the stripped answer,
    against the entry itself when the row says where it came from (`rg_origin`, as --task
    reasoning-gym writes it: the dataset is re-created with the same size, seed and settings),
    else against the row's label and metadata. `rg_scoring: exact` in the metadata: 1 for full
    marks, else 0."""
    import reasoning_gym

    name, scoring = metadata.get("source_dataset"), metadata.get("rg_scoring", "dataset")
    if scoring not in ("dataset", "exact"):
        raise ValueError(f"metadata.rg_scoring {scoring!r:.40}: dataset or exact (--rg-scoring)")
    if not isinstance(name, str):
        raise ValueError("rm_type reasoning_gym needs metadata.source_dataset (rows written by --task reasoning-gym "
                         "carry it)")  # fmt: skip
    origin, index = metadata.get("rg_origin"), metadata.get("source_index")
    if isinstance(origin, dict) and isinstance(index, int):
        key = (name, origin["size"], origin["seed"], json.dumps(origin["options"], sort_keys=True))
        if key not in _rg_datasets:
            _rg_datasets[key] = reasoning_gym.create_dataset(name, size=origin["size"], seed=origin["seed"],
                                                             **origin["options"])  # fmt: skip
        dataset = _rg_datasets[key]
        score = float(dataset.score_answer(answer.strip(), dataset[index]))
    else:
        entry = {"question": prompt if isinstance(prompt, str) else "", "answer": label, "metadata": metadata}
        score = float(reasoning_gym.get_score_answer_fn(name)(answer.strip(), entry))
    if scoring == "exact":  # full marks or nothing: no partial credit to hedge for
        # `==`, not `>=`: a scorer that sums 1/len per position can overshoot 1.0 by rounding
        # (spell_backward: the word and more, 9 or 11 letters, sums to 1.0000000000000002)
        return 1.0 if score == 1.0 else 0.0
    return score


# ---- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grader:
    extract: Callable[[str], str | None]
    """The part of the response graded; None: nothing to grade (the grader's `missing` reward)."""
    compare: Callable[[str, Any, dict], float | dict[str, float]]
    missing: float | dict[str, float]


GRADERS: dict[str, Grader] = {
    "math": Grader(last_boxed, math_compare, 0.0),
    "deepscaler": Grader(deepscaler_extract, math_compare, 0.0),
    "dapo": Grader(dapo_extract, dapo_compare, {"score": -1.0, "acc": 0.0}),
    "f1": Grader(lambda r: r, f1_compare, 0.0),
    "gpqa": Grader(after_think, gpqa_compare, 0.0),
    "ifbench": Grader(after_think, lambda answer, _label, metadata: float(all(followed(answer, metadata))), 0.0),
}


def warm_up() -> None:
    """A worker's start: math-verify and sympy imported before its first sample's clock runs,
    then, in a worker process, what is loaded frozen out of the garbage collector (a full
    collection over sympy's objects paused one grading in a few thousand by 30-40 ms). A failure
    here is left to the samples (each fails with the reason), not to the pool, which would
    restart the worker forever."""
    with contextlib.suppress(Exception):  # reported by the first sample that needs it
        math_compare("1", "1")
        _symbolic("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")
    if multiprocessing.parent_process() is not None:
        gc.collect()
        gc.freeze()


def grade(name: str, boxed: bool, response: str, label: Any, metadata: dict,
          prompt: Any = None) -> float | dict[str, float]:  # fmt: skip
    """One sample's reward by the grader `name`; `boxed`: grade the last `\\boxed{}` instead of the
    grader's own extraction. Runs in a worker process (hub.py)."""
    metadata = metadata if isinstance(metadata, dict) else {}
    if name == "reasoning_gym":  # the dataset's own scorer (it may read the question)
        answer = last_boxed(response) if boxed else reasoning_gym_extract(response)
        return 0.0 if answer is None else reasoning_gym_score(answer, label, metadata, prompt)
    grader = GRADERS[name]
    answer = last_boxed(response) if boxed else grader.extract(response)
    if answer is None:
        return grader.missing
    return grader.compare(answer, label, metadata)
