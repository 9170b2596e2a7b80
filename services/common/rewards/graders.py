"""The built-in graders of the reward hub (services/common/rewards/hub.py), as Miles routes
`--rm-type`: pure functions of (response, label, metadata), run in a worker process (a hung or
exploding grader costs its sample, never the producer).

Each grader is an extraction (the part of the response it grades; None: nothing to grade) and a
comparison with the label. The `boxed_` prefix replaces the extraction with the response's last
`\\boxed{...}`.

- `math`: the last `\\boxed{}` against the label, equal when math-verify (HF) says so: it parses
  LaTeX and plain expressions into sympy, so `\\frac{1}{2}`, `0.5` and `1/2` are one answer, as
  are `x^2+2x+1` and `(x+1)^2`. Miles grades with verl's `grade_answer` (string normalisation,
  then sympy); math-verify accepts those forms and more (sets, intervals, equations). 1 or 0.
- `deepscaler`: the text after the last `</think>` (or after `###Response`; neither: 0), then
  graded as `math`. 1 or 0.
- `dapo`: DAPO's Minerva rule: the last `Answer: ...` line in the response's last 300
  characters, normalised (Minerva's substitutions), must equal the integer label.
  {"score": 1.0 or -1.0, "acc": 1.0 or 0.0}: train on it with `--reward-key score`.
- `f1`: SQuAD's token F1 of the response against the label (lower case, no punctuation or
  articles). In [0, 1].
- `reasoning_gym`: the dataset's own `score_answer` (named by `metadata.source_dataset`, as
  `--task reasoning-gym` writes it) on the response (services/tasks/reasoning_gym.py).
- `gpqa`: the chosen letter (after the last `</think>`: "answer is C", "C is correct", else the
  last standalone capital) against the label (a letter, a 0-based index, or a choice's text;
  `metadata.correct_letter`, `metadata.choices` or `metadata.valid_letters` refine it). 1 or 0.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


# ---- math -----------------------------------------------------------------------------------


def _parse(text: str):
    from math_verify import parse

    return parse(text if "\\boxed" in text or "$" in text else f"\\boxed{{{text}}}")


def same_answer(answer: str, label: Any) -> bool:
    """math-verify's equivalence of an answer and the label (a `\\boxed{}` label is unboxed)."""
    from math_verify import verify

    gold = str(label).strip() if label is not None else ""
    if not gold or not answer.strip():
        return False
    gold = last_boxed(gold) or gold
    parsed_gold = _parse(gold)
    parsed = _parse(answer)
    if not parsed_gold or not parsed:
        return answer.strip() == gold
    return bool(verify(parsed_gold, parsed))


def math_compare(answer: str, label: Any, metadata: dict) -> float:
    return 1.0 if same_answer(answer, label) else 0.0


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
            "\\dots", "<|im_end|>"]  # fmt: skip
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
    number = float(minerva_normalize(str(label)))  # DAPO's labels are integers; anything else raises
    if not number.is_integer():
        raise ValueError(f"dapo's label must be an integer (got {label!r:.40})")
    gold = str(int(number))
    right = minerva_normalize(answer) == gold
    return {"score": 1.0 if right else -1.0, "acc": 1.0 if right else 0.0}


# ---- f1 -------------------------------------------------------------------------------------


def _normalize_words(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


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
    r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])\b",
    r"\b([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])\b",
)]  # fmt: skip


def _plain(text: Any) -> str:
    return " ".join(re.sub(r"[^a-z0-9]+", " ", str(text).lower()).split())


def _choices(metadata: dict) -> list[str]:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        return [str(v) for v in choices.values()]
    return [str(c) for c in choices] if isinstance(choices, list) else []


def _letters(metadata: dict) -> str:
    valid = metadata.get("valid_letters")
    if isinstance(valid, (list, str)) and valid:
        return "".join(str(v).strip().upper() for v in valid)
    n = len(_choices(metadata))
    return string.ascii_uppercase[: n] if n else "ABCDEFGH"


def _correct_letter(label: Any, metadata: dict, letters: str) -> str | None:
    given = metadata.get("correct_letter")
    if isinstance(given, str) and given.strip().upper() in letters:
        return given.strip().upper()
    if isinstance(label, str) and len(label.strip()) == 1 and label.strip().upper() in letters:
        return label.strip().upper()
    if isinstance(label, (int, float)) and not isinstance(label, bool) and 0 <= int(label) < len(letters):
        return letters[int(label)]
    choices = [_plain(c) for c in _choices(metadata)]
    if label is not None and _plain(label) in choices:
        return letters[choices.index(_plain(label))] if choices.index(_plain(label)) < len(letters) else None
    return None


def gpqa_extract(response: str) -> str | None:
    return response.rsplit("</think>", 1)[-1]


def chosen_letter(text: str, letters: str) -> str | None:
    for pattern in _LETTER_PATTERNS:
        m = pattern.search(text)
        if m and m.group(1).upper() in letters:
            return m.group(1).upper()
    standalone = [c for c in re.findall(r"\b([A-Z])\b", text) if c in letters]
    return standalone[-1] if standalone else None


def gpqa_compare(answer: str, label: Any, metadata: dict) -> float:
    letters = _letters(metadata)
    correct, chosen = _correct_letter(label, metadata, letters), chosen_letter(answer, letters)
    if correct is not None and chosen is not None:
        return 1.0 if chosen == correct else 0.0
    targets = [metadata.get("correct_answer"), metadata.get("answer_text")]
    if isinstance(label, str) and len(label.strip()) > 1:  # a letter or an index is no answer text
        targets.append(label)
    if correct is not None and (choices := _choices(metadata)) and letters.index(correct) < len(choices):
        targets.append(choices[letters.index(correct)])
    text = f" {_plain(answer)} "
    if any(t is not None and _plain(t) and f" {_plain(t)} " in text for t in targets):
        return 1.0
    return 1.0 if chosen is not None and isinstance(label, str) and chosen == label.strip().upper() else 0.0


# ---- reasoning_gym --------------------------------------------------------------------------


_rg_datasets: dict = {}
"""reasoning-gym datasets this worker re-created, by (name, size, seed, settings)."""


def reasoning_gym_score(answer: str, label: Any, metadata: dict, prompt: Any) -> float:
    """The dataset's own score_answer (named by metadata.source_dataset) on the stripped answer,
    against the entry itself when the row says where it came from (`rg_origin`, as --task
    reasoning-gym writes it: the dataset is re-created with the same size, seed and settings),
    else against the row's label and metadata."""
    import reasoning_gym

    name = metadata.get("source_dataset")
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
        return float(dataset.score_answer(answer.strip(), dataset[index]))
    entry = {"question": prompt if isinstance(prompt, str) else "", "answer": label, "metadata": metadata}
    return float(reasoning_gym.get_score_answer_fn(name)(answer.strip(), entry))


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
    "gpqa": Grader(gpqa_extract, gpqa_compare, 0.0),
}


def warm_up() -> None:
    """A worker's start: math-verify and sympy imported before its first sample's clock runs.
    A failure here is left to the samples (each fails with the reason), not to the pool, which
    would restart the worker forever."""
    try:
        same_answer("1", "1")
    except Exception:  # noqa: BLE001 - reported by the first sample that needs it
        pass


def grade(name: str, boxed: bool, response: str, label: Any, metadata: dict,
          prompt: Any = None) -> float | dict[str, float]:  # fmt: skip
    """One sample's reward by the grader `name`; `boxed`: grade the last `\\boxed{}` instead of the
    grader's own extraction. Runs in a worker process (hub.py)."""
    metadata = metadata if isinstance(metadata, dict) else {}
    if name == "reasoning_gym":  # the dataset's own scorer (it may read the question)
        answer = last_boxed(response) if boxed else response
        return 0.0 if answer is None else reasoning_gym_score(answer, label, metadata, prompt)
    grader = GRADERS[name]
    answer = last_boxed(response) if boxed else grader.extract(response)
    if answer is None:
        return grader.missing
    return grader.compare(answer, label, metadata)
