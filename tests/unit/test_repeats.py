"""A repeated condition is logged once, then again only when it changes, with the count of the
one before; a flood of refusals that differ only in their token is one line."""

from __future__ import annotations

import logging

from services.common.repeats import Repeats

log = logging.getLogger("tests.repeats")


def test_a_condition_is_said_once_then_again_only_when_it_changes(caplog):
    r = Repeats(log)
    with caplog.at_level(logging.INFO, logger="tests.repeats"):
        said = [r.say("catch-up", "catching up to v4: the snapshot is gone") for _ in range(50)]
        assert said == [True] + [False] * 49
        assert r.say("catch-up", "catching up to v5: the snapshot is gone")  # changed: said, with the count
        r.clear("catch-up")
        assert r.say("catch-up", "catching up to v5: the snapshot is gone")  # after it ended: said again
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines == [
        "catching up to v4: the snapshot is gone",
        "catching up to v5: the snapshot is gone (the previous condition held 50 times)",
        "catching up to v5: the snapshot is gone",
    ]


def test_a_kind_keeps_moving_figures_and_tokens_from_making_every_line_new(caplog):
    r = Repeats(log)
    with caplog.at_level(logging.WARNING, logger="tests.repeats"):
        for i in range(1, 200):
            token = f"eval-{i}"
            reason = f"a pause of submission names {token!r}, not an eval point of this run (eval-<step>)"
            r.say("pause refused", f"refused: {reason}", kind=reason.replace(token, "<token>").split(":")[0])  # as the producer does
        r.say("pause refused", "refused: the pause eval-50 is refused: pauses over NATS held production 61s",
              kind="the pause <token> is refused")  # fmt: skip
    first, second = (rec.getMessage() for rec in caplog.records)
    assert "'eval-1'" in first and second.endswith("(the previous condition held 199 times)")
