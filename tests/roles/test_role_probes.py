"""Every role's worst case, tried with its own credentials on one live default-job run (make
test-roles): what each role may do to a run that is not its own to decide, and that the run
finishes every step, balanced, through all of it (docs/trust.md, "Worst case per role").

- rollout: writes outside its subjects are refused; 1,024 ghost producers add no prompts in
  flight; a flood of junk groups fills the input stream and is rejected, not trained;
- eval: pause tokens that name no eval point are refused, and every pause together holds
  production for at most its budget (here 5 s in any 100 s window);
- weight-sync: every weight announcement taken for a window, and a claim of a version nobody
  published (directly, or through `loading-<N>`), leave no honest group rejected and the engine
  on the newest version;
- eval and trainer: a forged eval result for a point nobody asked for is neither printed nor
  taken as the held-out figure;
- buffer, adapters, engine: writes outside their subjects are refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
from pathlib import Path

import pytest

from asyncrl_proto import ControlMsg, EvalResult, Heartbeat, encode
from services.common.bus import Bus
from services.common.httpauth import role_token
from services.common.secrets import NatsCredentials, load_roles_file
from tests.crash.test_weight_messages_lost import steal_weights
from tests.e2e.test_cli_run import records, start_run

pytestmark = pytest.mark.roles

STEPS = 160
BUDGET_S, WINDOW_S = 5.0, 100.0
SPAM_S = 12.0
FORGED_HELDOUT = 0.998


class Live:
    """The running job as a role sees it: its config, services, secrets and a Bus per role."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.config = json.loads((run_dir / "config.json").read_text())
        self.services = json.loads((run_dir / "services.json").read_text())
        self.roles = load_roles_file(run_dir / "secrets" / "nats.json")
        self.run_token = (run_dir / "secrets" / "run-token").read_text().strip()

    async def bus(self, role: str) -> Bus:
        service = {"rollout": "rollout", "eval": "eval", "weight-sync": "weight-sync", "trainer": "trainer",
                   "buffer": "buffer", "adapters": "adapters", "engine": "engine"}[role]  # fmt: skip
        return await Bus.connect(self.config["nats_url"], self.config["run_id"], service,
                                 creds=NatsCredentials(**self.roles[role]))  # fmt: skip

    def http(self, url: str, token: str, body: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def status(self, service: str) -> dict:
        return self.http(f"{self.services[service]}/status", self.run_token)[1]

    def step(self) -> int:
        return len(records(self.run_dir)) if (self.run_dir / "metrics.jsonl").exists() else 0


async def refused_writes(live: Live, role: str, subjects: list[str], caplog) -> None:
    """Each subject, published with `role`'s identity, is refused by the server."""
    bus = await live.bus(role)
    try:
        for subject in subjects:
            await bus.nc.publish(subject, b"forged")
        await bus.nc.flush()
        for subject in subjects:
            for _ in range(50):  # the refusals come back in order; poll the log for each
                if f'permissions violation for publish to "{subject}"' in caplog.text:
                    break
                await bus.nc.flush()
            else:
                raise AssertionError(f"{role} published to {subject} unrefused")
    finally:
        await bus.close()


async def ghost_producers(live: Live, seconds: float) -> tuple[int, int, int]:
    """1,024 heartbeats under new producer ids for `seconds`, half claiming the largest in-flight
    cap a producer may have, half one past any cap: the buffer's in-flight cap (the sum over
    producers that answered a prompt) before and at its highest during, and the most prompts in
    flight during."""
    bus = await live.bus("rollout")
    before = live.status("buffer")["inflight_cap"]
    cap, during, outstanding = live.config["rollout_batch_size"], before, 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for i in range(1024):
                hb = Heartbeat(service="rollout", instance_id=f"ghost-{i}", ts=time.time(),
                               info={"inflight_groups": cap if i % 2 else 4096, "in_work": []})  # fmt: skip
                await bus.nc.publish(bus.subjects.heartbeat("rollout"), encode(hb))
            await bus.nc.flush()
            status = live.status("buffer")
            during, outstanding = max(during, status["inflight_cap"]), max(outstanding, status["outstanding_prompts"])
    finally:
        await bus.close()
    return before, during, outstanding


async def junk_flood(live: Live, n: int) -> int:
    """`n` undecodable groups into the buffer's input stream, acknowledged: how many it stored
    (the rest met a full stream)."""
    bus = await live.bus("rollout")
    stored = 0
    try:
        for i in range(n):
            try:
                await asyncio.wait_for(bus.js.publish(bus.subjects.rollouts, b"junk %d" % i), 5.0)
                stored += 1
            except Exception:  # noqa: BLE001 - a full stream refuses the rest
                break
    finally:
        await bus.close()
    return stored


async def pause_spam(live: Live, seconds: float) -> float:
    """Pause tokens for every step (eval points among them), sent as the eval service renews its
    own, for `seconds`: the share of the producer's status samples that said paused."""
    bus = await live.bus("eval")
    paused, samples = 0, 0
    try:
        end, i = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            for _ in range(20):
                i = i % STEPS + 1
                ctl = ControlMsg(command="pause_submission", token=f"eval-{i}", issued_at=time.time())
                await bus.nc.publish(bus.subjects.control, encode(ctl))
            await bus.nc.flush()
            samples += 1
            paused += bool(live.status("rollout-0").get("submission_paused"))
    finally:
        await bus.close()
    return paused / max(samples, 1)


def claim_versions(live: Live) -> list[int]:
    """Weight-sync's HTTP key claims versions nobody published: the engine's answers."""
    url, token = live.services["engine-0"], role_token(live.run_token, "weight-sync")
    codes = []
    for name in ("999", "loading-999", "999"):
        codes.append(
            live.http(f"{url}/update_weight_version", token, {"new_version": name, "abort_all_requests": False})[0]
        )
    return codes


async def forged_eval(live: Live) -> None:
    bus = await live.bus("eval")
    try:
        res = EvalResult(
            step=STEPS - 10, version=STEPS - 10, metrics={"eval/reverse-digits": FORGED_HELDOUT, "eval/step": 1500}
        )
        await bus.nc.publish(bus.subjects.eval_results, encode(res))
        await bus.nc.flush()
    finally:
        await bus.close()


async def probe(live: Live, caplog) -> dict:
    s = (await live.bus("rollout")).subjects  # names only; closed below
    found: dict = {}
    await refused_writes(live, "rollout", [s.ledger, s.weights_published, s.weights_live, s.progress, s.prompts,
                                           s.eval_results, s.heartbeat("trainer")], caplog)  # fmt: skip
    await refused_writes(live, "buffer", [s.weights_published, s.progress, s.eval_results], caplog)
    await refused_writes(live, "adapters", [s.prompts, s.ledger, s.weights_published], caplog)
    await refused_writes(live, "engine", [s.prompts, s.rollouts, s.heartbeat("engine")], caplog)
    await refused_writes(live, "eval", [s.ledger, s.weights_live, s.prompts], caplog)
    found["ghosts"] = await ghost_producers(live, 4.0)
    found["paused_share"] = await pause_spam(live, SPAM_S)
    found["claims"] = claim_versions(live)
    found["taken"] = await steal_weights(live.run_dir, 6.0)
    await forged_eval(live)
    found["junk_stored"] = await junk_flood(live, 2000)
    return found


def test_each_roles_worst_case_leaves_the_run_whole(tmp_path, caplog):
    run_dir = tmp_path / "run"
    proc = start_run(tmp_path, "--num-rollout", str(STEPS), "--max-weight-staleness", "1", "--eval-interval", "40",
                     "--submission-pause-budget", str(BUDGET_S / WINDOW_S), "--submission-pause-window-s", str(WINDOW_S),
                     "--run-dir", str(run_dir))  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not ((run_dir / "metrics.jsonl").exists() and len(records(run_dir)) >= 5):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach step 5"
            time.sleep(0.2)
        live = Live(run_dir)
        with caplog.at_level(logging.WARNING, logger="services.common.bus"):
            found = asyncio.run(probe(live, caplog))
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    print(f"probes: {found}; ledger {result['ledger']}")  # what each role did, for the record (pytest -s)
    before, during, outstanding = found["ghosts"]
    assert during == before, f"ghost producers raised the buffer's in-flight cap from {before} to {during}"
    honest = live.config["rollout_batch_size"] * (1 + live.config["async_data_buffer_capacity_factor"])
    assert outstanding <= honest, f"{outstanding} prompts in flight under ghosts, over the honest {honest}"
    paused_s = found["paused_share"] * SPAM_S  # the budget, and one status poll's lag either side
    assert paused_s <= BUDGET_S + 3.0, f"pauses held production {paused_s:.1f} s of a {SPAM_S:.0f} s spam"
    assert found["claims"] == [400, 200, 400], found["claims"]  # loading-<N> alone names no weights
    assert found["taken"] > 0, "the theft took no announcement: it tested nothing"
    assert str(FORGED_HELDOUT) not in out and "eval/step 1500" not in out
    assert result["heldout_reward_final"] != FORGED_HELDOUT
    assert result["steps"] == STEPS and result["final_weight_version"] == STEPS and result["ledger_balanced"], result
    # the junk has no identity (dead-lettered, not on the ledger): no group was refused, so none
    # of the honest ones for the version its engine claimed
    assert found["junk_stored"] > 0 and result["ledger"]["rejected"] == 0, (result["ledger"], found)
