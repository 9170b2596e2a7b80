"""A final answer's text made comparable before any parsing (graders.py, `math` and
`deepscaler`): the string rules of the MATH normaliser that Miles's `grade_answer` applies
(Hendrycks et al. 2021, and the answer normalisation that follows it), so that `\\$20` and `20`,
`\\text{East}` and `east`, `50\\%` and `50`, `\\dfrac12` and `\\frac{1}{2}` are one string;
`decide` compares two answers by them and by their exact values (exact.py).
"""

from __future__ import annotations

import re
from functools import lru_cache
from itertools import accumulate

from services.rewards.exact import HUGE, approximate, far_apart, same_value, value

_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox|mathbf)\{")
_BRACE = re.compile(r"[{}]")
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_DROPPED = ("\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\$", "$", "\\%", "%", "°", "^{\\circ}", "^\\circ",
            "{,}", "\n", "\r", "\t")  # fmt: skip
_LEFT_RIGHT = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])")
_UNIT_WORDS = ("degree", "centimeter", "cm", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
               "year", "foot", "feet", "inch", "yard")  # fmt: skip
_UNIT = re.compile(r"(?<![a-z\\])(" + "|".join(_UNIT_WORDS) + r")(?:e?s)?(?:\^\{?\d+\}?)?(?![a-z])")
_TEXT_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\{(\s*)([a-z]+(?: [a-z]+)*)\s*\}(\^\{?\d\}?)?")
_SCALES = (("trillion", "\\times10^{12}"), ("billion", "\\times10^{9}"), ("million", "\\times10^{6}"))
_THOUSANDS = re.compile(r"(\d),(\d{3})(?!\d)")
_SHORT_LHS = re.compile(r"^[a-z][a-z0-9']?=(?!=)")
_MIXED_LATEX = re.compile(r"^(-?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}$")
_MIXED_PLAIN = re.compile(r"^(-?)(\d+) +(\d+)/(\d+)$")
_FRAC_SHORT = (
    (re.compile(r"\\frac(\d)(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac(\d)\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\{([^{}]*)\}(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\sqrt(\d)"), r"\\sqrt{\1}"),
)
_COMMAND = re.compile(r"\\(?:begin|end|operatorname)\{[a-z*]*\}|\\[a-z]+")
"""A command, with the name an environment or an operator gives it (`\\begin{pmatrix}` is no word)."""
_WORD = re.compile(r"[a-z]{3,}")
_SPACES = re.compile(r"(\\[a-z]+)?\s+(?=([a-z])?)")
"""Spaces, dropped, but for one between a command and a letter (`\\pi r`)."""
_RELATION = re.compile(r"[<>≤≥≠]|\\(?:le|ge|leq|geq|neq|ne|lt|gt)(?![a-z])")
_UNICODE = str.maketrans(
    {"−": "-", "–": "-", "×": "\\times ", "·": "\\cdot ", "÷": "\\div ", "π": "\\pi ", "∞": "\\infty "}
)


def brace_pairs(text: str) -> dict[int, int]:
    """{index of "{": index of the "}" that closes it}, in one pass."""
    pairs, stack = {}, []
    for m in _BRACE.finditer(text):
        if m.group(0) == "{":
            stack.append(m.start())
        elif stack:
            pairs[stack.pop()] = m.start()
    return pairs


def _unwrap(text: str) -> str:
    """Without enclosing math delimiters, `\\text{...}`-like wrappers and outer braces, layer by
    layer (each in constant time: a deep answer costs one pass)."""
    pairs, s, e = brace_pairs(text), 0, len(text)
    while True:
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        before = (s, e)
        for left, right in _DELIMITERS:
            if e - s > len(left) + len(right) and text.startswith(left, s) and text.endswith(right, s, e):
                s, e = s + len(left), e - len(right)
                break
        m = _WRAPPER.match(text, s)
        if m and pairs.get(m.end() - 1) == e - 1:
            s, e = m.end(), e - 1
        elif s < e and text[s] == "{" and pairs.get(s) == e - 1:
            s, e = s + 1, e - 1
        if (s, e) == before:
            return text[s:e]


def _units(text: str) -> tuple[str, frozenset[str]]:
    """The text without its units (`\\text{ cm}`, `meters`, `^\\circ`) and the units it had: a
    `\\text{}` that names a unit, or one that starts with a space at the end of a number."""
    found = set()

    def take(m: re.Match) -> str:
        found.add(m.group(1))
        return ""

    def text_unit(m: re.Match) -> str:
        if _UNIT.fullmatch(m.group(2)):
            return _UNIT.sub(take, m.group(2))
        if m.group(1) and m.end() == len(text) and re.search(r"\d\s*$", text[: m.start()]):
            found.add(m.group(2))
            return ""
        return m.group(0)

    text = _TEXT_UNIT.sub(text_unit, text)
    if re.search(r"\d", text):
        text = _UNIT.sub(take, text)
    return text, frozenset("foot" if u == "feet" else u for u in found)


def _mixed(text: str) -> str:
    """A mixed number (`2\\frac{1}{2}`, `7 3/4`) as a sum, as the MATH answers write them."""
    m = _MIXED_LATEX.match(text) or _MIXED_PLAIN.match(text)
    if m is None:
        return text
    sign, whole, num, den = m.groups()
    return f"{sign}({whole}+\\frac{{{num}}}{{{den}}})"


@lru_cache(maxsize=4096)
def normalize(text: str) -> tuple[str, frozenset[str]]:
    """The comparable string (lower case, no spaces, no dollars, percent signs, degree marks,
    `\\left`/`\\right`, spacing commands, thousands separators or enclosing `\\text{}`), with its
    units apart: ("5", {"cm"}) for `5\\text{ cm}`."""
    text = _unwrap(str(text)).translate(_UNICODE)
    for old in _DROPPED:
        text = text.replace(old, "")
    text = _LEFT_RIGHT.sub("", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\\\", "\\")
    text = text.replace("\\ ", " ").lower().strip()
    text, units = _units(text)
    for word, power in _SCALES:
        text = re.sub(rf"(\d)\s*{word}\b", lambda m, p=power: m.group(1) + p, text)
    text = re.sub(r"\s+(?:or|and)\s+", ",", text)
    for pattern, repl in _FRAC_SHORT:
        text = pattern.sub(repl, text)
    text = _mixed(_unwrap(text))
    for _ in range(3):
        text = _THOUSANDS.sub(r"\1\2", text)
    text = _SPACES.sub(lambda m: (m.group(1) or "") + (" " if m.group(1) and m.group(2) else ""), text)
    text = _SHORT_LHS.sub("", text) if text.count("=") == 1 else text
    text = re.sub(r"(^|[^\d.])\.(\d)", r"\g<1>0.\2", text)
    return _unwrap(text), units


def is_words(normalized: str) -> bool:
    """A word or a phrase (`east`, `no solution`: a run of three letters or more outside LaTeX
    commands), which a parser would read as a product of letters (`tea` = t*e*a = `eat`)."""
    return _WORD.search(_COMMAND.sub(" ", normalized)) is not None


def nesting(text: str) -> int:
    """How deep brackets and braces nest in the text (math-verify's parser is exponential in the
    depth of plain groups, so deep answers are not sent to it)."""
    depths = accumulate(text, lambda d, c: d + 1 if c in "([{" else max(d - 1, 0) if c in ")]}" else d, initial=0)
    return max(depths)


@lru_cache(maxsize=4096)
def _read(text: str):
    normalized, units = normalize(text)
    words = is_words(normalized)
    return normalized, units, words, None if words else value(normalized)


def decide(answer: str, gold: str) -> bool | None:
    """Whether two answers are one, by their normalised strings and exact values; None when
    that takes a symbolic parser. A word answer is equal only to the same words; answers with
    different units (`3 days`, `3 weeks`) differ."""
    a, a_units, a_words, a_value = _read(answer)
    g, g_units, g_words, g_value = _read(gold)
    if a_units and g_units and a_units != g_units:
        return False
    if a == g:
        return bool(a)
    if a_words or g_words or bool(_RELATION.search(a)) != bool(_RELATION.search(g)):
        return False
    if HUGE in (a_value, g_value) or (a_value is not None and g_value is not None):
        return same_value(a_value, g_value)
    a_near, g_near = _near(a), _near(g)
    if a_near is not None and g_near is not None and far_apart(a_near, g_near):
        return False
    return None


_near = lru_cache(maxsize=4096)(approximate)
