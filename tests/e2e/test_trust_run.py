"""Whole runs through the CLI that a careless or hostile neighbour tries to break: a NATS server
with TLS and one user per role; secrets that must appear on no command line, file or log; a
reward plugin that always raises; a dataset with a bad line; a JetStream store that fills up; a
producer that hangs (SIGSTOP) and a trainer record that stops agreeing with the ledger."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from services.common.natsauth import write_deploy_secrets
from services.common.natsserver import EmbeddedNats
from services.common.procs import pid_alive
from services.common.secrets import load_roles_file
from tests.tls import make_certs

SMALL = ["--fully-async", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
         "--async-data-buffer-capacity-factor", "1", "--skip-eval-before-train"]  # fmt: skip


def cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip


def launch(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "train-async", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def cmdlines(pids: dict[str, int]) -> str:
    out = []
    for pid in pids.values():
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return "\n".join(out)


def every_text_file(run_dir: Path) -> str:
    """What the run left in its files, but its secrets directory and the server's own config."""
    texts = []
    for p in run_dir.rglob("*"):
        if p.is_file() and "secrets" not in p.parts and p.name != "nats-server.conf" and "jetstream" not in p.parts:
            texts.append(p.read_text(errors="replace"))
    return "\n".join(texts)


def test_a_run_over_tls_with_one_identity_per_role_leaks_no_secret(tmp_path):
    run_id = "tls" + uuid.uuid4().hex[:8]
    certs = make_certs(tmp_path / "certs")
    write_deploy_secrets(run_id, tmp_path / "sec")
    roles = load_roles_file(tmp_path / "sec" / "nats.json")
    secrets = [e["password"] for e in roles.values()] + [(tmp_path / "sec" / "run-token").read_text().strip()]
    auth = (tmp_path / "sec" / "auth.conf").read_text()
    run_dir = tmp_path / "run"
    with EmbeddedNats(tmp_path / "nats", auth_conf=auth, tls=certs) as srv:
        env = {**os.environ, "ASYNCRL_RUN_TOKEN_FILE": str(tmp_path / "sec" / "run-token")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "train-async", *SMALL, "--num-rollout", "6", "--run-id", run_id,
             "--nats-url", srv.url, "--nats-tls-ca", certs["ca"], "--nats-roles-file", str(tmp_path / "sec" / "nats.json"),
             "--run-dir", str(run_dir)],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not (run_dir / "services.json").exists():
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "services never came up"
                time.sleep(0.1)
            pids = json.loads((run_dir / "pids.json").read_text())
            lines = cmdlines(pids)
            assert "services.trainer" in lines and not any(s in lines for s in secrets)  # no secret on a command line
            out, _ = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "balanced;" in out and " 0 lost" in out
    logs = "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    assert "violation" not in logs.lower(), "a role lacks a permission it needs"
    assert not any(s in out or s in every_text_file(run_dir) for s in secrets)
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["nats_url"].startswith("tls://") and "nats_password" not in cfg and "run_token" not in cfg


def test_an_embedded_run_keeps_its_secrets_to_itself(tmp_path):
    """The default (embedded) server: generated identities and token, mode 0700/0600, nowhere else."""
    run_dir = tmp_path / "run"
    r = cli("train-async", *SMALL, "--num-rollout", "3", "--run-dir", str(run_dir), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sec = run_dir / "secrets"
    assert sec.stat().st_mode & 0o777 == 0o700
    assert {p.name: p.stat().st_mode & 0o777 for p in sec.iterdir()} == {"nats.json": 0o600, "run-token": 0o600}
    secrets = [e["password"] for e in load_roles_file(sec / "nats.json").values()]
    secrets.append((sec / "run-token").read_text().strip())
    assert (run_dir / "nats" / "nats-server.conf").stat().st_mode & 0o777 == 0o600
    assert not any(s in r.stdout or s in r.stderr or s in every_text_file(run_dir) for s in secrets)


REWARD_PLUGIN = """
async def broken(config, sample):
    raise ValueError("the grader service is unreachable")
"""


def test_a_reward_that_always_raises_stops_the_run_with_its_cause(tmp_path):
    (tmp_path / "grader.py").write_text(REWARD_PLUGIN)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = cli("train-async", *SMALL, "--num-rollout", "20", "--custom-rm-path", "grader.broken", "--run-dir",
            str(tmp_path / "run"), cwd=tmp_path, env=env)  # fmt: skip
    assert r.returncode == 1, r.stdout[-2000:]
    assert "FAILED (more than --max-failed-ratio 0.5)" in r.stderr
    assert "ValueError: the grader service is unreachable" in r.stderr
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(records) < 20 and json.loads(records[-1])["rollout/failed_ratio"] == 1.0


def test_a_bad_dataset_line_is_an_error_before_anything_starts(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "12", "label": "21"}\n{"prompt": "34", "label": "43"}\n{"prompt": "56"\n')
    t0 = time.monotonic()
    r = cli("train-async", *SMALL, "--prompt-data", str(data), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 1 and f"{data}:3: not valid JSON" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "pids.json").exists()  # no server, no service was started
    assert time.monotonic() - t0 < 60


def test_a_full_store_is_a_clear_error_and_the_audit_still_reads_it(tmp_path):
    run_dir = tmp_path / "run"
    r = cli("train-async", *SMALL, "--num-rollout", "200", "--nats-max-file-store", "200000", "--run-dir",
            str(run_dir), cwd=tmp_path)  # fmt: skip
    assert r.returncode == 1
    store = run_dir / "nats" / "jetstream"
    assert f"the JetStream store at {store} is full" in r.stderr, r.stderr[-3000:]
    assert "stopped on an error a restart cannot fix" in r.stderr  # at once, not after every restart
    audit = cli("audit", str(run_dir), "--json", cwd=tmp_path, timeout=120)
    assert audit.returncode == 0, audit.stderr
    report = json.loads(audit.stdout)
    assert report["balanced"] and report["lost"] == 0 and report["released_prompts"] > 0


def test_a_hung_producer_is_restarted_and_a_ledger_that_does_not_balance_fails_the_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(*SMALL, "--num-rollout", "20", "--health-restart-s", "3", "--prompt-ack-wait-s", "3", "--run-dir",
                  str(run_dir), cwd=tmp_path)  # fmt: skip
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "trained.jsonl").exists() or len((run_dir / "trained.jsonl").read_text().splitlines()) < 3:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stopped = json.loads((run_dir / "pids.json").read_text())["rollout-0"]
        os.kill(stopped, signal.SIGSTOP)  # alive, but answers nothing: only a health check can tell
        (run_dir / "trained.jsonl").write_text("")  # and the trainer's record no longer matches the ledger
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if stopped is not None and pid_alive(stopped):
            os.kill(stopped, signal.SIGKILL)
    assert "rollout-0" in out and "failed its health check for" in out and "restarting (1/3 in 600s)" in out, out[
        -3000:
    ]
    assert proc.returncode == 1
    assert "the ledger does not balance" in out and "trainer and ledger disagree on trained prompts" in out
