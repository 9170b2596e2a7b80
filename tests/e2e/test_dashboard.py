"""The run dashboard and `asyncrl status`, on a real run through the CLI: live (the launcher's
dashboard) and finished (`asyncrl dashboard RUN_DIR` on a copy of the run's store). Every data
route is asked with and without the run token; what it shows is held against the run's own
records (trained.jsonl, metrics.jsonl, `asyncrl audit`)."""

from __future__ import annotations

import gzip
import json
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from markupsafe import escape

from tests.conftest import finished_dashboard, run_auth
from tests.e2e.test_cli_run import asyncrl, start_run

DATA_ROUTES = ("/api/summary", "/api/curves", "/api/curves?x=time", "/api/staleness", "/api/versions", "/api/buffer",
               "/api/services", "/api/audit", "/api/errors", "/api/steps", "/api/step/0", "/api/prompt/0")  # fmt: skip
PAGES = ("/", "/?x=time", "/step/0", "/prompt/0")
STATIC = ("/static/vendor/uplot/uPlot.iife.min.js", "/static/vendor/uplot/LICENSE", "/static/dashboard.js")
CHARTS = ("reward", "step-time", "samples", "train", "staleness", "versions")
CHART_DATA = re.compile(r'<script type="application/json" id="chart-data">(.*?)</script>', re.S)


def chart_data(page: str) -> dict:
    """The overview's charts, by id, from the JSON block that static/dashboard.js draws them from."""
    return {c["id"]: c for c in json.loads(CHART_DATA.search(page)[1])}


def page_text(page: str) -> str:
    """A page as a reader reads it: without its chart data and its style."""
    return re.sub(r"<style>.*?</style>", "", CHART_DATA.sub("", page), flags=re.S)


def _wait_for(pred, what: str, timeout: float = 120, proc=None):
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {proc.stdout.read()}")
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)
    return got


def _check_routes(url: str, headers: dict) -> dict:
    """Every route refuses a caller without the token and answers one with it; returns the JSON."""
    out = {}
    with httpx.Client(timeout=10, follow_redirects=False) as http:
        assert http.get(url + "/healthz").status_code == 200
        for path in DATA_ROUTES:
            r = http.get(url + path)
            assert r.status_code == 401 and "run token" in r.text, (path, r.status_code)
            r = http.get(url + path, headers={"Authorization": "Bearer not-the-token"})
            assert r.status_code == 401, path
            r = http.get(url + path, headers=headers)
            assert r.status_code == 200, (path, r.text[:300])
            out[path] = r.json()
        for path in PAGES + STATIC:
            r = http.get(url + path)
            assert r.status_code == 303 and r.headers["location"].startswith("/login"), path
            r = http.get(url + path, headers=headers)
            assert r.status_code == 200, path
            if path.startswith(("/?", "/step", "/prompt")) or path == "/":
                assert "{'" not in page_text(r.text) and "{}" not in page_text(r.text), path  # no Python repr
            if path.startswith("/?") or path == "/":  # every chart's container, and its data
                assert set(chart_data(r.text)) == set(CHARTS) and all(f'id="chart-{c}"' in r.text for c in CHARTS)
            out[path] = r.text
        # a browser logs in with the token once, then carries a cookie (never the token itself)
        r = http.post(url + "/login", data={"token": "wrong", "next": "/"})
        assert r.status_code == 303 and "failed=1" in r.headers["location"]
        r = http.post(url + "/login", data={"token": headers["Authorization"].split()[1], "next": "/step/0"})
        assert r.status_code == 303 and r.headers["location"] == "/step/0"
        ((name, cookie),) = r.cookies.items()
        assert name.startswith("asyncrl_dashboard_run-")  # one cookie name per run
        for elsewhere in ("//evil.example/x", "/\\evil.example", "https://evil.example/"):  # never another site
            r2 = http.post(url + "/login", data={"token": headers["Authorization"].split()[1], "next": elsewhere})
            assert r2.status_code == 303 and r2.headers["location"] == "/", elsewhere
        assert cookie and cookie != headers["Authorization"].split()[1]
    for value, status in ((cookie, 200), ("forged", 401)):
        with httpx.Client(timeout=10, cookies={name: value}) as browser:
            assert browser.get(url + "/api/summary").status_code == status
    with httpx.Client(timeout=10) as http:
        # read-only: nothing but GET (and the login form) is routed
        assert http.post(url + "/api/summary", headers=headers).status_code == 405
        assert http.post(url + "/login", content=b"token=" + b"x" * 100_000).status_code == 413  # no memory to spend
    return out


def test_the_dashboard_and_status_show_a_run_live_and_finished(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(tmp_path, "--num-rollout", "40", "--eval-interval", "20", "--run-dir", str(run_dir))
    headers = None
    try:
        services = _wait_for(lambda: (run_dir / "services.json").exists()
                             and json.loads((run_dir / "services.json").read_text()), "services.json", proc=proc)  # fmt: skip
        url = services["dashboard"]
        headers = run_auth(run_dir)
        # live: the launcher's dashboard, which holds no run token (only the hashes that check it)
        _wait_for(lambda: (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").stat().st_size,
                  "a first step", proc=proc)  # fmt: skip
        live = _check_routes(url, headers)
        assert live["/api/summary"]["live"] is True and live["/api/summary"]["mode"] == "fully_async"
        dash_pid = json.loads((run_dir / "pids.json").read_text())["dashboard"]
        token = headers["Authorization"].split()[1]
        assert token.encode() not in Path(f"/proc/{dash_pid}/environ").read_bytes()
        # a live run's dashboard is the launcher's: `asyncrl dashboard` points there
        r = asyncrl("dashboard", str(run_dir), cwd=tmp_path, timeout=60)
        assert r.returncode == 2 and "still running" in r.stderr and url in r.stderr
        r = asyncrl("status", str(run_dir), cwd=tmp_path, timeout=60)
        assert r.returncode == 0 and " live " in r.stdout.splitlines()[0], r.stdout + r.stderr
        assert re.search(r"step \d+/40", r.stdout) and "dashboard" in r.stdout
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert f"dashboard: {url}/" in out
    audit = json.loads((run_dir / "audit.json").read_text())

    # finished: `asyncrl status` reads the audit, `asyncrl dashboard` a copy of the store
    r = asyncrl("status", str(run_dir), cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and " finished " in r.stdout.splitlines()[0], r.stdout + r.stderr
    assert "step 40/40" in r.stdout and "balanced" in r.stdout and "held-out" in r.stdout
    assert re.search(r"^diagnosis: (generation-bound|trainer-bound|balanced|staleness drops)", r.stdout, re.M), r.stdout
    def files() -> list:
        return sorted((str(p.relative_to(run_dir)), p.stat().st_size, p.stat().st_mtime_ns)
                      for p in run_dir.rglob("*") if p.is_file())  # fmt: skip

    before = files()
    with finished_dashboard(run_dir) as url:
        got = _check_routes(url, headers)
    assert files() == before  # the run directory is not written, not even a log
    # a finished run's services: each with the exit code the launcher recorded when it stopped it
    exits = json.loads((run_dir / "exits.json").read_text())
    assert {"trainer", "buffer", "dashboard", "engine-0", "nats-server"} <= set(exits), exits
    # the services on services/common/runtime.py and nats-server exit 0 on the launcher's SIGTERM;
    # uvicorn's servers (the engine, the dashboard) end on it again after their graceful shutdown
    assert all(exits[n]["code"] == 0 for n in ("buffer", "weight-sync", "eval", "rollout-0", "nats-server")), exits
    assert all(x["code"] in (0, -signal.SIGTERM) for x in exits.values()), exits
    states = {x["name"]: x["state"] for x in got["/api/services"]}
    assert states["buffer"] == "exited 0" and states["launcher"] == "stopped", states
    assert all(states[n] == ("exited 0" if x["code"] == 0 else "exited on SIGTERM") for n, x in exits.items()), states
    overview = page_text(got["/"])
    assert '<span class="ok">exited 0</span>' in overview and "not running" not in overview
    assert f'id="diagnosis" data-live>{escape(got["/api/summary"]["diagnosis"])}</p>' in overview  # as it was
    charts = chart_data(got["/"])
    reward = {s["label"]: s for s in charts["reward"]["series"]}
    assert len(reward["rollout reward"]["ys"]) == 40 and len(reward["held-out eval"]["xs"]) == 3
    trainer, engine = charts["versions"]["series"]  # the trainer's versions, and the one engine's with its pauses
    assert trainer["label"] == "trainer" and engine["stepped"] and engine["bands"] and engine["ys"][-1] == 40

    summary = got["/api/summary"]
    assert summary["live"] is False and summary["finished"] and summary["step"] == 40 and summary["total"] == 40
    assert summary["diagnosis_kind"] in ("generation", "trainer", "balanced", "staleness"), summary["diagnosis"]
    # the dashboard's ledger is the audit's
    for k in ("released_prompts", "trained", "failed", "recycled", "lost", "trained_twice", "balanced"):
        assert got["/api/audit"][k] == audit[k], k
    assert got["/api/buffer"]["trained"] == audit["trained"] and got["/api/buffer"]["capacity"] == 4
    # curves come from metrics.jsonl, over steps and wall-clock
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert got["/api/curves"]["reward"][1] == pytest.approx([r["rollout/reward/mean"] for r in recs])
    assert len(got["/api/curves?x=time"]["step_time"][0]) == 40
    assert len(got["/api/curves"]["heldout"][0]) == 3  # before training, after 20 and 40 steps
    # staleness per step from the ledger's leases: every trained group once
    assert sum(sum(v.values()) for v in got["/api/staleness"]["per_step"].values()) == audit["trained"]
    # each engine's version timeline and the pause of each update
    versions = got["/api/versions"]
    ((engine, points),) = versions["engines"].items()
    assert [v for _, v in points] == sorted(v for _, v in points) and points[-1][1] == 40
    assert all(a <= b for a, b in versions["pauses"][engine])
    # a step's samples are the groups the trainer recorded, with advantages and version spans
    trained = {
        json.loads(x)["step"]: json.loads(x)["groups"] for x in (run_dir / "trained.jsonl").read_text().splitlines()
    }
    assert got["/api/steps"]["steps"] == list(range(40))
    step0 = got["/api/step/0"]
    assert sorted(g["group_index"] for g in step0["groups"]) == trained[0] and step0["version"] == 0
    for g in step0["groups"]:
        advs = [s["advantage"] for s in g["samples"]]
        assert len(advs) == 4 and sum(advs) == pytest.approx(0, abs=1e-5)  # group-normalised
        for s in g["samples"]:
            assert s["fate"] == "trained" and s["weight_versions"] == [0]
            assert all(seg[1] == 0 and seg[2] == 1 for seg in s["segments"])  # version 0, in the loss
    # a prompt's history: released, stored, leased to the step that trained it
    prompt0 = got["/api/prompt/0"]
    assert prompt0["fate"] == "trained" and prompt0["trained_step"] in trained
    assert 0 in trained[prompt0["trained_step"]]
    assert [e["kind"] for e in prompt0["events"]][:1] == ["released"]


def test_every_page_loads_within_2s_on_a_10000_step_run(tmp_path):
    """A synthetic 10,000-step run: metrics, evals, one sample record per step and a ledger of
    40,000 prompts; every page and data route answers in under 2 s (curves are downsampled)."""
    from fastapi.testclient import TestClient

    from asyncrl_proto import LedgerEvent, PromptMsg
    from services.common import sample_records
    from services.common.httpauth import Keys
    from services.dashboard.app import Dashboard, build_app
    from services.dashboard.data import MAX_POINTS

    steps, groups = 10_000, 4
    (tmp_path / "config.json").write_text(json.dumps({"run_id": "big", "num_rollout": steps, "fully_async": True,
                                                      "rollout_batch_size": groups, "eval_prompt_data": ["set"]}))  # fmt: skip
    t0 = 1.8e9
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "time": t0 + s * 0.3, "weight_version": s + 1, "rollout/reward/mean": s / steps,
                                "perf/step_time_s": 0.3, "perf/rollout_wait_s": 0.01, "perf/train_time_s": 0.25,
                                "rollout/num_samples": 16, "train/entropy": 2.0, "train/pg_clipfrac": 0.1,
                                "train/ppo_kl": 0.01}) + "\n")  # fmt: skip
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"step": s, "eval/set": 0.5}) + "\n"
                                                 for s in range(0, steps + 1, 50)))  # fmt: skip
    (tmp_path / "trained.jsonl").write_text("".join(json.dumps({"step": s, "groups": list(range(s * groups, (s + 1) * groups))}) + "\n"
                                                    for s in range(steps)))  # fmt: skip
    sample = {"index": 0, "reward": 0.5, "advantage": 0.1, "status": "completed", "fate": "trained",
              "weight_versions": [1], "response_length": 5, "segments": [["12345", 1, 1]]}  # fmt: skip
    d = sample_records.records_dir(tmp_path)
    d.mkdir()
    for s in range(steps):
        rec = {"step": s, "version": s, "groups": [{"group_index": s * groups + g, "group_id": f"g{s * groups + g}-a0",
                                                     "staleness": 1, "prompt": "123=", "label": "321",
                                                     "samples": [sample] * 4} for g in range(groups)]}  # fmt: skip
        (d / f"{s:08d}.json.gz").write_bytes(gzip.compress(json.dumps(rec).encode(), 1))
    token = "t" * 32
    dash = Dashboard(tmp_path, Keys.of_run(token))
    seq = 0
    events = []
    for s in range(steps):
        for g in range(groups):
            gi = s * groups + g
            p = PromptMsg(group_index=gi, prompt="123=", label="321", n_samples=4)
            events.append(LedgerEvent(seq=(seq := seq + 1), kind="released", prompt=p, ts=t0 + s * 0.3,
                                      source={"cursor": gi + 1, "next_group_index": gi + 1}))  # fmt: skip
            events.append(LedgerEvent(seq=(seq := seq + 1), kind="put", group_id=f"g{gi}-a0", group_index=gi,
                                      outcome="stored", stream_seq=gi + 1, ts=t0 + s * 0.3))  # fmt: skip
        for g in range(groups):
            gi = s * groups + g
            events.append(LedgerEvent(seq=(seq := seq + 1), kind="leased", group_id=f"g{gi}-a0", group_index=gi,
                                      step=s, staleness=g % 3, stream_seq=gi + 1, ts=t0 + s * 0.3))  # fmt: skip
        events.append(LedgerEvent(seq=(seq := seq + 1), kind="lease_complete", step=s, ts=t0 + s * 0.3))
        events.append(LedgerEvent(seq=(seq := seq + 1), kind="committed", step=s, ts=t0 + s * 0.3))
    dash.data.main.auditor.feed(events)
    for ev in events:
        dash.data.main.index(ev)
    with TestClient(build_app(dash)) as client:
        auth = {"Authorization": f"Bearer {token}"}
        for path in (*DATA_ROUTES, "/api/step/9999", "/api/prompt/39999", *PAGES, "/step/9999", "/prompt/39999"):
            t = time.perf_counter()
            r = client.get(path, headers=auth)
            took = time.perf_counter() - t
            assert r.status_code == 200, (path, r.text[:200])
            assert took < 2.0, f"{path} took {took:.2f}s"
        curves = client.get("/api/curves", headers=auth).json()
        assert len(curves["reward"][0]) == MAX_POINTS  # downsampled on the server
        assert client.get("/api/audit", headers=auth).json()["trained"] == steps * groups
        page = client.get("/", headers=auth).text
        assert len(page) < 400_000 and "no data yet" not in page
        charts = chart_data(page)  # every chart has its lines, none longer than the page can carry
        assert all(c["series"] for c in charts.values()) and set(charts) == set(CHARTS)
        assert max(len(s["xs"]) for c in charts.values() for s in c["series"]) <= MAX_POINTS + 1
