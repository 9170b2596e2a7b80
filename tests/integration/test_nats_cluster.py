"""A run on a 3-node JetStream cluster (--nats-cluster 3, every stream and bucket with 3
replicas) survives the loss of a node: one SIGKILLed mid-run, or every node restarted in turn
(a rolling restart). The launcher brings each node back on its own store; the run finishes and
its ledger balances, nothing lost and nothing trained twice."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common import procs
from services.common.natsauth import COMPOSE_ROUTES, routes_conf, write_deploy_secrets
from services.common.natsserver import nats_server_binary
from services.common.procs import pid_alive
from tests.runs import audited, finish, stopped_at_exit

ROOT = Path(__file__).resolve().parents[2]

STEPS, B = 24, 4
SEED = int(os.environ.get("ASYNCRL_KILL_SEED", random.SystemRandom().randrange(10**6)))


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def start_run(run_dir: Path, steps: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "train-async", "--fully-async", "--rollout-batch-size", str(B),
         "--n-samples-per-prompt", "4", "--async-data-buffer-capacity-factor", "1", "--num-rollout", str(steps),
         "--prompt-ack-wait-s", "3", "--async-unused-samples-handler", "retry", "--max-weight-staleness", "3",
         "--nats-cluster", "3", "--run-dir", str(run_dir)],
        cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def wait_for(proc: subprocess.Popen, what: str, cond, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def healthz_ok(monitor: str) -> bool:
    """A node's monitoring /healthz: 200 once its JetStream is current (it is in the cluster)."""
    try:
        return httpx.get(monitor + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def pids(run_dir: Path) -> dict:
    return json.loads((run_dir / "pids.json").read_text())


def assert_balanced(run_dir: Path, steps: int) -> None:
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(range(steps))
    audited(run_dir, steps * B)


@pytest.mark.cluster  # make test-cluster (with the rolling restart, about 2 minutes); .ci/run runs it
def test_a_node_killed_mid_run_loses_nothing(tmp_path):
    rng = random.Random(f"{SEED}-nats-cluster")
    victim, kill_after = f"nats-server-{rng.randrange(3)}", rng.randint(2, STEPS // 2)
    print(f"ASYNCRL_KILL_SEED={SEED}: killing {victim} after step {kill_after}")
    run_dir = tmp_path / "run"
    with stopped_at_exit(start_run(run_dir, STEPS)) as proc:
        wait_for(proc, f"step {kill_after}", lambda: steps_done(run_dir) >= kill_after)
        pid = pids(run_dir)[victim]
        os.kill(pid, signal.SIGKILL)
        out = finish(proc)
    assert f"{victim} exited" in out and not pid_alive(pid)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["nats_url"].count(",") == 2 and config["nats_cluster"] == 3
    assert_balanced(run_dir, STEPS)


@pytest.mark.cluster
def test_a_rolling_restart_of_every_node_loses_nothing(tmp_path):
    """Each node in turn is stopped (SIGTERM, as an operator's rolling restart does), brought
    back by the launcher and waited for until its JetStream is current again, then the next."""
    steps = 40
    run_dir = tmp_path / "run"
    with stopped_at_exit(start_run(run_dir, steps)) as proc:
        wait_for(proc, "step 2", lambda: steps_done(run_dir) >= 2)
        nodes = json.loads((run_dir / "nats" / "nodes.json").read_text())
        assert len(nodes) == 3
        restarted_at = []
        for name, node in nodes.items():
            old = pids(run_dir)[name]
            os.kill(old, signal.SIGTERM)
            wait_for(proc, f"{name} to restart", lambda: pids(run_dir)[name] != old)  # noqa: B023
            wait_for(proc, f"{name}'s JetStream to be current", lambda: healthz_ok(node["monitor"]))  # noqa: B023
            restarted_at.append(steps_done(run_dir))
        assert restarted_at[-1] < steps, "the run ended before the last node came back: make it longer"
        out = finish(proc)
    assert all(f"{name} exited" in out for name in nodes)
    assert_balanced(run_dir, steps)


def test_the_shipped_cluster_config_forms_a_cluster_with_the_secrets_routes(tmp_path):
    """deploy/nats-cluster.conf (what compose and the StatefulSet run), three nodes on this host:
    each names itself from $NATS_SERVER_NAME, includes the routes.conf that `asyncrl secrets`
    writes (here with loopback ports for the compose names) and forms one JetStream cluster."""
    secrets_dir = tmp_path / "secrets"
    write_deploy_secrets("c1", secrets_dir)
    assert all(f"@{r}" in (secrets_dir / "routes.conf").read_text() for r in COMPOSE_ROUTES)
    password = (secrets_dir / "route-password").read_text().strip()
    route_ports = [procs.free_port() for _ in range(3)]
    nodes = []
    try:
        for i in range(3):
            etc = tmp_path / f"node-{i}"
            (etc / "auth").mkdir(parents=True)
            shipped = (ROOT / "deploy" / "nats-cluster.conf").read_text()
            assert shipped.count('"/data"') == 1  # the volume; here a directory of the node's own
            (etc / "nats-server.conf").write_text(shipped.replace('"/data"', f'"{etc / "data"}"'))
            (etc / "auth" / "auth.conf").write_text((secrets_dir / "auth.conf").read_text())
            (etc / "auth" / "routes.conf").write_text(routes_conf(password, [f"127.0.0.1:{p}" for p in route_ports]))
            port, monitor = procs.free_port(), procs.free_port()
            cmd = [nats_server_binary(), "-c", str(etc / "nats-server.conf"), "-a", "127.0.0.1", "-p", str(port),
                   "-m", str(monitor), "--cluster", f"nats://127.0.0.1:{route_ports[i]}"]  # fmt: skip
            env = {**os.environ, "NATS_SERVER_NAME": f"nats-{i}"}
            nodes.append((procs.spawn(cmd, log_path=etc / "log", env=env), monitor))
        deadline = time.monotonic() + 60
        for proc, monitor in nodes:
            while True:
                assert proc.poll() is None, "a node exited"
                assert time.monotonic() < deadline, "the cluster did not form"
                if healthz_ok(f"http://127.0.0.1:{monitor}"):
                    break
                time.sleep(0.1)
        routez = httpx.get(f"http://127.0.0.1:{nodes[0][1]}/routez", timeout=5).json()
        assert {r["remote_name"] for r in routez["routes"]} == {"nats-1", "nats-2"}
        jsz = httpx.get(f"http://127.0.0.1:{nodes[0][1]}/jsz", timeout=5).json()
        assert jsz["meta_cluster"]["cluster_size"] == 3
    finally:
        for proc, _ in nodes:
            procs.stop(proc)


async def test_replicas_a_server_cannot_give_are_a_clear_error_at_once(nats_server, run_id):
    """--nats-replicas 3 against one server (not a cluster): the refusal is final and says why,
    not two minutes of retries."""
    from services.common.bus import Bus, StreamSetupError

    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        t0 = time.monotonic()
        with pytest.raises(StreamSetupError, match="replicas > 1 not supported"):
            await bus.ensure_streams(3)
        assert time.monotonic() - t0 < 10
    finally:
        await bus.close()
