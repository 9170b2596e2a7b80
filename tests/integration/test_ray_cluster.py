"""--use-ray over a real Ray cluster of two nodes on this machine: a head on 127.0.0.2 and a node
on 127.0.0.3 with a resource of its own, each with its own temp dir and free ports, the dashboard
and usage stats off. A short fully-async run places the trainer's ranks on one node and the
engine and producer on the other (each side's bundle fills a node's CPUs), the trainer's ranks
rendezvous on their node's address, weights go through the run's object bucket, the run
finishes and its ledger balances. Every Ray node is started as a child (`ray start --block`) and
stopped by its PID, which stops what it started. Supervision works through the placement: the
engine's process on its node is SIGKILLed mid-run and the launcher restarts it there."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from services.common import procs
from tests.runs import audited, finish, stopped_at_exit

pytest.importorskip("ray")

RAY = str(Path(sys.executable).parent / "ray")
HEAD, NODE_B = "127.0.0.2", "127.0.0.3"
STEPS, B = 8, 4
NODE_START_TIMEOUT_S = 90.0


TOKEN = secrets.token_hex(32)


def ray_env() -> dict[str, str]:
    """The nodes' and the run's environment: Ray's token authentication with a token of this test's
    own (never ~/.ray/auth_token), usage stats off, no idle workers started ahead."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    return env | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN, "RAY_USAGE_STATS_ENABLED": "0",
                  "RAY_prestart_worker_first_driver": "false"}  # fmt: skip


def ray_port(ip: str) -> int:
    """A free port outside Ray's default worker port range (10002-19999)."""
    port = procs.free_port(ip)
    while 10002 <= port <= 19999:
        port = procs.free_port(ip)
    return port


def node_ports(ip: str) -> list[str]:
    """The ports a node would otherwise take at a fixed default (another Ray on this machine may hold them)."""
    return ["--dashboard-agent-listen-port", str(ray_port(ip))]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def engine_pid(run_dir: Path) -> int | None:
    """The engine's own process (the Ray host's child), not the launcher's local attachment."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[1:3] == [b"-m", b"services.engine"] and str(run_dir).encode() in b" ".join(argv):
                return int(proc.name)
    return None


def wait_for(proc: subprocess.Popen, what: str, cond, timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while not (found := cond()):
        assert proc.poll() is None, f"the run ended before {what}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return found


@contextlib.contextmanager
def ray_node(args: list[str], log: Path):
    """`ray start --block ...` as our child until the block ends; it stops its processes on SIGTERM."""
    proc = procs.spawn([RAY, "start", "--block", "--disable-usage-stats", *args], log_path=log, env=ray_env())
    try:
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while "Ray runtime started" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"ray start exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the Ray node did not start in {NODE_START_TIMEOUT_S:.0f}s: {log}"
            time.sleep(0.2)
        yield proc
    finally:
        procs.stop(proc, timeout_s=60)


@pytest.mark.ray  # make test-ray (about 2-4 minutes a mode on 2 cores); .ci/run runs it
@pytest.mark.parametrize("mode", ["object-store", "distributed"])
def test_a_run_placed_over_two_ray_nodes(tmp_path, mode):
    """object-store: engines fetch every version from the run's bucket. distributed: the trainer
    broadcasts it from its node, rank 0 of a group it opens on its node's address."""
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # Ray's socket paths must stay short
    port = ray_port(HEAD)
    try:
        head = ["--head", "--node-ip-address", HEAD, "--port", str(port), "--num-cpus", "2", "--include-dashboard=false",
                "--dashboard-port", str(ray_port(HEAD)), "--ray-client-server-port", str(ray_port(HEAD)),
                "--temp-dir", str(temp / "head"), *node_ports(HEAD)]  # fmt: skip
        node_b = ["--address", f"{HEAD}:{port}", "--node-ip-address", NODE_B, "--num-cpus", "2",
                  "--resources", '{"node_b": 2}', "--temp-dir", str(temp / "b"), *node_ports(NODE_B)]  # fmt: skip
        with ray_node(head, tmp_path / "ray-head.log"), ray_node(node_b, tmp_path / "ray-b.log"):
            run_dir = tmp_path / "run"
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "train-async", "--fully-async", "--rollout-batch-size", str(B),
                 "--n-samples-per-prompt", "4", "--async-data-buffer-capacity-factor", "1", "--num-rollout", str(STEPS),
                 "--trainer-num-ranks", "2", "--use-ray", "--update-weight-transfer-mode", mode,
                 "--run-dir", str(run_dir)],
                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=ray_env() | {"RAY_ADDRESS": f"{HEAD}:{port}"},
            )  # fmt: skip
            with stopped_at_exit(proc):
                wait_for(proc, "step 2", lambda: steps_done(run_dir) >= 2)
                pid = wait_for(proc, "the engine's process", lambda: engine_pid(run_dir))
                os.kill(pid, signal.SIGKILL)
                out = finish(proc, timeout_s=300)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert "engine-0 (pid" in out and "exited with code" in out, out[-3000:]  # restarted through its host
    placed = json.loads((run_dir / "ray.json").read_text())
    children = placed["children"]
    assert set(children) == {"engine-0", "rollout-0", "trainer"}, children
    trainer_ip, engine_ip = children["trainer"]["node_ip"], children["engine-0"]["node_ip"]
    assert {trainer_ip, engine_ip} == {HEAD, NODE_B}, children  # the two sides on the two nodes
    assert children["rollout-0"]["node_ip"] == engine_ip
    config = json.loads((run_dir / "config.json").read_text())
    assert config["update_weight_transfer_mode"] == mode
    if mode == "distributed":  # the engine on the other node received from the trainer's node address
        assert f"formed: trainer {trainer_ip}:" in (run_dir / "logs" / "weight-sync.log").read_text()
    assert config["rollout_engine_urls"] == [children["engine-0"]["url"]]
    assert children["engine-0"]["url"].startswith(f"http://{engine_ip}:")
    ranks = json.loads((run_dir / "trainer-ranks.json").read_text())
    assert ranks["master_addr"] == trainer_ip != "127.0.0.1"
    assert ranks["rank_nodes"] == [trainer_ip, trainer_ip] and ranks["ray_actors"] == 1
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS)) and all(r["train/dp_world_size"] == 2 for r in records)
    audited(run_dir, STEPS * B)


@pytest.mark.ray
def test_a_ray_rank_that_fails_before_the_group_forms_fails_rank_0_at_once(tmp_path):
    """A data-parallel rank as a Ray actor (a local Ray) fails at start (its config does not
    parse): rank 0 says so with the actor's error within seconds, not after the 300 s
    rendezvous timeout. In a child process, whose rendezvous thread may stay blocked."""
    from tests.unit.test_data_parallel import rank_dies_script

    script = rank_dies_script(tmp_path, "use_ray=True")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env,
                         cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert "ERROR: trainer rank 1 (a Ray actor) ended before the data-parallel group formed: it failed" in out.stdout, (
        out.stdout[-2000:] + out.stderr[-3000:]
    )
    assert "JSONDecodeError" in out.stdout or "Expecting value" in out.stdout  # the actor's own error
    assert time.monotonic() - t0 < 150
