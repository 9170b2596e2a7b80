"""Which weight version generated which tokens: the engine's spans on a Sample (apply_response),
their validation, and the trained-sample records that show them (services/common/sample_records.py)."""

from __future__ import annotations

from asyncrl_proto import Sample, SampleStatus
from services.common import sample_records
from services.common.responses import apply_response
from services.common.validate import Limits, sample_problem
from services.envs.trajectory import Trajectory


def _resp(ids, spans=None, version=None):
    meta = {"output_token_logprobs": [[-0.5, t, None] for t in ids], "finish_reason": {"type": "stop"}}
    if spans is not None:
        meta["weight_versions"] = spans
    if version is not None:
        meta["weight_version"] = str(version)
    return {"text": "".join(map(str, ids)), "meta_info": meta}


def test_spans_follow_the_engine_across_turns_and_environment_tokens():
    traj = Trajectory(Sample(index=0, reward=1.0), [1, 2])
    traj.model_turn(_resp([5, 6, 7], spans=[{"version": 3, "start": 0, "end": 2}, {"version": 4, "start": 2, "end": 3}]))
    traj.env_turn([9, 9], "99")  # a tool's answer: no version, out of the loss
    traj.model_turn(_resp([8], spans=[{"version": 4, "start": 0, "end": 1}]))
    s = traj.finish()
    assert s.version_spans == [[0, 2, 3], [2, 3, 4], [5, 6, 4]] and s.weight_versions == [3, 4]
    assert sample_problem(s, Limits(n=1, vocab_size=16, context_length=64, reward_key=None)) is None
    segs = sample_records.segments(s, lambda ids: "".join(map(str, ids)))
    assert segs == [["56", 3, 1], ["7", 4, 1], ["99", None, 0], ["8", 4, 1]]


def test_an_engine_that_reports_one_version_gives_one_span():
    s = Sample(index=0)
    apply_response(s, [1], _resp([4, 5], version=7))
    apply_response(s, s.tokens[:1], _resp([6], version=7))  # one version across two calls: one span
    assert s.version_spans == [[0, 3, 7]]
    s2 = Sample(index=1)
    apply_response(s2, [1], {"text": "x", "meta_info": {"weight_version": "default"}, "output_ids": [3]})
    assert s2.version_spans == []  # unknown (SGLang's initial "default"): no span


def test_spans_that_do_not_fit_the_response_are_refused():
    limits = Limits(n=1, vocab_size=16, context_length=64, reward_key=None)
    base = dict(index=0, tokens=[1, 2, 3, 4], response_length=3, reward=1.0, status=SampleStatus.COMPLETED,
                weight_versions=[2])  # fmt: skip
    for spans in ([[0, 4, 2]], [[1, 1, 2]], [[0, 2, 3]], [[1, 3, 2], [0, 1, 2]], [[0, 1]]):
        assert "version span" in sample_problem(Sample(**base, version_spans=spans), limits), spans
    assert sample_problem(Sample(**base, version_spans=[[0, 1, 2], [1, 3, 2]]), limits) is None


def test_a_step_record_round_trips_and_retention_keeps_the_newest(tmp_path):
    g = [Sample(index=i, group_index=5, prompt="12=", tokens=[1, 2, 3], response_length=1, reward=float(i),
                weight_versions=[0], version_spans=[[0, 1, 0]], status=SampleStatus.COMPLETED) for i in range(2)]  # fmt: skip
    g[1].remove_sample = True
    adv = {id(g[0]): -1.0, id(g[1]): 1.0}
    for step in range(5):
        rec = sample_records.step_record(step, step, [g], adv, {}, lambda ids: "x")
        sample_records.write(tmp_path, rec, keep=3)
    assert sample_records.steps(tmp_path) == [2, 3, 4]
    got = sample_records.read(tmp_path, 4)
    (group,) = got["groups"]
    assert group["group_index"] == 5 and group["prompt"] == "12="
    assert [s["advantage"] for s in group["samples"]] == [-1.0, 1.0]
    assert [s["fate"] for s in group["samples"]] == ["trained", "removed"]
    sample_records.drop_after(tmp_path, 2)  # a restarted trainer trains 3 and 4 again
    assert sample_records.steps(tmp_path) == [2] and sample_records.read(tmp_path, 4) is None
    sample_records.write(tmp_path, sample_records.step_record(9, 0, [g], adv, {}, str), keep=0)
    assert sample_records.steps(tmp_path) == [2]  # keep 0: no records at all
