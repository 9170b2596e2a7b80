"""An eval result is taken only for an eval point the trainer requested, for the weight version
it named, and once (services.common.validate.EvalPoints, used by the trainer and the launcher):
a forged result for a point far ahead of the run, for other weights, or a second answer to a
point, is refused with its reason."""

from __future__ import annotations

from services.common.validate import EvalPoints


def test_only_a_requested_point_at_its_version_is_taken_and_only_once():
    p = EvalPoints()
    p.request(0, 0)
    p.request(50, 50)
    assert "no eval point was requested" in p.problem(1500, 1500)  # printed as real before
    assert "requested for weights v50, not v7" in p.problem(50, 7)
    assert p.problem(50, 50) is None
    assert "answered already" in p.problem(50, 50)
    assert p.problem(0, 0) is None
    p.request(100, 100)
    p.request(100, 101)  # a restarted trainer passing the point again, on newer weights
    assert p.problem(100, 100) is None and "answered already" in p.problem(100, 101)


def test_after_a_restart_the_points_before_it_are_taken_once_whatever_their_version():
    p = EvalPoints()
    p.resumed_at(100)  # requested before the restart: their versions are not known here
    assert p.problem(50, 50) is None and "answered already" in p.problem(50, 50)
    assert p.problem(100, 99) is None
    assert "no eval point was requested" in p.problem(150, 150)  # after it: only what was requested
    p.request(150, 150)
    assert p.problem(150, 150) is None


def test_a_skip_the_trainer_decided_is_taken_once_for_a_point_of_the_schedule():
    """The trainer skips a busy point or a failed export itself (no request reaches the eval
    service): the launcher takes that skip once, only for an eval point of the run's schedule."""
    p = EvalPoints()
    assert p.skip_problem(3, on_schedule=True) is None
    assert "answered already" in p.skip_problem(3, on_schedule=True)
    assert "no eval point was requested" in p.skip_problem(4, on_schedule=False)
