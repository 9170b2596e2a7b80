"""The reward graders against Miles's rm_hub on the parity corpus (reward_parity_cases.py): every
case scores what Miles scores, or is a known difference that docs/miles-differences.md lists by
the case's id with its reason (the case then asserts our score, and that it really differs)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from services.rewards.graders import grade, warm_up
from tests.unit.reward_parity_cases import CASES, RAISES, Case

DOC = Path(__file__).resolve().parents[2] / "docs" / "miles-differences.md"
SECTION = "## The reward graders against Miles's rm_hub"
SHARED = ("math", "deepscaler", "dapo", "gpqa", "f1")
"""The graded rm types that Miles's hub has too (reasoning_gym is ours only)."""


def known_differences() -> dict[str, tuple[str, list[str]]]:
    """{difference: (reason, case ids)} from the doc's section: bullets `- **name**: reason
    Cases: id, id.`"""
    text = DOC.read_text()
    assert SECTION in text, f"docs/miles-differences.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    out = {}
    for bullet in re.split(r"\n(?=- \*\*)", section):
        m = re.match(r"- \*\*([a-z0-9-]+)\*\*:?(.*)", " ".join(bullet.split()))
        if m:
            reason, _, cases = m.group(2).partition("Cases:")
            out[m.group(1)] = (reason.strip(), re.findall(r"[a-z0-9]+(?:[-_][a-z0-9]+)+", cases))
    return out


def our_score(case: Case):
    boxed, base = case.rm_type.startswith("boxed_"), case.rm_type.removeprefix("boxed_")
    try:
        got = grade(base, boxed, case.response, case.label, dict(case.metadata))
    except Exception:  # noqa: BLE001 - the sample fails, as a raising grader makes it
        return RAISES
    if base == "dapo":
        assert got["acc"] == (1.0 if got["score"] > 0 else 0.0) and got["score"] in (1.0, -1.0), got
        return got["score"]
    return got


def same(a, b) -> bool:
    if RAISES in (a, b):
        return a == b
    return a == pytest.approx(b, abs=1e-9)


@pytest.fixture(scope="module", autouse=True)
def _warm():
    warm_up()


def _id(case: Case) -> str:
    return case.cid if case.diff is None else f"{case.cid}[known:{case.diff}]"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_scores_as_miles_or_as_a_listed_difference(case):
    got = our_score(case)
    if case.diff is None:
        assert same(got, case.ref), f"{case.cid}: ours {got!r}, Miles {case.ref!r}"
        return
    reason, _ = known_differences()[case.diff]
    assert not same(case.expected, case.ref), f"{case.cid} is listed as a difference but scores as Miles"
    assert same(got, case.expected), f"{case.cid}: ours {got!r}, expected {case.expected!r} ({case.diff}: {reason})"


def test_the_corpus_covers_every_shared_type_and_hostile_inputs():
    assert len(CASES) >= 300
    for rm_type in SHARED:
        assert sum(c.rm_type == rm_type for c in CASES) >= 40, rm_type
    assert sum(c.hostile for c in CASES) >= 50
    assert len({c.cid for c in CASES}) == len(CASES), "case ids are unique"
    for kind in ("deep", "huge", "unicode", "empty"):
        assert any(kind in c.cid for c in CASES if c.hostile), kind


def test_every_known_difference_is_in_the_doc_with_its_cases():
    documented = known_differences()
    listed = {c.cid: c.diff for c in CASES if c.diff is not None}
    for cid, diff in listed.items():
        assert diff in documented, f"{diff} (case {cid}) is not in docs/miles-differences.md"
        reason, ids = documented[diff]
        assert reason, f"{diff} has no reason in the doc"
        assert cid in ids, f"docs/miles-differences.md does not name case {cid} under {diff}"
    for diff, (_, ids) in documented.items():
        for cid in ids:
            assert listed.get(cid) == diff, f"the doc names {cid} under {diff}, the corpus does not"


def test_no_case_comes_near_the_timeout():
    """math-verify's own timeout is 5 s, the hub's --reward-timeout-s 30 s: every case, a
    megabyte or deep nesting included, is answered well before (the bench measures milliseconds,
    bench/rewards.py)."""
    slowest = 0.0
    for case in CASES:
        start = time.perf_counter()
        our_score(case)
        slowest = max(slowest, time.perf_counter() - start)
    assert slowest < 2.5, f"the slowest case took {slowest:.2f} s"
