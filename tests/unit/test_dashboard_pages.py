"""The dashboard's pages on a small synthetic finished run (services/dashboard/app.py, views.py,
templates/): the charts' containers and their data, the vendored uPlot served with its licence,
tables written as text (never a Python repr), autoescaping, and a finished run's services shown
with their exit codes (exits.json) rather than as "not running"."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys

import pytest

from asyncrl_proto import LedgerEvent, PromptMsg
from services.common import sample_records
from services.common.httpauth import Keys
from services.dashboard.app import Dashboard, build_app
from services.dashboard.data import exit_state
from services.dashboard.views import readable

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STEPS, GROUPS, T0 = 12, 2, 1.8e9


def _ended_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    return p.pid


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"run_id": "pages", "num_rollout": STEPS, "fully_async": True,
                                                      "rollout_batch_size": GROUPS, "eval_prompt_data": ["set"]}))  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "time": T0 + s, "weight_version": s + 1, "rollout/reward/mean": s / STEPS,
                    "perf/step_time_s": 1.0, "perf/rollout_wait_s": 0.1, "perf/train_time_s": 0.8,
                    "rollout/num_samples": 8, "train/entropy": 2.0, "train/pg_clipfrac": 0.1, "train/ppo_kl": 1e-5}) + "\n"
        for s in range(STEPS)))  # fmt: skip
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval/set": 0.5}) + "\n" for s in (0, STEPS)))
    (tmp_path / "trained.jsonl").write_text("".join(json.dumps({"step": s, "groups": [GROUPS * s + g for g in range(GROUPS)]})
                                                    + "\n" for s in range(STEPS)))  # fmt: skip
    d = sample_records.records_dir(tmp_path)
    d.mkdir()
    sample = {"index": 0, "reward": 0.5, "advantage": 0.1, "status": "completed", "fate": "trained",
              "weight_versions": [1, 2], "response_length": 5, "segments": [["<b>12</b>", 1, 1], ["3", None, 0]]}  # fmt: skip
    for s in range(STEPS):
        rec = {"step": s, "version": s, "groups": [{"group_index": GROUPS * s + g, "group_id": f"g{GROUPS * s + g}-a0",
                                                     "staleness": g, "prompt": "<i>123=</i>", "label": "321",
                                                     "samples": [sample] * 2} for g in range(GROUPS)]}  # fmt: skip
        (d / f"{s:08d}.json.gz").write_bytes(gzip.compress(json.dumps(rec).encode()))
    pids = {name: _ended_pid() for name in ("trainer", "buffer", "engine-0", "eval", "launcher")}
    (tmp_path / "pids.json").write_text(json.dumps(pids))
    # the exits on record; the buffer's names another pid (an earlier instance's), the launcher has none
    codes = {"trainer": 0, "engine-0": -15, "eval": 3}
    (tmp_path / "exits.json").write_text(json.dumps({**{n: {"pid": pids[n], "code": c} for n, c in codes.items()},
                                                     "buffer": {"pid": pids["buffer"] + 1, "code": 0}}))  # fmt: skip
    (tmp_path / "services.json").write_text(json.dumps({"buffer": "http://127.0.0.1:1"}))
    (tmp_path / "result.json").write_text("{}")
    return tmp_path


@pytest.fixture
def client(run_dir):
    from fastapi.testclient import TestClient

    dash = Dashboard(run_dir, Keys.of_run(TOKEN))
    seq, events = 0, []
    for s in range(STEPS):
        for g in range(GROUPS):
            gi = GROUPS * s + g
            events.append(LedgerEvent(seq=(seq := seq + 1), kind="released", ts=T0 + s,
                                      prompt=PromptMsg(group_index=gi, prompt="123=", label="321", n_samples=2),
                                      source={"cursor": gi + 1, "next_group_index": gi + 1}))  # fmt: skip
            events.append(LedgerEvent(seq=(seq := seq + 1), kind="put", group_id=f"g{gi}-a0", group_index=gi,
                                      outcome="stored", stream_seq=gi + 1, ts=T0 + s))  # fmt: skip
            events.append(LedgerEvent(seq=(seq := seq + 1), kind="leased", group_id=f"g{gi}-a0", group_index=gi,
                                      step=s, staleness=g, stream_seq=gi + 1, ts=T0 + s))  # fmt: skip
        events.append(LedgerEvent(seq=(seq := seq + 1), kind="lease_complete", step=s, ts=T0 + s))
        events.append(LedgerEvent(seq=(seq := seq + 1), kind="committed", step=s, ts=T0 + s))
    dash.data.main.auditor.feed(events)
    for ev in events:
        dash.data.main.index(ev)
    dash.data.live = [{"version": v, "at": T0 + v, "pause_s": 0.2, "switched": [
        {"engine": "engine-0", "paused_at": T0 + v, "resumed_at": T0 + v + 0.2}]} for v in range(1, STEPS)]  # fmt: skip
    with TestClient(build_app(dash)) as c:
        yield c


def _text(page: str) -> str:
    """The page without its chart data (JSON) and style: what a reader reads."""
    page = re.sub(r'<script type="application/json" id="chart-data">.*?</script>', "", page, flags=re.S)
    return re.sub(r"<style>.*?</style>", "", page, flags=re.S)


def test_the_overview_holds_every_chart_and_its_data(client):
    page = client.get("/", headers=AUTH).text
    data = json.loads(re.search(r'<script type="application/json" id="chart-data">(.*?)</script>', page, re.S)[1])
    charts = {c["id"]: c for c in data}
    assert set(charts) == {"reward", "step-time", "samples", "train", "staleness", "versions"}
    for key, c in charts.items():
        assert f'id="chart-{key}"' in page and c["series"] and not c["empty"], key
        assert all(len(s["xs"]) == len(s["ys"]) > 0 for s in c["series"]), key
    reward = {s["label"]: s for s in charts["reward"]["series"]}
    assert reward["rollout reward"]["ys"] == pytest.approx([s / STEPS for s in range(STEPS)], rel=1e-5)  # 6 digits
    assert reward["rollout reward"]["smooth"]
    assert reward["held-out eval"]["xs"] == [0, STEPS] and not reward["held-out eval"].get("smooth")
    assert {s["label"]: s["ys"] for s in charts["train"]["series"]}["KL"][0] == 1e-5  # small values keep their digits
    assert [s["label"] for s in charts["staleness"]["series"]] == ["staleness 0", "staleness 1"]
    engine = charts["versions"]["series"][1]
    assert engine["label"] == "engine-0" and engine["stepped"] and len(engine["bands"]) == STEPS - 1
    assert 'id="smoothing"' in page and "/static/vendor/uplot/uPlot.iife.min.js" in page
    assert "/static/dashboard.js" in page and "http-equiv" not in page  # the page refreshes itself only when live
    by_time = client.get("/?x=time", headers=AUTH).text
    assert '"time": true' in by_time and '"x": "wall-clock"' in by_time


def test_tables_are_text_and_a_finished_run_shows_exit_codes(client):
    page = _text(client.get("/", headers=AUTH).text)
    assert "{}" not in page and "{'" not in page and "None" not in page
    assert re.search(r"<td>filtered</td><td>none</td>", page)
    assert re.search(r"<td>in_flight_at_end</td><td>recycled_waiting: 0</td>", page)
    services = {x["name"]: x for x in client.get("/api/services", headers=AUTH).json()}
    assert services["trainer"]["state"] == "exited 0" and services["trainer"]["exit_code"] == 0
    assert services["engine-0"]["state"] == "exited on SIGTERM" and services["eval"]["state"] == "exited 3"
    assert services["buffer"]["state"] == "stopped"  # the exit on record is another pid's
    assert services["launcher"]["state"] == "stopped" and not any(x["running"] for x in services.values())
    assert '<span class="ok">exited 0</span>' in page and '<span class="ok">exited on SIGTERM</span>' in page
    assert '<span class="bad">exited 3</span>' in page and '<span class="muted">stopped</span>' in page
    assert "not running" not in page
    assert '<p class="diagnosis" id="diagnosis" data-live>' in page
    assert '<p class="muted" id="length-warning" data-live></p>' in page  # answers end on their own: no warning


def test_step_and_prompt_pages_escape_what_they_show(client):
    step = _text(client.get("/step/3", headers=AUTH).text)
    assert "&lt;b&gt;12&lt;/b&gt;" in step and "<b>12" not in step and "&lt;i&gt;123=&lt;/i&gt;" in step
    assert "<td>1, 2</td>" in step and "[1, 2]" not in step  # the weight versions, as text
    assert 'class="seg mask0"' in step and "not generated by the model" in step
    assert "No sample record for step 99" in client.get("/step/99", headers=AUTH).text
    prompt = _text(client.get("/prompt/3", headers=AUTH).text)
    assert '<b id="fate">trained</b>' in prompt and 'href="/step/1"' in prompt and "None" not in prompt
    assert "no event for prompt 999" in client.get("/prompt/999", headers=AUTH).text
    login = client.get("/login?next=/%22%3E%3Cscript%3E").text
    assert '"><script>' not in login and "&#34;&gt;&lt;script&gt;" in login


def test_the_vendored_charts_are_served_behind_the_run_token(client):
    for path in ("/static/vendor/uplot/uPlot.iife.min.js", "/static/vendor/uplot/uPlot.min.css",
                 "/static/vendor/uplot/LICENSE", "/static/dashboard.js"):  # fmt: skip
        assert client.get(path, headers=AUTH).status_code == 200, path
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/login"), path
    assert "MIT License" in client.get("/static/vendor/uplot/LICENSE", headers=AUTH).text


def test_exit_codes_are_said_in_words():
    assert [exit_state(c) for c in (0, 3, -15, -9, -99)] == ["exited 0", "exited 3", "exited on SIGTERM",
                                                              "exited on SIGKILL", "exited -99"]  # fmt: skip


def test_values_are_written_as_text():
    assert readable({}) == "none" and readable([]) == "none" and readable(None) == "-"
    assert readable({"zero_std": 3, "too_long": 1}) == "zero_std: 3, too_long: 1"
    assert readable({"recycled_waiting": 0}) == "recycled_waiting: 0"
    assert readable([0, 1]) == "0, 1" and readable(0.123456) == "0.1235" and readable("x") == "x"


def test_the_length_warning_shows_when_answers_run_to_the_limit(run_dir):
    from fastapi.testclient import TestClient

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    padded = [r | {"rollout/truncated_ratio": 0.9, "rollout/response_length/mean": min(4.0 + i, 8.0)}
              for i, r in enumerate(rows)]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in padded))
    with TestClient(build_app(Dashboard(run_dir, Keys.of_run(TOKEN)))) as c:
        page = c.get("/", headers=AUTH).text
    assert re.search(r'<p class="bad" id="length-warning" data-live>length: 90% of the answers run to the', page)
