"""The parity corpus of the reward graders (tests/unit/test_reward_parity.py): each case is a
response and a label with the score Miles's rm_hub gives it (`ref`), worked out from its rules:

- `math`: the last `\\boxed{...}` (written exactly so, no space), compared with the label by
  verl's `grade_answer`: the MATH normaliser's string equality, else a normalised string (lower
  case, units, `$`, `%` dropped) equal, else sympy on elements, where an integer label needs a
  literal integer, two fractions a/b must be written alike, and an expression of more than two
  letters is never evaluated. A falsy label scores 0.
- `deepscaler`: the same comparison on the text after the last `</think>` (or between the first
  two `###Response`; neither: 0); a label None is an error.
- `dapo`: the last `Answer: ...` line of the last 300 characters, Minerva-normalised, equal to
  the label read as an integer (`int(float(...))`); score +1 or -1.
- `gpqa`: a letter A-J (or of `valid_letters`, or one per choice) read by three patterns, then
  the last standalone capital; else the answer text found in the response.
- `f1`: SQuAD's token F1; a label that is not a string is an error.
- `boxed_<type>`: the last box's content graded by `<type>` as if it were the whole response.

`ours` is set where the hub scores otherwise on purpose: docs/miles-differences.md lists each
such case by its id with the reason (`diff`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RAISES = "raises"
"""A score that is an exception (the sample fails)."""
SAME = object()


@dataclass(frozen=True)
class Case:
    cid: str
    rm_type: str
    response: str
    label: Any
    ref: Any
    """Miles's score: a number, dapo's score (+1/-1), or RAISES."""
    metadata: dict = field(default_factory=dict)
    ours: Any = SAME
    """Our score where it differs from `ref` on purpose."""
    diff: str | None = None
    """The known difference (docs/miles-differences.md) that explains `ours`."""
    hostile: bool = False

    @property
    def expected(self) -> Any:
        return self.ref if self.ours is SAME else self.ours


CASES: list[Case] = []


def add(cid, rm_type, response, label, ref, metadata=None, *, ours=SAME, diff=None, hostile=False):
    assert (ours is SAME) == (diff is None), cid
    CASES.append(Case(cid, rm_type, response, label, ref, metadata or {}, ours, diff, hostile))


def box(answer: str) -> str:
    return f"Some reasoning first. So the final answer is $\\boxed{{{answer}}}$."


# ---- math: equal forms ------------------------------------------------------------------------

for cid, answer, label in [
    ("frac-vs-slash", r"\frac{1}{2}", "1/2"), ("decimal-vs-frac", "0.5", r"\frac{1}{2}"),
    ("dfrac", r"\dfrac{3}{4}", r"\frac{3}{4}"),
    ("tfrac", r"\tfrac{1}{3}", "1/3"),
    ("frac-short", r"\frac34", r"\frac{3}{4}"),
    ("int-vs-float", "10.0", "10"), ("thousands", "1,000", "1000"), ("thousands-big", "1,234,567", "1234567"),
    ("escaped-dollar", r"\$20", "20"), ("escaped-dollar-label", "20", r"\$20"), ("dollar-math", "$5$", "5"),
    ("percent", r"50\%", "50"), ("degrees", r"30^\circ", "30"), ("degrees-braced", r"45^{\circ}", "45"),
    ("text-unit", r"5\text{ cm}", "5"), ("unit-word", "12 meters", "12"), ("word-case", "east", "East"),
    ("text-word", r"\text{East}", "east"), ("text-yes", r"\text{Yes}", "yes"), ("short-lhs", "x = 5", "5"),
    ("short-lhs-label", "5", "x=5"), ("leading-dot", ".5", "0.5"), ("left-right", r"\left(1, 2\right)", "(1,2)"),
    ("tuple-spaces", "(3, -1)", "(3,-1)"),
    ("poly-reordered", "x^2+3", "3+x^2"),
    ("poly-expanded", "(x+1)^2", "x^2+2x+1"),
    ("sqrt-short", r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}"),
    ("sqrt-rationalised", r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"),
    ("pi-same", r"2\pi", r"2\pi"), ("mixed-latex", r"2\frac{1}{2}", r"\frac{5}{2}"), ("mixed-plain", "7 3/4", "31/4"),
    ("or-list", "1 or 2", "1, 2"), ("set-same", r"\{1,2\}", r"\{1,2\}"), ("interval-same", "[1,2)", "[1,2)"),
    ("equation-lhs", "y = 2x + 1", "2x+1"),
    ("quarter", "0.25", r"\frac{1}{4}"),
    ("negative", "-3", "-3"),
    ("padded", " 12 ", "12"),
    ("two-letters", "2ab", "2ba"),
    ("neg-frac", r"-\frac{1}{2}", "-1/2"),
    ("text-number", r"\text{5}", "5"),
    ("sentence", r"\text{no solution}", "No solution"),
    ("var-case", "X+1", "x+1"), ("infinity", r"\infty", r"\infty"), ("scientific", "1e3", "1000"),
    ("sqrt-sum", r"\sqrt{2}+\sqrt{8}", r"3\sqrt{2}"), ("angle-text", r"90\text{ degrees}", "90"),
    ("frac-of-var", r"\frac{x}{2}", "x/2"), ("cdot", r"2\cdot 3x", "6x"), ("fullwidth-digit", "５", "5"),
]:  # fmt: skip
    add(f"math-{cid}", "math", box(answer), label, 1.0)
add("math-label-boxed", "math", box("4"), r"\boxed{4}", 1.0)
add("math-label-zero-text", "math", box("0"), "0", 1.0)

# ---- math: wrong answers and extraction --------------------------------------------------------

for cid, answer, label in [
    ("wrong-int", "3", "4"),
    ("wrong-frac", r"\frac{1}{3}", r"\frac{1}{2}"),
    ("approx-third", "0.333333", r"\frac{1}{3}"),
    ("approx-sqrt", "1.4142", r"\sqrt{2}"),
    ("approx-pi", "3.14", r"\pi"),
    ("anagram", "tea", "eat"),
    ("anagram-god", "dog", "god"),
    ("tuple-order", "(1,2)", "(2,1)"), ("interval-kind", "(1,2)", "[1,2]"), ("percent-vs-half", r"50\%", "0.5"),
    ("sign", "-5", "5"), ("other-variable", "x+1", "y+1"), ("third-vs-decimal", "0.3", r"\frac{1}{3}"),
    ("equation-wrong", "x=4", "5"), ("sqrt-wrong", r"\sqrt{3}", r"\sqrt{2}"), ("inequality", "x>2", r"(2,\infty)"),
    ("word-vs-number", r"\text{none}", "0"), ("yes-no", r"\text{yes}", "no"), ("poly-wrong", "x^2+3", "x^2+4"),
    ("list-length", "1, 2, 3", "1, 2"),
]:  # fmt: skip
    add(f"math-{cid}", "math", box(answer), label, 0.0)
for cid, response, label in [
    ("no-box", "The answer is 5", "5"), ("empty-box", r"\boxed{}", "5"), ("unclosed-box", r"\boxed{5", "5"),
    ("fbox", r"\fbox{5}", "5"),
    ("last-box-wins", r"\boxed{3} wait, no: \boxed{4}", "3"),
    ("label-empty", r"\boxed{5}", ""),
    ("label-none", r"\boxed{5}", None), ("boxed-no-brace", r"\boxed 5", "5"),
]:  # fmt: skip
    add(f"math-{cid}", "math", response, label, 0.0)
add("math-last-box-right", "math", r"\boxed{3} wait, no: \boxed{4}", "4", 1.0)

# ---- math: where we differ on purpose ------------------------------------------------------

for cid, answer, label, diff in [
    ("one-over-one", "1/1", "1", "integer-forms"), ("sum-for-int", "2+2", "4", "integer-forms"),
    ("times-ten", r"3\times10^8", "300000000", "integer-forms"), ("power-for-int", "2^{10}", "1024", "integer-forms"),
    ("million", "5 million", "5000000", "integer-forms"),
    ("factorial", "3!", "6", "integer-forms"),
    ("root-of-square", r"\sqrt{4}", "2", "integer-forms"), ("unicode-minus", "−3", "-3", "unicode-minus"),
    ("set-reordered", r"\{2,1\}", r"\{1,2\}", "unordered-sets"), ("list-reordered", "2, 1", "1, 2", "unordered-sets"),
    ("unreduced", "2/4", "1/2", "unreduced-fractions"),
    ("unreduced-latex", r"\frac{2}{4}", r"\frac{1}{2}", "unreduced-fractions"),
    ("pi-r-squared", r"\pi r^2", r"r^2\pi", "three-letters"), ("three-variables", "2xy+z", "z+2yx", "three-letters"),
]:  # fmt: skip
    add(f"math-{cid}", "math", box(answer), label, 0.0, ours=1.0, diff=diff)
add("math-nested-frac", "math", box(r"\frac{1}{1+\frac{1}{2}}"), r"\frac{2}{3}", 0.0, ours=1.0, diff="nested-fractions")
add("math-label-zero-int", "math", box("0"), 0, 0.0, ours=1.0, diff="falsy-label")
add("math-box-space", "math", r"so \boxed {5}", "5", 0.0, ours=1.0, diff="box-space")
add("math-units-differ", "math", box("3 days"), "3 weeks", 1.0, ours=0.0, diff="different-units")

# ---- math: hostile ----------------------------------------------------------------------------


def nest(depth: int, inner: str, left: str = "{", right: str = "}") -> str:
    return left * depth + inner + right * depth


def continued(depth: int) -> str:
    text = "1"
    for _ in range(depth):
        text = f"\\frac{{1}}{{1+{text}}}"
    return text


def fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


for cid, response, label, ref in [
    ("deep-braces-40", box(nest(40, "1")), "1", 1.0), ("deep-braces-80-wrong", box(nest(80, "1")), "2", 0.0),
    ("deep-braces-60-expr", box(nest(60, "x+1")), "x+1", 1.0),
    ("deep-parens-20", box(nest(20, "x+1", "(", ")")), "x+1", 1.0),
    ("deep-parens-60", box(nest(60, "x+1", "(", ")")), "1+x", 1.0),
    ("deep-parens-80-wrong", box(nest(80, "x+1", "(", ")")), "x+2", 0.0),
    ("continued-fraction-30-wrong", box(continued(30)), f"{fib(32)}/{fib(33)}", 0.0),
    ("deep-sqrt-25", box(nest(25, "2", "\\sqrt{", "}")), "2", 0.0),
    ("deep-sqrt-25-same", box(nest(25, "2", "\\sqrt{", "}")), nest(25, "2", "\\sqrt{", "}"), 1.0),
    ("deep-left-right-30", box(nest(30, "x", "\\left(", "\\right)")), "x", 1.0),
    ("deep-unclosed-50", "\\boxed{" + "{" * 50 + "1", "1", 0.0),
    ("deep-frac-braces-20", box(nest(20, "\\frac{1}{2}")), "0.5", 1.0),
    ("huge-int-same", box("9" * 5000), "9" * 5000, 1.0), ("huge-int-differs", box("9" * 5000), "9" * 4999 + "8", 0.0),
    ("huge-response", "x" * 100_000 + box("7"), "7", 1.0),
    ("long-decimal", box("0." + "3" * 3000), "1/3", 0.0), ("many-boxes", "\\boxed{1} " * 10_000, "1", 1.0),
    ("whitespace-flood", box(" " * 50_000 + "5" + " " * 50_000), "5", 1.0),
    ("unbalanced-closers", "\\boxed{1}}}}}}}", "1", 1.0),
    ("power-tower", box("9^{9^{9^{9}}}"), "1", 0.0), ("factorial-bomb", box("100000!"), "1", 0.0),
    ("big-power", box("2^{100000}"), "2", 0.0),
    ("unicode-same", box("答案"), "答案", 1.0),
    ("unicode-vs-number", box("答案"), "5", 0.0),
    ("emoji", box("🙂"), "1", 0.0), ("empty-response", "", "1", 0.0), ("only-backslashes", box("\\\\\\\\"), "1", 0.0),
    ("newline-in-box", box("5\n"), "5", 1.0), ("control-chars", box("\x00\x01"), "1", 0.0),
]:  # fmt: skip
    add(f"math-{cid}", "math", response, label, ref, hostile=True)
add("math-deep-parens-int", "math", box(nest(40, "1", "(", ")")), "1", 0.0, ours=1.0, diff="integer-forms",
    hostile=True)
add("math-continued-fraction-30", "math", box(continued(30)), f"{fib(31)}/{fib(32)}", 0.0, ours=1.0,
    diff="nested-fractions", hostile=True)
add("math-huge-sum", "math", box("a+" * 5000 + "a"), "5001a", 0.0, ours=1.0, diff="huge-expressions", hostile=True)

# ---- deepscaler -----------------------------------------------------------------------------


def think(answer: str) -> str:
    return f"<think>Let me try \\boxed{{0}} first.</think> The answer is \\boxed{{{answer}}}."


for cid, answer, label in [
    ("half", r"\frac{1}{2}", "0.5"), ("escaped-dollar", r"\$20", "20"), ("word-case", "North", "north"),
    ("percent", r"25\%", "25"),
    ("degrees", r"60^\circ", "60"),
    ("text-unit", r"7\text{ cm}", "7"),
    ("thousands", "10,000", "10000"),
    ("dfrac", r"\dfrac{2}{3}", "2/3"), ("sqrt", r"2\sqrt{2}", r"\sqrt{8}"), ("tuple", r"\left(2, 3\right)", "(2,3)"),
    ("interval", r"(-\infty, 3]", r"(-\infty,3]"), ("lhs", "k = 7", "7"), ("mixed", r"3\frac{1}{4}", r"\frac{13}{4}"),
    ("poly", "(x-1)(x+1)", "x^2-1"), ("float-int", "8.0", "8"), ("text-word", r"\text{Tuesday}", "tuesday"),
]:  # fmt: skip
    add(f"deepscaler-{cid}", "deepscaler", think(answer), label, 1.0)
for cid, answer, label in [
    ("wrong", "4", "5"),
    ("approx", "0.67", r"\frac{2}{3}"),
    ("anagram", "stop", "pots"),
    ("tuple-order", "(3,2)", "(2,3)"),
    ("sign", r"-\frac{1}{2}", r"\frac{1}{2}"),
    ("percent-vs-fraction", r"25\%", "0.25"),
    ("poly-wrong", "x^2+1", "x^2-1"),
]:  # fmt: skip
    add(f"deepscaler-{cid}", "deepscaler", think(answer), label, 0.0)
for cid, response, label, ref in [
    ("box-in-thinking-only", r"<think>\boxed{5}</think> done", "5", 0.0), ("no-marker", r"\boxed{5}", "5", 0.0),
    ("response-marker", r"###Response \boxed{2}", "2", 1.0),
    ("two-response-markers", r"###Response \boxed{2} ###Response \boxed{3}", "2", 1.0),
    ("two-response-markers-second", r"###Response \boxed{2} ###Response \boxed{3}", "3", 0.0),
    ("think-beats-response", r"###Response \boxed{1} <think>x</think> \boxed{4}", "4", 1.0),
    ("last-think", r"a</think>\boxed{6}</think>\boxed{7}", "7", 1.0),
    ("nothing-after-think", r"</think>\boxed{7}</think>", "7", 0.0),
    ("label-boxed", r"</think>\boxed{7}", r"\boxed{7}", 1.0), ("label-empty", r"</think>\boxed{7}", "", 0.0),
    ("label-int", r"</think>\boxed{7}", 7, 1.0), ("label-float", r"</think>\boxed{\frac12}", 0.5, 1.0),
    ("label-zero-int", r"</think>\boxed{0}", 0, 1.0), ("no-box-after-think", "</think> 2", "2", 0.0),
]:  # fmt: skip
    add(f"deepscaler-{cid}", "deepscaler", response, label, ref)
add("deepscaler-label-none", "deepscaler", r"</think>\boxed{7}", None, RAISES, ours=0.0, diff="label-not-text")
for cid, answer, label, diff in [
    ("one-over-one", "3/3", "1", "integer-forms"), ("unreduced", "3/6", "1/2", "unreduced-fractions"),
    ("set-reordered", r"\{3,1,2\}", r"\{1,2,3\}", "unordered-sets"), ("unicode-minus", "−7", "-7", "unicode-minus"),
]:  # fmt: skip
    add(f"deepscaler-{cid}", "deepscaler", think(answer), label, 0.0, ours=1.0, diff=diff)
add("deepscaler-box-space", "deepscaler", r"</think> \boxed {9}", "9", 0.0, ours=1.0, diff="box-space")
for cid, response, label, ref in [
    ("huge-thinking", "<think>" + "hmm " * 50_000 + "</think>" + think("3"), "3", 1.0),
    ("many-think-markers", "</think>" * 20_000 + r"\boxed{3}", "3", 1.0),
    ("deep-braces-50", "</think>" + box(nest(50, "3")), "3", 1.0),
    ("deep-braces-70-wrong", "</think>" + box(nest(70, "3")), "4", 0.0),
    ("deep-parens-40", "</think>" + box(nest(40, "y-2", "(", ")")), "y-2", 1.0),
    ("unclosed-think", "<think>" + "x" * 100_000 + r"\boxed{3}", "3", 0.0),
    ("unicode", "</think>" + box("ε"), "ε", 1.0), ("empty", "", "3", 0.0),
    ("huge-box", "</think>" + box("1" * 20_000), "1", 0.0),
]:  # fmt: skip
    add(f"deepscaler-{cid}", "deepscaler", response, label, ref, hostile=True)

# ---- dapo -----------------------------------------------------------------------------------

for cid, response, label, ref in [
    ("plain", "reasoning...\nAnswer: 42", "42", 1), ("endoftext", "Answer: 42<|endoftext|>", "42", 1),
    ("endoftext-twice", "Answer: 42<|endoftext|><|endoftext|>", "42", 1),
    ("endoftext-space", "Answer: 42 <|endoftext|>", "42", 1),
    ("im-end", "Answer: 42<|im_end|>", "42", 1),
    ("dollars", "Answer: $42$", "42", 1),
    ("boxed", r"Answer: \boxed{42}", "42", 1),
    ("thousands", "Answer: 1,000", "1000", 1), ("dollar-words", "Answer: $1,000$ dollars", "1000", 1),
    ("float", "Answer: 42.0", "42", -1), ("wrong", "Answer: 41", "42", -1), ("no-line", "42", "42", -1),
    ("late", "Answer: 42" + "x" * 400, "42", -1), ("last-line-wins", "Answer: 41\nAnswer: 42", "42", 1),
    ("last-line-wrong", "Answer: 42\nAnswer: 41", "42", -1), ("lower-case", "answer: 42", "42", 1),
    ("upper-case-space", "ANSWER : 42", "42", 1),
    ("equation", "Answer: x = 42", "42", 1),
    ("unit", "Answer: 42 degrees", "42", 1),
    ("text", r"Answer: \text{42}", "42", 1),
    ("trailing-dot", "Answer: 42.", "42", -1),
    ("dot-in-math", "Answer: $42.$", "42", 1),
    ("label-boxed", "Answer: 42", r"\boxed{42}", 1),
    ("label-int", "Answer: 42", 42, 1),
    ("negative", "Answer: -3", "-3", 1),
    ("label-float-int", "Answer: 42", "42.0", 1),
    ("spaces-inside", "Answer: 4 2", "42", 1),
    ("leading-zero", "Answer: 042", "42", -1),
    ("plus-sign", "Answer: +42", "42", -1),
    ("text-unit", r"Answer: 42 \text{ cm}", "42", 1),
    ("students", "Answer: 42 students", "42", 1),
    ("article", "Answer: a 42", "42", 1), ("fraction", "Answer: 3/4", "3", -1), ("power", "Answer: 2^{10}", "1024", -1),
    ("next-line", "Answer:\n42", "42", 1),
    ("trailing-newline", "Answer: 42\n", "42", 1),
    ("final-answer", "Final Answer: 42", "42", 1),
    ("no-colon", "The answer is 42", "42", -1), ("two-numbers", "Answer: 42 or 43", "42", -1),
    ("latex-fraction", r"Answer: $\frac{84}{2}$", "42", -1), ("braced-comma", "Answer: 1{,}000", "1000", 1),
    ("thin-space", r"Answer: 1\,000", "1000", -1),
    ("escaped-dollar", r"Answer: \$42", "42", 1),
    ("label-text", "Answer: x", "x", RAISES),
]:  # fmt: skip
    add(f"dapo-{cid}", "dapo", response, label, ref)
add("dapo-fraction-label", "dapo", "Answer: 12", "12.5", 1, ours=RAISES, diff="dapo-integer-label")
for cid, response, label, ref in [
    ("huge-response", "x" * 1_000_000 + "\nAnswer: 42", "42", 1),
    ("many-lines", "Answer: 1\n" * 100_000 + "Answer: 42", "42", 1),
    ("deep-braces", "Answer: " + nest(80, "42"), "42", -1),
    ("deep-boxed", "Answer: " + nest(40, "42", "\\boxed{", "}"), "42", -1),
    ("fullwidth", "Answer: ４２", "42", -1), ("empty", "", "42", -1), ("colon-only", "Answer:", "42", -1),
    ("long-number", "Answer: " + "9" * 250, "42", -1), ("huge-label", "Answer: 4", "4" * 2000, RAISES),
    ("nul", "Answer: 42\x00", "42", -1), ("dollar-flood", "Answer: " + "$" * 280, "42", -1),
]:  # fmt: skip
    add(f"dapo-{cid}", "dapo", response, label, ref, hostile=True)

# ---- gpqa -----------------------------------------------------------------------------------

COLOURS = {"choices": ["red", "green", "blue", "black"]}
NUMBERS = {"choices": ["1", "3", "5", "7"]}

for cid, response, label, metadata, ref in [
    ("answer-is", "The answer is C.", "C", None, 1.0), ("letter-j", "The answer is J", "J", None, 1.0),
    ("letter-h", "The answer is H", "H", None, 1.0),
    ("after-thinking", "<think>maybe A</think> B is correct", "B", None, 1.0),
    ("index-label", "final answer: D", 3, COLOURS, 1.0), ("choice-text-label", "answer: C", "blue", COLOURS, 1.0),
    ("choice-text-wrong", "answer: A", "blue", COLOURS, 0.0), ("text-match", "it is blue", "blue", COLOURS, 1.0),
    ("wrong-letter", "answer: A", "C", None, 0.0), ("pronoun-before", "I think it's B", "B", None, 1.0),
    ("letter-i", "The answer is I.", "I", None, 1.0), ("letter-i-parens", "Answer: (I)", "I", None, 1.0),
    ("option", "Option D", "D", None, 1.0), ("lower-case-choice", "choice: e", "E", None, 1.0),
    ("lower-case-label", "The answer is C", "c", None, 1.0), ("index-zero", "answer: A", 0, None, 1.0),
    ("index-nine", "answer: J", 9, None, 1.0), ("index-out-of-range", "answer: J", 10, None, 0.0),
    ("correct-letter-meta", "answer: D", "whatever", {"correct_letter": "D"}, 1.0),
    ("choices-dict", "answer: B", "green", {"choices": {"A": "red", "B": "green"}}, 1.0),
    ("text-without-letter", "The colour is green", "green", COLOURS, 1.0), ("empty", "", "A", None, 0.0),
    ("think-only", "</think>", "A", None, 0.0), ("correct-option", "The correct option is F", "F", None, 1.0),
    ("is-the-correct", "F is the correct one", "F", None, 1.0), ("bold", "**Answer: G**", "G", None, 1.0),
    ("bold-letter", "Answer: **G**", "G", None, 1.0), ("two-letters", "A or B? The answer is B", "B", None, 1.0),
    ("answer-after-think", "<think>The answer is A</think>The answer is C", "C", None, 1.0),
    ("valid-letters-string", "answer: E", "E", {"valid_letters": "ABCDE"}, 1.0),
    ("lower-case-i", "answer is i", "I", None, 1.0), ("i-choose", "I choose J", "J", None, 1.0),
    ("index-with-dot", "Answer: J.", 9, None, 1.0), ("a", "The answer is A", "A", None, 1.0),
    ("correct-letter-lower", "answer: c", "x", {"correct_letter": "c"}, 1.0),
    ("beyond-choices", "answer: E", "B", COLOURS, 0.0),
    ("valid-letters-list", "answer: B", "B", {"valid_letters": ["A", "B"]}, 1.0),
    ("last-standalone", "Between A and D, D", "D", None, 1.0), ("no-letter", "none of these", "A", COLOURS, 0.0),
    ("text-wrong", "it is green", "blue", COLOURS, 0.0),
]:  # fmt: skip
    add(f"gpqa-{cid}", "gpqa", response, label, ref, metadata)
for cid, response, label, metadata, diff in [
    ("pronoun-after", "B, I guess", "B", None, "gpqa-pronoun"),
    ("pronoun-in-answer", "The answer: I think it is B", "B", None, "gpqa-pronoun"),
    ("pronoun-contraction", "answer: I'm not sure, maybe C", "C", None, "gpqa-pronoun"),
    ("article", "The answer is a bit unclear, but B is correct", "B", None, "gpqa-pronoun"),
    ("next-word", "The answer is clearly B", "B", None, "gpqa-next-word"),
    ("parenthesised", "The answer is (B)", "B", None, "gpqa-next-word"),
    ("answer-is-colon", "The answer is: A", "A", None, "gpqa-next-word"),
]:  # fmt: skip
    add(f"gpqa-{cid}", "gpqa", response, label, 0.0, metadata, ours=1.0, diff=diff)
for cid, response, label, metadata, diff in [
    ("letter-as-text", "answer: E", "A", COLOURS, "gpqa-substring"),
    ("invalid-letter-as-text", "answer: C", "C", {"valid_letters": ["A", "B"]}, "gpqa-substring"),
    ("substring-number", "I count 13 electrons", "3", NUMBERS, "gpqa-substring"),
]:  # fmt: skip
    add(f"gpqa-{cid}", "gpqa", response, label, 1.0, metadata, ours=0.0, diff=diff)
for cid, response, label, metadata, ref in [
    ("huge", "blah " * 200_000 + "Answer: C", "C", None, 1.0),
    ("many-letters", "A " * 100_000 + "so B", "B", None, 1.0),
    ("deep-braces", nest(80, "C"), "C", None, 1.0),
    ("unicode", "答案是 C", "C", None, 1.0),
    ("nul", "\x00C\x00", "C", None, 1.0),
    ("unclosed-think", "<think>" + "x" * 100_000, "A", None, 0.0), ("emoji", "🅱️ is my pick", "B", None, 0.0),
("huge-choice-text", "it is " + "z" * 50_000, "z" * 50_000, {}, 1.0),
    ("whitespace-flood", "answer" + " " * 100_000 + "is D", "D", None, 1.0),
]:  # fmt: skip
    add(f"gpqa-{cid}", "gpqa", response, label, ref, metadata, hostile=True)
add("gpqa-answer-flood", "gpqa", "answer " * 50_000, "A", 1.0, ours=0.0, diff="gpqa-next-word", hostile=True)

# ---- f1 -------------------------------------------------------------------------------------

for cid, response, label, ref in [
    ("exact", "Paris", "Paris", 1.0), ("case-punctuation", "The Eiffel Tower!", "eiffel tower", 1.0),
    ("partial", "eiffel tower in paris", "the eiffel tower", 2 / 3),
    ("yes-no", "no", "yes", 0.0),
    ("yes-yes", "Yes.", "yes", 1.0),
    ("yes-more", "yes indeed", "yes", 0.0),
    ("noanswer", "noanswer", "no answer", 0.0),
    ("empty-response", "", "tower", 0.0),
    ("empty-label", "tower", "", 0.0),
    ("articles-only", "the a an", "the", 0.0),
    ("repeated", "paris paris", "paris", 2 / 3),
    ("unicode-word", "Café au lait", "café", 0.5), ("hyphen", "state-of-the-art", "state of the art", 0.0),
    ("apostrophe", "don't", "dont", 1.0),
    ("digits", "1,000", "1000", 1.0),
    ("order", "tower eiffel", "eiffel tower", 1.0),
    ("long", "the answer is paris france", "paris", 0.4), ("article-word", "An apple", "apple", 1.0),
    ("article-glued", "anapple", "an apple", 0.0),
    ("upper", "THE END", "end", 1.0),
    ("cjk-punctuation", "Paris。", "Paris", 0.0),
    ("underscore", "new_york", "new york", 0.0), ("newline", "new\nyork", "new york", 1.0), ("no-no", "No!", "no", 1.0),
    ("article-a", "a", "a", 0.0),
    ("half-overlap", "red green", "green blue", 0.5),
    ("three-of-four", "a b c d", "b c d e", 6 / 7),
    ("precision-recall", "one two three", "one two three four five six", 2 / 3), ("tabs", "big\tcat", "big cat", 1.0),
    ("no-overlap", "dog", "cat", 0.0),
    ("numbers-words", "3 apples", "three apples", 0.5),
    ("quote", '"Paris"', "Paris", 1.0),
    ("the-inside", "theater", "the ater", 0.0), ("accents-differ", "cafe", "café", 0.0),
]:  # fmt: skip
    add(f"f1-{cid}", "f1", response, label, ref)
add("f1-label-none", "f1", "Paris", None, RAISES, ours=0.0, diff="label-not-text")
add("f1-label-int", "f1", "42", 42, RAISES, ours=1.0, diff="label-not-text")
for cid, response, label, ref in [
    ("huge-response", "word " * 100_000 + "paris", "paris", 2 / 100_002),
    ("huge-label", "paris", "word " * 100_000 + "paris", 2 / 100_002),
    ("distinct-tokens", " ".join(f"t{i}" for i in range(50_000)), "t7 t8", 4 / 50_002),
    ("punctuation-flood", "!" * 100_000, "paris", 0.0),
    ("combining", "e\u0301te", "ete", 0.0),
    ("zero-width", "par\u200bis", "paris", 0.0),
    ("emoji", "🙂 paris", "paris", 2 / 3),
    ("control", "paris\x00", "paris", 0.0),
    ("deep-braces", nest(80, "paris"), "paris", 1.0),
    ("nul-label", "x", "\x00", 0.0),
]:  # fmt: skip
    add(f"f1-{cid}", "f1", response, label, ref, hostile=True)

# ---- the boxed_ prefix ------------------------------------------------------------------------

for cid, rm_type, response, label, ref in [
    ("f1", "boxed_f1", r"I think \boxed{Paris}", "Paris", 1.0), ("f1-no-box", "boxed_f1", "Paris", "Paris", 0.0),
    ("f1-text", "boxed_f1", r"\boxed{\text{Paris}}", "Paris", 0.0), ("gpqa", "boxed_gpqa", r"so \boxed{C}", "C", 1.0),
    ("gpqa-sentence", "boxed_gpqa", r"\boxed{The answer is J}", "J", 1.0),
    ("gpqa-wrong", "boxed_gpqa", r"\boxed{A}", "C", 0.0),
    ("gpqa-no-box", "boxed_gpqa", "The answer is C", "C", 0.0), ("math-wrong", "boxed_math", r"\boxed{3}", "4", 0.0),
    ("math-no-box", "boxed_math", "4", "4", 0.0),
    ("deepscaler-wrong", "boxed_deepscaler", r"</think>\boxed{3}", "4", 0.0),
    ("dapo-wrong", "boxed_dapo", r"\boxed{41}", "42", -1),
]:  # fmt: skip
    add(f"boxed-{cid}", rm_type, response, label, ref)
for cid, rm_type, response, label, ref, ours in [
    ("math", "boxed_math", r"so \boxed{\frac{1}{2}}", "0.5", 0.0, 1.0),
    ("deepscaler", "boxed_deepscaler", r"</think>\boxed{7}", "7", 0.0, 1.0),
    ("dapo", "boxed_dapo", r"\boxed{42}", "42", -1, 1),
    ("dapo-answer-line", "boxed_dapo", r"\boxed{Answer: 42}", "42", 1, -1),
]:  # fmt: skip
    add(f"boxed-{cid}", rm_type, response, label, ref, ours=ours, diff="boxed-prefix")
add("boxed-f1-space", "boxed_f1", r"\boxed {Paris}", "Paris", 0.0, ours=1.0, diff="box-space")
