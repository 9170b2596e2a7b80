"""The adapter registry service (`asyncrl service adapters`) against a real nats-server with one
identity per role: registration over HTTP with the run token, the trainer's transitions over
`adapters.control`, the state in KV `adapters` resumed by a restarted registry, start adapters
registered once across starts, and two registries that never both win a write."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import httpx
import pytest

from asyncrl_proto import AdapterControl, AdapterControlReply, AdapterRegistryState, decode
from asyncrl_proto.subjects import ADAPTERS_KV_KEY
from services.adapters.service import AdapterService
from services.cli import check_argv
from services.common.bus import SequenceConflict
from services.common.config import RunConfig
from services.common.procs import free_port
from services.common.secrets import ROLES_FILE_ENV, RUN_TOKEN_ENV, write_roles_file
from tests.conftest import AUTH, TEST_TOKEN, RunningService, connect_role, wait_until, with_test_token


@pytest.fixture(scope="module")
def server(role_server):
    return role_server


@pytest.fixture
def files(tmp_path):
    """A prompt file and the YAML spec of the adapter `boot` (given with --multi-lora-adapter)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "12=", "label": "21"}\n')
    (tmp_path / "boot.yaml").write_text(
        f"data: {data}\nrank: 4\nalpha: 8\nrollout_batch_size: 2\nn_samples_per_prompt: 2\n"
        f"save: {tmp_path / 'save' / 'boot'}\nrm_type: reverse-digits\nnum_step: 3\nmetadata: {{tenant: t0}}\n"
    )
    return tmp_path


def body(files, name: str, **kw) -> dict:
    spec = dict(data=str(files / "prompts.jsonl"), rank=8, alpha=16.0, rollout_batch_size=2, n_samples_per_prompt=2,
                save=str(files / "save" / name), rm_type="reverse-digits", num_step=2)  # fmt: skip
    return {"name": name, **spec, **kw}


def config(files, slots: int = 2) -> RunConfig:
    return RunConfig(n_samples_per_prompt=2, multi_lora_n_adapters=slots, multi_lora_adapter=["boot", str(files / "boot.yaml")])


async def fresh_run(server):
    """The run's streams and KV bucket (the launcher's part), with no registry state in it."""
    admin = await connect_role(server, "admin")
    await admin.ensure_streams(partitioned=True)
    kv = await admin.kv()
    await kv.purge(ADAPTERS_KV_KEY)
    return admin


async def start(server, cfg: RunConfig) -> RunningService:
    bus = await connect_role(server, "adapters")
    service = with_test_token(AdapterService, cfg, bus)
    task = asyncio.ensure_future(service.run())
    await wait_until(lambda: service.ready or task.done(), 20, "the registry ready")
    if task.done():
        task.result()
    return RunningService(service, task)


async def stored(admin) -> AdapterRegistryState:
    return decode(await admin.kv_get(ADAPTERS_KV_KEY), AdapterRegistryState)


async def test_register_over_http_and_drive_the_lifecycle_over_nats(server, files):
    admin = await fresh_run(server)
    trainer = await connect_role(server, "trainer")
    rollout = await connect_role(server, "rollout")
    reg = await start(server, config(files))
    url = reg.service.http_url

    async def control(op: str, name: str, **kw) -> AdapterControlReply:
        req = AdapterControl(op=op, name=name, **kw)
        return await trainer.request(trainer.subjects.adapters_control, req, AdapterControlReply, timeout=5)

    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as anon:
            for method, path in (("GET", "/adapter_runs"), ("GET", "/adapter_runs/state"), ("GET", "/health"),
                                 ("POST", "/adapter_runs"), ("DELETE", "/adapter_runs/boot")):  # fmt: skip
                assert (await anon.request(method, path)).status_code == 401, path
            assert (await anon.get("/readyz")).status_code == 200  # the probes stay open
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=10) as http:
            assert (await http.get("/health")).json()["ok"] is True
            boot = (await http.get("/adapter_runs/boot")).json()  # registered at start
            assert (boot["state"], boot["slot"], boot["spec"]["metadata"]) == ("pending", 0, {"tenant": "t0"})
            nested = {"name": "t1", "spec": {k: v for k, v in body(files, "t1").items() if k != "name"}}
            r = await http.post("/adapter_runs", json=nested)
            assert r.status_code == 201, r.text
            t1 = r.json()
            assert (t1["state"], t1["slot"]) == ("pending", 1)
            assert t1["spec"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
            r = await http.post("/adapter_runs", json=body(files, "t2"))
            assert r.status_code == 409 and "No free adapter slots" in r.json()["error"]["message"]
            r = await http.post("/adapter_runs", json=body(files, "t1", save=str(files / "x")))
            assert r.status_code == 409 and "already registered" in r.json()["error"]["message"]
            r = await http.post("/adapter_runs", json=body(files, "bad/name"))
            assert r.status_code == 400 and "is invalid" in r.json()["error"]["message"]
            r = await http.post("/adapter_runs", json=body(files, "t3", lr=1))
            assert r.status_code == 400 and "unknown field(s) in the adapter spec: lr" in r.json()["error"]["message"]
            r = await http.post("/adapter_runs", json=body(files, "t3", data=str(files / "missing.jsonl")))
            assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
            r = await http.post("/adapter_runs", json=body(files, "t3", n_samples_per_prompt=3))
            assert r.status_code == 400 and "above the run's --n-samples-per-prompt 2" in r.json()["error"]["message"]
            r = await http.post("/adapter_runs", json=body(files, "t3", rank=64))
            assert r.status_code == 400 and "above the engines' --multi-lora-max-rank 16" in r.json()["error"]["message"]
            r = await http.post("/adapter_runs", json=body(files, "t3", rm_type=None, custom_rm_path="os.system"))
            assert r.status_code == 400 and "not one the run allows over HTTP" in r.json()["error"]["message"]
            assert (await http.post("/adapter_runs", content=b"not json")).status_code == 400
            assert (await http.get("/adapter_runs/nobody")).status_code == 404
            assert (await http.delete("/adapter_runs/nobody")).status_code == 404
            listed = (await http.get("/adapter_runs")).json()
            assert [x["name"] for x in listed["runs"]] == ["boot", "t1"]

            # the trainer: boot trains two steps and is retired by its budget; t1 is deleted while pending
            assert (await control("activate", "boot", registration_id=boot["registration_id"])).ok
            assert (await control("stepped", "boot", step=1)).run.slot_version == 1
            reply = await control("stepped", "boot", step=2)
            assert reply.ok and reply.run.step == 2
            refused = await control("cleanup", "boot")
            assert not refused.ok and "cannot start the cleanup of adapter 'boot' in state active" in refused.error
            refused = await control("activate", "t1", registration_id="0" * 32)
            assert not refused.ok and "is not its current one" in refused.error
            r = await http.delete("/adapter_runs/t1")
            assert r.status_code == 200 and r.json()["state"] == "cleanup"
            r = await http.delete("/adapter_runs/t1")
            assert r.status_code == 409 and "not live" in r.json()["error"]["message"]
            assert (await control("complete", "t1")).run.state.value == "completed"
            assert (await http.delete("/adapter_runs/boot")).json()["state"] == "retiring"
            assert (await control("cleanup", "boot")).run.state.value == "cleanup"
            assert (await control("complete", "boot")).run.state.value == "completed"

            state = (await http.get("/adapter_runs/state")).json()
            assert state["slot_versions"] == [2, 0]
            assert [(x["name"], x["state"]) for x in state["runs"]] == [("boot", "completed"), ("t1", "completed")]
            assert (await stored(admin)).revision == state["revision"] == reg.service.adapters.revision
            metrics = (await http.get("/metrics")).text
            assert "asyncrl_multi_lora_adapters_completed{" in metrics and "asyncrl_multi_lora_free_slots{" in metrics

            # a name that completed registers again, in the lowest slot, which keeps its version
            again = (await http.post("/adapter_runs", json=body(files, "boot"))).json()
            assert (again["slot"], again["slot_version"], again["step"]) == (0, 2, 0)
            assert again["registration_id"] != boot["registration_id"]
        # only the trainer may ask the registry
        with pytest.raises(Exception):  # noqa: B017 - refused: no answer within the timeout
            await rollout.request(rollout.subjects.adapters_control, AdapterControl(op="retire", name="boot"),
                                  AdapterControlReply, timeout=1.0)  # fmt: skip
        assert reg.service.adapters.get("boot").state.value == "pending"
    finally:
        await reg.stop()
        for bus in (trainer, rollout, admin):
            await bus.close()


async def test_a_restarted_registry_resumes_and_registers_start_adapters_once(server, files):
    admin = await fresh_run(server)
    reg = await start(server, config(files))
    async with httpx.AsyncClient(base_url=reg.service.http_url, headers=AUTH, timeout=10) as http:
        assert (await http.post("/adapter_runs", json=body(files, "t1"))).status_code == 201
    reg.service.adapters.get("boot")  # registered at start
    await reg.stop()
    before = await stored(admin)

    again = await start(server, config(files))  # same flags: boot is live in KV, not registered twice
    try:
        assert again.service.adapters.state == before
        assert [r.name for r in again.service.adapters.state.runs] == ["boot", "t1"]
        async with httpx.AsyncClient(base_url=again.service.http_url, headers=AUTH, timeout=10) as http:
            assert (await http.get("/adapter_runs/t1")).json()["state"] == "pending"
            assert (await http.delete("/adapter_runs/boot")).json()["state"] == "cleanup"
        await again.service.control(AdapterControl(op="complete", name="boot"))
    finally:
        await again.stop()
    third = await start(server, config(files))  # boot completed: still not registered again
    try:
        runs = [(r.name, r.state.value) for r in third.service.adapters.state.runs]
        assert runs == [("boot", "completed"), ("t1", "pending")]
        assert (await stored(admin)).revision == third.service.adapters.revision
    finally:
        await third.stop()
        await admin.close()


async def test_a_start_adapter_without_a_free_slot_waits_for_one(server, files):
    admin = await fresh_run(server)
    first = await start(server, RunConfig(n_samples_per_prompt=2, multi_lora_n_adapters=1))
    async with httpx.AsyncClient(base_url=first.service.http_url, headers=AUTH, timeout=10) as http:
        assert (await http.post("/adapter_runs", json=body(files, "t1"))).status_code == 201
    await first.stop()
    reg = await start(server, config(files, slots=1))
    try:
        assert reg.service.waiting and reg.service.adapters.current("boot") is None
        await reg.service.control(AdapterControl(op="retire", name="t1"))
        await reg.service.control(AdapterControl(op="complete", name="t1"))
        await wait_until(lambda: reg.service.adapters.current("boot") is not None, 5, "boot registered")
        assert reg.service.adapters.get("boot").slot == 0 and not reg.service.waiting
    finally:
        await reg.stop()
        await admin.close()


async def test_two_registries_never_both_win_a_write(server, files):
    admin = await fresh_run(server)
    a = await start(server, RunConfig(n_samples_per_prompt=2, multi_lora_n_adapters=3))
    b = await start(server, RunConfig(n_samples_per_prompt=2, multi_lora_n_adapters=3))  # a restart racing a frozen one
    try:
        async with httpx.AsyncClient(headers=AUTH, timeout=10) as http:
            r1 = await http.post(a.service.http_url + "/adapter_runs", json=body(files, "x"))
            r2 = await http.post(b.service.http_url + "/adapter_runs", json=body(files, "y"))  # b's view is stale
            assert (r1.status_code, r2.status_code) == (201, 201)
            assert (r1.json()["slot"], r2.json()["slot"]) == (0, 1)  # b read again and decided again
            r3 = await http.post(a.service.http_url + "/adapter_runs", json=body(files, "y", save=str(files / "z")))
            assert r3.status_code == 409 and "already registered" in r3.json()["error"]["message"]
        assert b.service.num_conflicts == 1 and a.service.num_conflicts == 1
        assert [r.name for r in (await stored(admin)).runs] == ["x", "y"]
        raw, revision = await a.service.bus.kv_entry(ADAPTERS_KV_KEY)  # the registry's compare-and-set write
        await a.service.bus.kv_update(ADAPTERS_KV_KEY, raw, revision)
        with pytest.raises(SequenceConflict):
            await a.service.bus.kv_update(ADAPTERS_KV_KEY, raw, revision)  # the revision it read is gone
    finally:
        await a.stop()
        await b.stop()
        await admin.close()


async def run_registry_process(url: str, run_id: str, cfg, env: dict) -> list[tuple[str, str]]:
    """Start `python -m services.adapters` (as the launcher does), read its adapters once it is
    ready, SIGTERM it; it must exit 0."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.adapters", "--nats-url", url,
                                                "--run-id", run_id, "--http-port", str(port), "--config-file",
                                                str(cfg), env=env)  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=5) as http:

            async def ready() -> bool:
                assert proc.returncode is None, f"the registry exited with {proc.returncode}"
                try:
                    return (await http.get("/readyz")).status_code == 200
                except httpx.HTTPError:
                    return False

            await wait_until(ready, 20, "the registry process ready")
            runs = [(r["name"], r["state"]) for r in (await http.get("/adapter_runs")).json()["runs"]]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        return runs
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_the_service_runs_as_asyncrl_service_adapters(server, files):
    """As the launcher starts it: its own process, its identity and the run token from the
    environment; a second start registers the start adapter no second time; SIGTERM exits 0."""
    check_argv(["service", "adapters", "--nats-url", "nats://127.0.0.1:4222", "--run-id", "r"])
    srv, run_id, pw = server
    admin = await fresh_run(server)
    cfg = files / "config.json"
    cfg.write_text(json.dumps(config(files).model_dump(mode="json")))
    env = {**os.environ, ROLES_FILE_ENV: str(write_roles_file(files / "nats.json", {"adapters": pw["adapters"]})),
           RUN_TOKEN_ENV: TEST_TOKEN}  # fmt: skip
    try:
        for _ in range(2):
            assert await run_registry_process(srv.url, run_id, cfg, env) == [("boot", "pending")]
        assert len((await stored(admin)).runs) == 1
    finally:
        await admin.close()
