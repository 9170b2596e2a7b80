"""The least-privilege bus against a real nats-server with one user per role: what a producer's
credentials cannot do, refused credentials and TLS failures as errors within seconds, and the
shipped deploy/nats-server.conf with the `asyncrl secrets` output enforcing the same model."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from services.common.bus import Bus, BusAuthError, fetch_some
from services.common.natsauth import ROLES, server_auth_conf
from services.common.natsserver import EmbeddedNats, nats_server_binary
from services.common.procs import free_port, wait_for_port
from services.common.secrets import NatsCredentials, load_roles_file, new_secret
from tests.conftest import wait_until
from tests.tls import make_certs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(role_server):
    return role_server


def creds(passwords, role) -> NatsCredentials:
    return NatsCredentials(user=role, password=passwords[role])


async def publish_marker(bus, subject: str, seen: list[str], tries: int = 5) -> None:
    """Publish an allowed marker until the watcher sees it. Core NATS delivers at most once, so one
    marker may be lost; any copy arrives after everything the connection published before it."""
    for _ in range(tries):
        await bus.nc.publish(subject, b"allowed")
        await bus.nc.flush()
        try:
            await wait_until(lambda: subject in seen, timeout=4.0, what=f"the marker on {subject}")
            return
        except TimeoutError:
            continue
    raise TimeoutError(f"{subject}: not one of {tries} markers arrived")


async def test_a_producer_cannot_write_the_ledger_weights_progress_commits_or_streams(server, caplog):
    srv, run_id, pw = server
    admin = await Bus.connect(srv.url, run_id, "launcher", creds=creds(pw, "admin"))
    prod = await Bus.connect(srv.url, run_id, "rollout", creds=creds(pw, "rollout"))
    s = admin.subjects
    try:
        await admin.ensure_streams()
        await admin.ensure_consumers(30.0)
        seen: list[str] = []

        async def watch(msg) -> None:
            seen.append(msg.subject)

        await admin.nc.subscribe(f"asyncrl.{run_id}.>", cb=watch)
        await admin.nc.flush()
        forged = [s.ledger, s.weights_published, s.weights_live, s.progress, s.buffer_commit, s.buffer_get,
                  s.eval_requests, s.eval_results, s.prompts, s.heartbeat("trainer")]  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="services.common.bus"):
            for subject in forged:
                await prod.nc.publish(subject, b"forged")
            await publish_marker(prod, s.heartbeat("rollout"), seen)  # after them, on the same connection
            for api in (f"$JS.API.STREAM.PURGE.{s.ledger_stream}", f"$JS.API.STREAM.DELETE.{s.ledger_stream}",
                        f"$JS.API.STREAM.CREATE.X_{run_id}", f"$JS.API.CONSUMER.DURABLE.CREATE.{s.ledger_stream}.x",
                        f"$JS.API.DIRECT.GET.{s.ledger_stream}", f"$JS.API.CONSUMER.CREATE.{s.prompts_stream}.producers",
                        f"$JS.API.CONSUMER.DELETE.{s.prompts_stream}.producers"):  # fmt: skip
                with pytest.raises(Exception):  # noqa: B017 - refused: no answer (timeout) or no responders
                    await prod.nc.request(api, b"{}", timeout=1.0)
        assert not set(forged) & set(seen), f"delivered despite the permissions: {set(forged) & set(seen)}"
        for stream in (s.ledger_stream, s.weights_stream, s.progress_stream, s.prompts_stream):
            assert (await admin.js.stream_info(stream)).state.messages == 0
        for subject in forged:
            assert f'permissions violation for publish to "{subject}"' in caplog.text, subject
        # what a producer must do still works: publish a group, read its prompts
        await prod.publish(s.rollouts, {"ok": 1})
        psub = await prod.consume(s.consumers(30.0)["producers"])
        assert await fetch_some(psub, 1, 0.3) == []  # allowed, and nothing released yet
        assert (await admin.js.stream_info(s.rollouts_stream)).state.messages == 1
        # and nobody but the buffer can take buffer.get requests off the wire
        with caplog.at_level(logging.WARNING, logger="services.common.bus"):
            await prod.nc.subscribe(s.buffer_get)
            await prod.nc.flush()
            await wait_until(lambda: "permissions violation for subscription" in caplog.text, what="refused")
    finally:
        await prod.close()
        await admin.close()


async def test_only_the_buffer_writes_its_snapshot_and_only_weight_sync_the_live_version(server):
    srv, run_id, pw = server
    admin = await Bus.connect(srv.url, run_id, "launcher", creds=creds(pw, "admin"))
    buf = await Bus.connect(srv.url, run_id, "buffer", creds=creds(pw, "buffer"))
    ws = await Bus.connect(srv.url, run_id, "weight-sync", creds=creds(pw, "weight-sync"))
    try:
        await admin.ensure_streams()
        await buf.kv_put("buffer_snapshot", b"state")
        await ws.kv_put("live_version", b"v")
        for bus, key in ((buf, "live_version"), (ws, "buffer_snapshot"), (ws, "config")):
            with pytest.raises(Exception):  # noqa: B017 - the put is never acknowledged
                await asyncio.wait_for(bus.kv_put(key, b"forged"), 2.0)
        assert await admin.kv_get("live_version") == b"v" and await admin.kv_get("buffer_snapshot") == b"state"
    finally:
        for b in (buf, ws, admin):
            await b.close()


async def test_refused_credentials_are_an_error_within_seconds(server):
    srv, run_id, pw = server
    t0 = time.monotonic()
    with pytest.raises(BusAuthError, match="refused the credentials of rollout .* Authorization Violation"):
        await Bus.connect(srv.url, run_id, "rollout", connect_timeout_s=60,
                          creds=NatsCredentials(user="rollout", password="wrong"))  # fmt: skip
    with pytest.raises(BusAuthError, match="Authorization Violation"):
        await Bus.connect(srv.url, run_id, "buffer", connect_timeout_s=60, creds=NatsCredentials())
    assert time.monotonic() - t0 < 10


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tlsnats")
    certs = make_certs(d / "certs")
    run_id = "s" + uuid.uuid4().hex[:10]
    passwords = {r: new_secret() for r in ROLES}
    srv = EmbeddedNats(d, auth_conf=server_auth_conf(run_id, passwords), tls=certs).start()
    yield srv, run_id, passwords, certs
    srv.stop()


async def test_tls_with_the_right_ca_connects_and_a_wrong_one_fails_fast(tls_server):
    srv, run_id, pw, certs = tls_server
    ok = await Bus.connect(srv.url, run_id, "trainer", creds=creds(pw, "trainer").with_tls(certs["ca"], None, None))
    await ok.nc.flush()
    await ok.close()
    t0 = time.monotonic()
    with pytest.raises(BusAuthError, match="TLS to NATS .* failed for trainer.*--nats-tls-ca"):
        await Bus.connect(srv.url, run_id, "trainer", connect_timeout_s=60, creds=creds(pw, "trainer"))
    with pytest.raises(BusAuthError, match="TLS|tls"):
        await Bus.connect(srv.url.replace("tls://", "nats://"), run_id, "trainer", connect_timeout_s=60,
                          creds=creds(pw, "trainer"))  # fmt: skip
    assert time.monotonic() - t0 < 10


@pytest.fixture
def deploy_server(tmp_path):
    """deploy/nats-server.conf as shipped (but its port and store), beside the auth/ directory
    that `asyncrl secrets` writes: what docker compose and the Kubernetes manifest run."""
    run_id = "compose"
    conf_dir = tmp_path / "etc"
    r = subprocess.run([sys.executable, "-m", "services.cli", "secrets", "--run-id", run_id, "--out",
                        str(conf_dir / "auth")], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert all((conf_dir / "auth" / f).stat().st_mode & 0o777 == 0o600 for f in ("nats.json", "auth.conf", "run-token"))
    port = free_port()
    text = (ROOT / "deploy" / "nats-server.conf").read_text()
    assert 'include "auth/auth.conf"' in text and "authorization" not in text.split("include")[0]
    text = text.replace("0.0.0.0:4222", f"127.0.0.1:{port}").replace('"/data"', f'"{tmp_path / "data"}"')
    (conf_dir / "nats-server.conf").write_text(text)
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf_dir / "nats-server.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for_port("127.0.0.1", port, 20, proc)
        yield f"nats://127.0.0.1:{port}", run_id, load_roles_file(conf_dir / "auth" / "nats.json")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_the_shipped_server_config_with_asyncrl_secrets_enforces_the_roles(deploy_server):
    url, run_id, roles = deploy_server
    admin = await Bus.connect(url, run_id, "init-run", creds=NatsCredentials(**roles["admin"]))
    prod = await Bus.connect(url, run_id, "rollout", creds=NatsCredentials(**roles["rollout"]))
    try:
        await admin.ensure_streams()
        with pytest.raises(Exception):  # noqa: B017
            await asyncio.wait_for(prod.js.publish(prod.subjects.ledger, b"forged"), 2.0)
        assert (await admin.js.stream_info(admin.subjects.ledger_stream)).state.messages == 0
    finally:
        await prod.close()
        await admin.close()
    with pytest.raises(BusAuthError):  # no anonymous access
        await Bus.connect(url, run_id, "rollout", creds=NatsCredentials(), connect_timeout_s=10)
