"""docker-compose.yml, run: the shipped file plus tests/docker/compose.loopback.yml (every container
on the host's network, each service on its own 127.0.0.1 port) brings a short job to its end with
`--scale rollout=3`; the trainer exits 0, `asyncrl audit` balances the run's ledger, and each of
the three producers published groups of what was trained.

The three producers are in before the first step: everything but the trainer is brought up,
the buffer is polled until it counts three producers' heartbeats, and then the trainer is brought
up (a run this short would otherwise finish before a slower producer's first group). Docker
refuses published ports on the host's network, so the ports are dropped from the merged file
(`compose config`); nothing else is changed. Everything started is torn down (`down -v`, and
dockerd by its PID when the test started it). `make test-docker`; skipped, saying why, when no
Docker daemon can start or no compose tool is installed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from services.common.procs import free_port
from tests.docker import harness

pytestmark = pytest.mark.docker

NUM_ROLLOUT = 10
NUM_PRODUCERS = 3
PROJECT_PREFIX = "asyncrl-docker-test-"
PROJECT = f"{PROJECT_PREFIX}{os.getpid()}"
OVERRIDE = harness.ROOT / "tests" / "docker" / "compose.loopback.yml"
BATCH = yaml.safe_load((harness.ROOT / "deploy" / "configs" / "quickstart.yaml").read_text())["rollout-batch-size"]


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The asyncrl image, with a Docker daemon that answers for the module's length."""
    daemon = harness.Daemon(tmp_path_factory.mktemp("dockerd"))
    try:
        daemon.start()
        compose = harness.compose_tool()
    except harness.Unavailable as e:
        daemon.stop()
        pytest.skip(f"docker compose run skipped: {e}")
    try:
        harness.remove_stale_projects(PROJECT_PREFIX)
        yield compose, harness.build_image()
    finally:
        daemon.stop()


class Compose:
    """One compose project on the merged file, its commands bounded in time."""

    def __init__(self, tool: list[str], file: Path, env: dict[str, str]):
        self.base = [*tool, "-p", PROJECT, "-f", str(file)]
        self.env = env

    def __call__(self, *args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.base, *args], capture_output=True, text=True, env=self.env, timeout=timeout_s)
        if check and r.returncode != 0:
            raise AssertionError(
                f"compose {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}\n{self.logs()}"
            )
        return r

    def logs(self, *services: str, tail_chars: int = 6000) -> str:
        r = subprocess.run([*self.base, "logs", "--no-color", *services], capture_output=True, text=True,
                           env=self.env, timeout=120)  # fmt: skip
        return r.stdout[-tail_chars:]

    @staticmethod
    def states() -> dict[str, tuple[str, int]]:
        """Every container of the project: name -> (status, exit code)."""
        label = f"label=com.docker.compose.project={PROJECT}"
        ids = harness.docker("ps", "-a", "-q", "--filter", label).stdout.split()
        if not ids:
            return {}
        out = harness.docker("inspect", "-f", "{{.Name}} {{.State.Status}} {{.State.ExitCode}}", *ids).stdout
        return {name.lstrip("/"): (status, int(code)) for name, status, code in (ln.split() for ln in out.splitlines())}


def loopback_file(tool: list[str], env: dict[str, str], out: Path) -> Path:
    """The shipped file merged with the loopback override by the compose tool itself, less the
    published ports (meaningless, and refused, on the host's network)."""
    files = ["-f", str(harness.ROOT / "docker-compose.yml"), "-f", str(OVERRIDE)]
    r = subprocess.run([*tool, "-p", PROJECT, *files, "config"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    spec = yaml.safe_load(r.stdout)
    for svc in spec["services"].values():
        assert svc.get("network_mode") == "host", svc
        svc.pop("ports", None)
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


def wait_for(pred, timeout_s: float, what: str, compose: Compose, interval_s: float = 1.0):
    """Poll `pred` until it returns something true; fail early when a container that should run
    has failed (its logs in the message)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if value := pred():
            return value
        failed = {n: s for n, s in compose.states().items() if s[0] == "exited" and s[1] != 0}
        assert not failed, f"containers failed while waiting for {what}: {failed}\n{compose.logs()}"
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s:.0f}s\n{compose.logs()}"
        time.sleep(interval_s)


def status(url: str, token: str) -> dict | None:
    try:
        r = httpx.get(f"{url}/status", headers={"Authorization": f"Bearer {token}"}, timeout=5)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def exited(compose: Compose, service: str) -> tuple[str, int] | None:
    return next((s for n, s in compose.states().items() if service in n and s[0] == "exited"), None)


def audit(compose: Compose) -> dict:
    """`asyncrl audit` of the run, in a container with init's volumes and admin identity."""
    r = compose("run", "--rm", "--no-deps", "-T", "init", "asyncrl", "audit", "/runs/compose", "--json",
                check=False, timeout_s=180)  # fmt: skip
    try:
        return json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"asyncrl audit printed no report ({r.returncode}): {r.stderr[-3000:]}") from None


def test_compose_runs_a_job_to_the_end_with_three_producers(image, tmp_path):
    tool, tag = image
    ports = {name: free_port() for name in ("NATS", "ENGINE", "BUFFER", "WEIGHT_SYNC", "EVAL", "TRAINER")}
    env = {**os.environ, "ASYNCRL_TEST_IMAGE": tag, "ASYNCRL_TEST_NUM_ROLLOUT": str(NUM_ROLLOUT),
           "ASYNCRL_NATS_URL": f"nats://127.0.0.1:{ports['NATS']}",
           **{f"ASYNCRL_TEST_{k}_PORT": str(p) for k, p in ports.items()}}  # fmt: skip
    compose = Compose(tool, loopback_file(tool, env, tmp_path / "compose.yml"), env)
    try:
        services = ["secrets", "nats", "init", "engine", "buffer", "weight-sync", "eval", "rollout"]
        compose("up", "-d", "--no-build", "--scale", f"rollout={NUM_PRODUCERS}", *services, timeout_s=600)
        token = compose("run", "--rm", "--no-deps", "-T", "secrets", "cat", "/secrets/run-token").stdout.strip()
        buffer_url = f"http://127.0.0.1:{ports['BUFFER']}"
        wait_for(lambda: (s := status(buffer_url, token)) and s["producers"] == NUM_PRODUCERS, 180,
                 f"{NUM_PRODUCERS} producers' heartbeats at the buffer", compose)  # fmt: skip

        compose("up", "-d", "--no-build", "--no-deps", "trainer")
        trainer = wait_for(lambda: exited(compose, "trainer"), 480, "the trainer's exit", compose)
        assert trainer[1] == 0, compose.logs("trainer")

        report = audit(compose)
        assert report["balanced"] and report["lost"] == 0 and report["trained_twice"] == 0, report["problems"]
        assert report["trained"] == NUM_ROLLOUT * BATCH, report

        urls = set(
            re.findall(
                r"rollout-\w+ serving HTTP on (http://127\.0\.0\.1:\d+)", compose.logs("rollout", tail_chars=10**7)
            )
        )
        producers = {s["instance_id"]: s["groups_published"] for s in (status(u, token) for u in urls) if s}
        assert len(producers) == NUM_PRODUCERS, (urls, producers)
        assert all(n > 0 for n in producers.values()), f"a producer published nothing: {producers}"
        assert sum(producers.values()) >= report["trained"], (producers, report["trained"])
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "20", check=False, timeout_s=300)
