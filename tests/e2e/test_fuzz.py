"""The fuzz suite: a real run (every service a process, the embedded nats-server with its per-role
users, the built-in engine) takes random and absurd input on every subject a service consumes and
on every HTTP route, while it trains.

Per subject, hypothesis sends random bytes, wrong shapes (any msgpack), oversize payloads and
well-typed messages with absurd values (NaN, infinities, negative or huge versions and steps,
empty and oversize token lists). It publishes as the admin identity, which may publish anywhere:
the worst a careless or hostile neighbour with credentials can do. After each batch every service
and engine still answers its health check; HTTP answers 2xx or 4xx, never a 5xx or a hang. At the
end the run is stopped and audited: the ledger balances (0 lost, 0 trained twice), every group the
buffer rejected is both dead-lettered and recorded on the ledger, and the weights are finite.

Examples are drawn deterministically (derandomize), so a failure reproduces. Set
ASYNCRL_FUZZ_REPORT=path to write the counts as JSON (docs/trust.md quotes them).
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgpack
import nats.js.errors
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl_proto import (
    BufferCommit,
    BufferGetRequest,
    ControlMsg,
    DeadLetter,
    EvalRequest,
    EvalResult,
    Heartbeat,
    ProgressRecord,
    PromptMsg,
    RolloutGroup,
    Sample,
    SampleStatus,
    WeightsLive,
    WeightsPublished,
    encode,
    group_id,
)

EXAMPLES = 40
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))  # fmt: skip
COUNTS: collections.Counter = collections.Counter()

# ---- strategies ----------------------------------------------------------------------------------
INTS = st.sampled_from([-(2**62), -1, 0, 1, 3, 10**9, 2**62]) | st.integers(-5, 50)
FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e308]) | st.floats(allow_nan=True)
TEXT = st.sampled_from(["", "/etc", "../../../etc/passwd", "g0-a0", "\x00", "x" * 5000]) | st.text(max_size=30)
TOKENS = (st.lists(INTS, max_size=12) | st.just([]) | st.just(list(range(200_000)))
          | st.lists(st.integers(0, 20), min_size=1, max_size=12))  # fmt: skip
ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=25,
)
RAW = st.binary(max_size=600) | ANY.map(msgpack.packb) | st.sampled_from([b"", b"\xc1", b"\x00" * 9])
# up to just under the 8 MB payload limit: a dead letter of such a message must still fit
OVERSIZE = st.sampled_from([1_000_000, 7_900_000]).map(lambda n: b"\x91" + bytes(range(256)) * (n // 256))

SAMPLE = st.builds(
    Sample, index=INTS, group_index=INTS, prompt=TEXT | TOKENS, label=TEXT, tokens=TOKENS, response=TEXT,
    response_length=INTS, reward=FLOATS | st.none() | st.dictionaries(TEXT, FLOATS, max_size=2),
    rollout_log_probs=st.lists(FLOATS, max_size=8), loss_mask=st.none() | st.lists(INTS, max_size=8),
    status=st.sampled_from(list(SampleStatus)), weight_versions=st.lists(INTS, max_size=3),
)  # fmt: skip
GROUP = st.builds(RolloutGroup, group_id=TEXT, group_index=INTS, attempt=INTS,
                  samples=st.lists(SAMPLE, max_size=5))  # fmt: skip
PROMPT = st.builds(PromptMsg, group_index=INTS, prompt=TEXT | TOKENS | st.lists(st.dictionaries(TEXT, TEXT), max_size=2),
                   label=TEXT, attempt=INTS, n_samples=INTS, epoch=INTS, row=INTS)  # fmt: skip
# commits and gets of steps no trainer is at (absurd steps), as the probes
ABSURD_STEPS = st.sampled_from([-(2**62), -1, 10**6, 10**12, 2**62])
TYPED = {
    "rollouts": GROUP,
    "prompts": PROMPT,
    "weights.published": st.builds(WeightsPublished, version=INTS, step=INTS, uri=TEXT, sha256=TEXT, num_bytes=INTS),
    "weights.live": st.builds(WeightsLive, version=INTS, duration_s=FLOATS),
    "buffer.get": st.builds(BufferGetRequest, step=ABSURD_STEPS, count=INTS, current_version=st.none() | INTS,
                            release_min_version=st.none() | INTS, lookahead_steps=INTS, wait_s=FLOATS),
    "buffer.commit": st.builds(BufferCommit, step=ABSURD_STEPS, version=INTS),
    "eval.requests": st.builds(EvalRequest, step=INTS, version=INTS, rollout_id=st.none() | INTS, snapshot_uri=TEXT,
                               export_time_s=FLOATS),
    "eval.results": st.builds(EvalResult, step=INTS, version=INTS, metrics=st.dictionaries(TEXT, FLOATS, max_size=4)),
    "control": st.builds(ControlMsg, command=TEXT | st.sampled_from(["pause_submission", "resume_submission"]),
                         token=TEXT),
    "heartbeat.rollout": st.builds(Heartbeat, service=TEXT, instance_id=TEXT,
                                   info=st.fixed_dictionaries({"inflight_groups": INTS | FLOATS | TEXT})),
    "progress": st.builds(ProgressRecord, step=INTS, done=st.booleans(), record=st.dictionaries(TEXT, FLOATS, max_size=3)),
}  # fmt: skip
JETSTREAM = {"rollouts", "prompts", "weights.published", "eval.requests", "eval.results", "progress", "ledger"}


# ---- the run under fire ---------------------------------------------------------------------------
class Bus:
    """An admin connection on an event loop of its own thread (hypothesis tests are synchronous)."""

    def __init__(self, url: str, run_id: str, creds, role: str = "fuzz"):
        from services.common.bus import Bus as _Bus

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.bus = self.run(_Bus.connect(url, run_id, role, creds=creds))  # replies on the role's own inbox

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def send(self, tail: str, data: bytes) -> None:
        subject = self.bus.subjects._s(tail)
        if tail in JETSTREAM:
            try:
                self.run(self.bus.js.publish(subject, data))
            except nats.js.errors.APIError as e:  # over the stream's message-size limit: refused, not stored
                assert "maximum" in (e.description or "").lower(), e
                COUNTS[f"refused by its stream {tail}"] += 1
                return
        else:
            self.run(self.bus.nc.publish(subject, data))
        COUNTS[f"nats {tail}"] += 1

    def close(self) -> None:
        if self.loop.is_running():
            self.run(self.bus.close())
            self.loop.call_soon_threadsafe(self.loop.stop)


class Run:
    def __init__(self, root: Path):
        self.dir = root / "run"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "train-async", "--fully-async", "--rollout-batch-size", "4",
             "--n-samples-per-prompt", "4", "--async-data-buffer-capacity-factor", "1", "--num-rollout", "100000",
             "--eval-interval", "40", "--prompt-ack-wait-s", "5", "--service-restarts", "8",
             "--run-dir", str(self.dir)],
            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 180
        while not (self.dir / "services.json").exists():
            assert self.proc.poll() is None, self.proc.stdout.read()
            assert time.monotonic() < deadline, "the run did not come up"
            time.sleep(0.1)
        from services.audit import admin_credentials

        self.services = json.loads((self.dir / "services.json").read_text())
        self.config = json.loads((self.dir / "config.json").read_text())
        self.token = (self.dir / "secrets" / "run-token").read_text().strip()
        self.http = httpx.Client(timeout=15, headers={"Authorization": f"Bearer {self.token}"})
        self.bus = Bus(self.config["nats_url"], self.config["run_id"], admin_credentials(self.dir))

    def steps(self) -> int:
        path = self.dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def healthy(self) -> None:
        """Every service and engine answers its health check (waiting out a restart, if any)."""
        for name, url in self.services.items():
            path = "/health_generate" if name.startswith("engine") else "/healthz"
            deadline = time.monotonic() + 60
            while True:
                assert self.proc.poll() is None, f"the run died: {self.proc.stdout.read()[-3000:]}"
                try:
                    if self.http.get(url + path).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"{name} is not healthy"
                time.sleep(0.2)
        for url in (u for n, u in self.services.items() if n.startswith("engine")):
            self.http.post(url + "/continue_generation")  # undo what a fuzzed pause did
        for url in (u for n, u in self.services.items() if n.startswith("rollout")):
            self.http.post(url + "/control/resume_submission")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = Run(tmp_path_factory.mktemp("fuzz"))
    yield r
    r.bus.close()
    if r.proc.poll() is None:
        r.proc.kill()
        r.proc.wait()


# ---- NATS: every subject a service consumes ---------------------------------------------------------
@pytest.mark.parametrize("tail", sorted(TYPED))
def test_random_and_absurd_messages_on_every_subject(run, tail):
    @SETTINGS
    @given(data=RAW | TYPED[tail].map(encode))
    def fuzz(data):
        run.bus.send(tail, data)

    fuzz()
    run.healthy()


@pytest.mark.parametrize("tail", ["rollouts", "prompts", "weights.published", "eval.requests", "ledger"])
def test_oversize_payloads(run, tail):
    @settings(max_examples=2, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(data=OVERSIZE)
    def fuzz(data):
        run.bus.send(tail, data)

    fuzz()
    run.healthy()


def test_garbage_on_the_ledger(run):
    @SETTINGS
    @given(data=RAW)
    def fuzz(data):
        run.bus.send("ledger", data)

    fuzz()
    run.healthy()


# ---- HTTP: every route of every service and engine -----------------------------------------------------
ENGINE_ROUTES = [("POST", "/generate"), ("POST", "/pause_generation"), ("POST", "/continue_generation"),
                 ("POST", "/abort_request"), ("POST", "/update_weights_from_disk"), ("POST", "/update_weight_version"),
                 ("GET", "/flush_cache"), ("GET", "/model_info"), ("GET", "/server_info"), ("GET", "/health"),
                 ("GET", "/health_generate"), ("GET", "/metrics"), ("GET", "/status"), ("POST", "/nope")]  # fmt: skip
SERVICE_ROUTES = [("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/status"), ("GET", "/config"),
                  ("POST", "/control/pause_submission"), ("POST", "/control/resume_submission"), ("POST", "/nope")]  # fmt: skip
DASHBOARD_ROUTES = [("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/login"), ("POST", "/login"), ("GET", "/"),
                    ("GET", "/step/3"), ("GET", "/step/-1"), ("GET", "/prompt/999999"), ("GET", "/api/summary"),
                    ("GET", "/api/step/0"), ("GET", "/api/prompt/abc"), ("POST", "/api/audit"), ("GET", "/nope")]  # fmt: skip
"""The run's dashboard: read-only pages and JSON; the login form is its one POST."""
BODY = (ANY.map(lambda v: json.dumps(v, allow_nan=True).encode()) | st.binary(max_size=300)
        | st.fixed_dictionaries({"input_ids": TOKENS, "sampling_params": ANY}).map(lambda v: json.dumps(v).encode())
        | st.fixed_dictionaries({"input_ids": st.just([1, 5, 6, 15]), "sampling_params": st.dictionaries(
            st.sampled_from(["temperature", "top_p", "top_k", "n", "max_new_tokens", "min_p", "stop", "logit_bias"]),
            FLOATS | INTS | TEXT, max_size=3)}).map(lambda v: json.dumps(v).encode()))  # fmt: skip


def _kind(name: str) -> str:
    return "engine" if name.startswith("engine") else "dashboard" if name == "dashboard" else "service"


@pytest.mark.parametrize("kind", ["engine", "service", "dashboard"])
def test_every_http_route_answers_4xx_never_5xx_never_hangs(run, kind):
    targets = [u for n, u in run.services.items() if _kind(n) == kind]
    routes = {"engine": ENGINE_ROUTES, "service": SERVICE_ROUTES, "dashboard": DASHBOARD_ROUTES}[kind]

    @settings(max_examples=EXAMPLES * 3, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(route=st.sampled_from(routes), target=st.sampled_from(targets), body=BODY, auth=st.booleans())
    def fuzz(route, target, body, auth):
        method, path = route
        headers = {"Content-Type": "application/json"} | ({} if auth else {"Authorization": "Bearer wrong"})
        r = run.http.request(method, target + path, content=body, headers=headers)  # 15 s timeout: a hang fails
        COUNTS[f"http {kind}"] += 1
        # a readiness probe answers 503 while its service sets up: the buffer, restarted now and then by
        # the ledger fuzz, may be doing so (its /healthz already answers)
        not_ready = path == "/readyz" and r.status_code == 503 and r.text == "not ready\n"
        assert r.status_code < 500 or not_ready, (method, path, body[:200], r.status_code, r.text[:300])
        if not auth and path not in ("/healthz", "/readyz", "/metrics", "/health", "/health_generate", "/login"):
            # the dashboard sends a browser without the token to its login page
            expected = 303 if kind == "dashboard" and not path.startswith("/api/") else 401
            assert r.status_code == expected, (path, r.status_code)

    fuzz()
    run.healthy()


# ---- each role's own abuse, within its permissions ----------------------------------------------------
def test_each_role_abuses_only_what_its_own_credentials_allow(run):
    """docs/trust.md's role probes, with each role's own NATS identity and HTTP token: a producer
    forges 1024 heartbeats, answers a prompt 200 ahead and publishes where nothing reads; weight-sync
    announces version 10**9 (refused unless published: here the admin's fuzz may have published
    absurd versions, so tests/integration/test_validation.py checks that one); every role calls
    HTTP routes outside its scope. Backpressure holds, nothing is released early, nothing is stored
    for no one, and every route outside a scope is 403."""
    from services.common.httpauth import role_token
    from services.common.secrets import NatsCredentials, load_roles_file

    roles = load_roles_file(run.dir / "secrets" / "nats.json")
    buses = {role: Bus(run.config["nats_url"], run.config["run_id"], NatsCredentials(**roles[role]), role)
             for role in ("rollout", "weight-sync")}  # fmt: skip
    buffer = run.services["buffer"]

    def ask(method: str, url: str, **kw) -> httpx.Response:
        for _ in range(10):  # the ledger fuzz restarts the buffer now and then: wait it out
            try:
                return run.http.request(method, url, **kw)
            except httpx.TransportError:
                run.healthy()
        raise AssertionError(f"{url} never answered")

    def status() -> dict:
        return ask("GET", buffer + "/status").json()

    try:
        producer = buses["rollout"].bus
        s = producer.subjects
        for i in range(1024):
            hb = Heartbeat(service="rollout", instance_id=f"forged-{i}", info={"inflight_groups": 4})
            buses["rollout"].run(producer.publish_core(s.heartbeat("rollout"), hb))
        ghost_index = status()["data_source"]["next_group_index"] + 200
        ghost = RolloutGroup(group_id=group_id(ghost_index, 0), group_index=ghost_index, samples=[])
        buses["rollout"].run(producer.publish(s.rollouts, ghost, msg_id=ghost.group_id))
        with pytest.raises(Exception, match="(?i)no response|no responders|no stream|timeout"):
            buses["rollout"].run(producer.js.publish(s.rollouts + ".zzz", b"stored for no one", timeout=1))
        sync = buses["weight-sync"].bus
        buses["weight-sync"].run(sync.publish(s.weights_live, WeightsLive(version=10**9)))
        cap = run.config["rollout_batch_size"]  # capacity factor 1 and one producer's cap, in groups
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:  # released and unanswered or stored: never beyond the budget
            now = status()
            assert now["outstanding_prompts"] + now["stored_groups"] <= 2 * cap + cap, now
            assert now["data_source"]["next_group_index"] < ghost_index, "a group released prompts"
            time.sleep(0.3)
    finally:
        for b in buses.values():
            b.close()
    engine = run.services["engine-0"]
    outside = {"rollout": [("POST", engine + "/pause_generation"), ("POST", engine + "/update_weights_from_disk"),
                           ("POST", buffer + "/control/pause_submission"), ("GET", buffer + "/status")],
               "eval": [("POST", engine + "/update_weights_from_disk"), ("POST", engine + "/flush_cache")],
               "weight-sync": [("POST", engine + "/generate"), ("GET", run.services["trainer"] + "/status")]}  # fmt: skip
    for role, calls in outside.items():
        auth = {"Authorization": f"Bearer {role_token(run.token, role)}"}
        for method, url in calls:
            r = ask(method, url, json={}, headers=auth)
            COUNTS[f"http {role} credential outside its scope"] += 1
            assert r.status_code == 403, (role, url, r.status_code, r.text[:200])
    run.healthy()


# ---- the end: the run survived, and its books balance ------------------------------------------------
def test_the_run_survived_and_its_ledger_balances(run):
    run.healthy()
    # it trains again: fuzzed pauses of submission sent over NATS lapse after 60 s unrenewed
    before, deadline = run.steps(), time.monotonic() + 150
    while run.steps() < before + 5:
        assert run.proc.poll() is None and time.monotonic() < deadline, "the run stopped training"
        time.sleep(0.2)
    run.bus.close()
    run.proc.send_signal(signal.SIGINT)
    out, _ = run.proc.communicate(timeout=120)
    assert "interrupted: every process of the run was stopped" in out, out[-3000:]
    # no service crashed or hung on what it was sent; the buffer alone restarts, by design, when it
    # finds messages it did not write on its ledger (one writer), and its replay skips them
    restarts = [line for line in out.splitlines() if "restarting" in line]
    assert all(line.lstrip().startswith("buffer ") for line in restarts), restarts
    buffer_log = (run.dir / "logs" / "buffer.log").read_text(errors="replace")
    # one failure per restart, however many of its handlers met the conflict before it stopped
    assert buffer_log.count("failing: the ledger holds a message this buffer did not write") == len(restarts)
    for log in (run.dir / "logs").glob("*.log"):
        if log.name != "buffer.log":
            assert "Traceback" not in log.read_text(errors="replace"), f"{log.name} has a traceback"
    audit = subprocess.run([sys.executable, "-m", "services.cli", "audit", str(run.dir), "--json"],
                           capture_output=True, text=True, timeout=180)  # fmt: skip
    assert audit.stdout, audit.stderr[-3000:]
    report = json.loads(audit.stdout)
    assert report["balanced"] and report["lost"] == 0 and report["trained_twice"] == 0, report["problems"]
    # every group the buffer rejected is dead-lettered, and on the ledger as `rejected`
    letters, rejected = asyncio.run(_dead_letters_and_rejections(run))
    from_rollouts = [d for d in letters if d.original_subject.endswith(".rollouts")]
    # (a buffer restarted by the ledger fuzz between a dead letter and its record judges the
    # redelivered message again: a second dead letter, one record)
    assert len({d.sha256 for d in from_rollouts}) <= rejected <= len(from_rollouts)
    assert rejected >= COUNTS["nats rollouts"] // 2
    # the weights stayed finite
    from services.model.hf_io import load_state_dict

    newest = max((run.dir / "weights").glob("v*"), key=lambda p: int(p.name[1:]))
    load_state_dict(newest)  # raises NonFiniteWeights otherwise
    summary = {"messages": {k: v for k, v in COUNTS.items() if k.startswith("nats")},
               "requests": {k: v for k, v in COUNTS.items() if k.startswith("http")},
               "dead_letters": dict(collections.Counter(d.original_subject.split(".", 2)[-1] for d in letters)),
               "steps_trained": run.steps(), "steps_after_the_fuzz": run.steps() - before,
               "rejected_on_ledger": rejected,
               **{k: report[k] for k in ("released_prompts", "trained", "rejected", "lost", "trained_twice")}}  # fmt: skip
    print(json.dumps(summary, indent=2))
    if os.environ.get("ASYNCRL_FUZZ_REPORT"):
        Path(os.environ["ASYNCRL_FUZZ_REPORT"]).write_text(json.dumps(summary, indent=2))


async def _dead_letters_and_rejections(run) -> tuple[list[DeadLetter], int]:
    from asyncrl_proto import decode
    from services.audit import admin_credentials
    from services.buffer.state import LedgerError, ledger_events
    from services.common.bus import Bus as _Bus
    from services.common.natsauth import server_auth_conf
    from services.common.natsserver import EmbeddedNats
    from services.common.secrets import load_roles_file

    passwords = {r: e["password"] for r, e in load_roles_file(run.dir / "secrets" / "nats.json").items()}
    with EmbeddedNats(run.dir / "nats", auth_conf=server_auth_conf(run.config["run_id"], passwords)) as srv:
        bus = await _Bus.connect(srv.url, run.config["run_id"], "fuzz", creds=admin_credentials(run.dir))
        try:
            s = bus.subjects
            letters = [decode(d, DeadLetter) for d in await bus.read_stream(s.deadletter_stream, s.deadletter(">"))]
            rejected = 0
            for d in await bus.read_stream(s.ledger_stream, s.ledger):
                try:
                    rejected += sum(e.kind == "put" and e.outcome == "rejected" for e in ledger_events(d))
                except LedgerError:
                    continue
        finally:
            await bus.close()
    return letters, rejected
