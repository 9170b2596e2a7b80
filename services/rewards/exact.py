"""Exact values of simple answers, so that most comparisons need no symbolic parser: numbers
(integers, decimals, `a/b`, `\\frac{a}{b}`, `1e3`), and rational expressions of one-letter
variables and pi with `+ - * / ^` (integer powers), `\\cdot`, `\\times`, implicit products and
groups, and tuples, intervals and sets of them.

- `value(normalized)`: a normalised answer's (answers.normalize) value at three fixed rational
  points of its variables (a number is the same at every point), or a Collection of such values;
  HUGE past the bounds; None for anything else (a root, an equation, a function...), which the
  caller leaves to math-verify. Two answers whose values differ at a point differ; two rational
  expressions that agree at three unrelated points with large denominators are one expression
  (a false agreement needs a common root of their difference at all three). Pi is transcendental,
  so it counts as one more variable: an identity in pi is an identity in a variable.
- `approximate(normalized)`: the value in floats at small points, square roots and pi allowed;
  two answers whose approximations are `far_apart` differ (an exact check settles the others).

Bounds: no constant power above 512 or past 8192 bits, nesting at most 100 deep: a hostile answer
is refused in microseconds, never computed.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

POINTS = 3
MAX_EXPONENT, MAX_BITS, MAX_DEPTH, MAX_LENGTH = 512, 8192, 100, 20_000
_TOKEN = re.compile(r"\d+\.?\d*|\.\d+|\\[a-z]+|\\[{}]|[a-z]|[-+*/^(){}\[\],]| ")
_OPERATORS = {"\\cdot": "*", "\\times": "*", "\\div": "/", "\\frac": "\\frac", "\\{": "\\{", "\\}": "\\}",
              "\\pi": "\\pi", "\\sqrt": "\\sqrt"}  # fmt: skip


_VARIABLES = {c: tuple(Fraction(1_000_003 + 7_919 * k + 104_729 * p, 97 + 13 * k + 31 * p * p) for p in range(POINTS))
              for k, c in enumerate("abcdefghijklmnopqrstuvwxyz", 1)}  # fmt: skip
_PI = tuple(Fraction(314_159_265 + 2_718 * p, 100_000_007 + 577 * p) for p in range(POINTS))
_NEAR_VARIABLES = {c: tuple(1 + 2 * ((0.618034 * (i + 1) + 0.414214 * p) % 1) for p in range(POINTS))
                   for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}  # fmt: skip
"""The points of approximate(): small values, so that rounding stays far below its tolerance."""
TOLERANCE = 1e-6


_DIGITS, _STARTERS = "0123456789.", ("(", "\\frac", "\\sqrt", "\\pi")
"""What starts a number, and the other tokens that start an implicit product's factor."""


class Refused(ValueError):
    """Not an answer this module reads."""


class TooLarge(Refused):
    """A number or a power past the bounds: no answer worth computing."""


HUGE = "huge"
"""value() of an answer past the bounds (`9^{9^{9^9}}`): it equals no other answer."""
_SCIENTIFIC = re.compile(r"-?\d+(?:\.\d*)?e[-+]?\d{1,3}")


@dataclass(frozen=True)
class Collection:
    """A tuple or interval (ordered, with its brackets) or a set (unordered; a bare list too)."""

    brackets: str
    items: tuple

    def key(self):
        items = [v.key() if isinstance(v, Collection) else v for v in self.items]
        return (self.brackets, tuple(sorted(Counter(map(repr, items)).items())) if self.brackets == "set" else
                tuple(items))  # fmt: skip


Value = tuple[Fraction, ...]


def _too_large(v: Value, why: str) -> Refused:
    """A constant past the bounds is HUGE; an expression of variables is only not read here."""
    return TooLarge(why) if all(x == v[0] for x in v) else Refused(why)


def _checked(v: Value) -> Value:
    if isinstance(v[0], float):
        if not all(math.isfinite(x) and abs(x) < 1e100 for x in v):
            raise Refused("out of the float range")
    elif any(x.numerator.bit_length() > MAX_BITS or x.denominator.bit_length() > MAX_BITS for x in v):
        raise _too_large(v, "too large")
    return v


class _Reader:
    """A recursive-descent reader of the token list; each method returns a value."""

    def __init__(self, tokens: list[str], near: bool = False):
        self.tokens, self.i, self.depth, self.near = tokens, 0, 0, near
        self.variables = _NEAR_VARIABLES if near else _VARIABLES

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise Refused("the answer ends too soon")
        self.i += 1
        return tok

    def listing(self, closers: tuple[str, ...]) -> list:
        items = [self.sum()]
        while self.peek() == ",":
            self.take()
            items.append(self.sum())
        if self.peek() is not None and self.peek() not in closers:
            raise Refused("trailing text")
        return items

    def sum(self):
        sign = 1
        while self.peek() in ("+", "-"):
            sign = -sign if self.take() == "-" else sign
        first = self.term()
        if isinstance(first, Collection) and sign == 1 and self.peek() not in ("+", "-"):
            return first
        total = self._scaled(first, sign)
        while self.peek() in ("+", "-"):
            sign = 1 if self.take() == "+" else -1
            total = _checked(tuple(a + b for a, b in zip(total, self._scaled(self.term(), sign), strict=True)))
        return total

    @staticmethod
    def _scaled(v, sign: int) -> Value:
        if isinstance(v, Collection):
            raise Refused("arithmetic on a collection")
        return v if sign == 1 else tuple(-x for x in v)

    def term(self):
        product, after_division = self.factor(), False
        while True:
            tok = self.peek()
            implicit = tok is not None and (tok[0] in _DIGITS or tok.isalpha() or tok in _STARTERS)
            if tok not in ("*", "/") and not implicit:
                return product
            if implicit and (after_division or tok[0] in _DIGITS):  # 1/2x, x2, (x)2: read otherwise elsewhere
                raise Refused("ambiguous implicit product")
            if tok in ("*", "/"):
                self.take()
            left, right = self._scaled(product, 1), self._scaled(self.factor(), 1)
            if tok == "/" and any(x == 0 for x in right):
                raise Refused("division by zero")
            product = _checked(tuple(a / b if tok == "/" else a * b for a, b in zip(left, right, strict=True)))
            after_division = tok == "/"

    def factor(self) -> Value:
        if self.peek() in ("+", "-"):
            sign = -1 if self.take() == "-" else 1
            return self._scaled(self.factor(), sign)
        base = self.primary()
        if self.peek() != "^":
            return base
        self.take()
        exponent, base = self._scaled(self.exponent(), 1), self._scaled(base, 1)
        if any(abs(e) > MAX_EXPONENT for e in exponent):
            raise _too_large(base, "too large a power")
        if self.near:
            if any(b <= 0 and e != int(e) or b == 0 and e < 0 for b, e in zip(base, exponent, strict=True)):
                raise Refused("no real power")
            return _checked(tuple(b**e for b, e in zip(base, exponent, strict=True)))
        e = exponent[0]
        if any(x != e for x in exponent) or e.denominator != 1:
            raise Refused("not an integer power")
        if any(x == 0 for x in base) and e < 0:
            raise Refused("division by zero")
        if any(max(x.numerator.bit_length(), x.denominator.bit_length()) * abs(e) > MAX_BITS for x in base):
            raise _too_large(base, "too large")
        return tuple(x ** int(e) for x in base)

    def exponent(self) -> Value:
        """`^2`, `^{12}`, `^(n)`, `^-1`: an unbraced power is one digit (`x^23` is x^2 times 3)."""
        tok = self.peek()
        if tok == "-":
            self.take()
            return self._scaled(self.exponent(), -1)
        if tok is not None and tok[0].isdigit():
            if len(tok) > 1:
                raise Refused("an unbraced power of several digits")
            return self._number(self.take())
        return self.primary()

    def primary(self):
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            return self._number(tok)
        if tok.isalpha():
            return self.variables[tok]
        if tok == "\\pi":  # transcendental: an identity in pi is an identity in a variable
            return (math.pi,) * POINTS if self.near else _PI
        if tok == "\\sqrt" and self.near:
            return self.root()
        if tok == "\\frac":
            num = self._scaled(self.group(), 1)
            den = self._scaled(self.group(), 1)
            if any(x == 0 for x in den):
                raise Refused("division by zero")
            return tuple(a / b for a, b in zip(num, den, strict=True))
        if tok in ("(", "[", "{", "\\{"):
            return self.bracketed(tok)
        raise Refused(f"unexpected {tok!r}")

    def group(self) -> Value:
        tok = self.peek()
        if tok is None or not (tok == "{" or tok[0].isdigit() or tok.isalpha()):
            raise Refused("not a group")
        return self.primary()

    def root(self) -> Value:
        if self.peek() == "[":
            raise Refused("an n-th root")
        radicand = self._scaled(self.group(), 1)
        if any(x < 0 for x in radicand):
            raise Refused("no real root")
        return tuple(math.sqrt(x) for x in radicand)

    def bracketed(self, opener: str):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Refused("too deep")
        closers = {"(": (")", "]"), "[": (")", "]"), "{": ("}",), "\\{": ("\\}",)}[opener]
        items = self.listing(closers)
        closer = self.take()
        self.depth -= 1
        if len(items) == 1 and opener + closer in ("()", "{}"):
            return items[0]
        if opener in ("{", "\\{"):
            return Collection("set", tuple(items))
        if len(items) == 1:
            raise Refused("a group that is no number")
        return Collection(opener + closer, tuple(items))

    def _number(self, tok: str) -> Value:
        try:
            x = Fraction(tok.rstrip(".") or "0")
        except ValueError as e:  # more digits than int() reads
            raise TooLarge("too long a number") from e
        return (float(x) if self.near else x,) * POINTS


def _tokens(text: str) -> list[str]:
    tokens, pos = [], 0
    for m in _TOKEN.finditer(text):
        if m.start() != pos:
            raise Refused(f"unreadable {text[pos:m.start()]!r:.20}")
        tok = m.group(0)
        pos = m.end()
        if tok == " ":  # between a command and a letter (answers.normalize keeps it)
            continue
        if tok.startswith("\\") and tok not in _OPERATORS:
            raise Refused(f"command {tok}")
        tokens.append(_OPERATORS.get(tok, tok))
    if pos != len(text):
        raise Refused(f"unreadable {text[pos:]!r:.20}")
    return tokens


def value(normalized: str):
    """The answer's value (a tuple of exact rationals, one per point) or Collection; HUGE past
    the bounds; None when it is not a simple answer (see the module's docstring)."""
    if not normalized or len(normalized) > MAX_LENGTH:
        return None
    if _SCIENTIFIC.fullmatch(normalized):
        return (Fraction(normalized),) * POINTS
    try:
        items = _Reader(_tokens(normalized)).listing(())
        return items[0] if len(items) == 1 else Collection("set", tuple(items))
    except TooLarge:
        return HUGE
    except (Refused, RecursionError, ZeroDivisionError, OverflowError):
        return None


def approximate(normalized: str) -> Value | None:
    """The answer's value in floats (see the module's docstring), not a collection's; else None."""
    if not normalized or len(normalized) > MAX_LENGTH:
        return None
    try:
        items = _Reader(_tokens(normalized), near=True).listing(())
        return items[0] if len(items) == 1 and not isinstance(items[0], Collection) else None
    except (Refused, RecursionError, ZeroDivisionError, OverflowError, ValueError):
        return None


def far_apart(a: Value, b: Value) -> bool:
    return any(abs(x - y) > TOLERANCE * max(1.0, abs(x), abs(y)) for x, y in zip(a, b, strict=True))


def same_value(a, b) -> bool:
    if a is HUGE or b is HUGE:
        return False
    if isinstance(a, Collection) or isinstance(b, Collection):
        return isinstance(a, Collection) and isinstance(b, Collection) and a.key() == b.key()
    return a == b
