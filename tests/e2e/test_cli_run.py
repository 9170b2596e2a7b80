"""Whole runs through the real CLI: every service as its own process over real NATS, the
built-in engine, the tiny model. Checks versions, trained groups, metrics, endpoints, cleanup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common.httpauth import role_token
from services.common.procs import pid_alive
from services.common.snapshot import SNAPSHOT_LAG_FACTOR
from tests.conftest import run_auth

SMALL = [
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "4",
    "--async-data-buffer-capacity-factor",
    "1",
]


def asyncrl(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_run(cwd: Path, *args: str) -> subprocess.Popen:
    """`asyncrl train-async --fully-async` on the SMALL job with ARGS, in the background; its
    output (stdout and stderr) on one text pipe."""
    return subprocess.Popen([sys.executable, "-m", "services.cli", "train-async", "--fully-async", *SMALL, *args],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_nothing_left(run_dir: Path) -> None:
    pids = json.loads((run_dir / "pids.json").read_text())
    alive = {name: pid for name, pid in pids.items() if name != "launcher" and pid_alive(pid)}
    assert not alive, f"processes outlived the run: {alive}"
    # and nothing they started themselves (fleet engines, trainer ranks): no process mentions the run
    mine = str(run_dir)
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            assert mine not in cmdline or not pid_alive(int(proc.name)), f"left running: {cmdline}"


def test_sync_entrypoint_rejects_fully_async(tmp_path):
    r = asyncrl("train", "--fully-async", cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    assert "--fully-async requires the async driver: run train-async" in r.stderr


def test_invalid_flags_say_what_to_do(tmp_path):
    r = asyncrl("train-async", "--fully-async", "--pause-generation-mode", "abort", cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and "--fully-async cannot use --pause-generation-mode abort" in r.stderr


def test_fully_async_run_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(tmp_path, "--num-rollout", "8", "--eval-interval", "4", "--run-dir", str(run_dir))
    try:
        # while it runs: every service answers its HTTP endpoints on its own port
        deadline = time.monotonic() + 120
        while not (run_dir / "services.json").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "services never came up"
            time.sleep(0.1)
        services = json.loads((run_dir / "services.json").read_text())
        assert {"buffer", "weight-sync", "eval", "rollout-0", "trainer", "engine-0", "dashboard"} <= set(services)
        with httpx.Client(timeout=5) as http:
            for name, url in services.items():
                if name == "dashboard":  # its routes: tests/e2e/test_dashboard.py
                    continue
                if name.startswith("engine"):
                    assert http.get(url + "/model_info", headers=run_auth(run_dir)).status_code == 200
                    assert http.get(url + "/model_info").status_code == 401  # the engine wants the run token
                    continue
                for path in ("/healthz", "/metrics", "/status"):
                    r = http.get(url + path, headers=run_auth(run_dir))
                    assert r.status_code == 200, (name, path, r.text)
                assert http.get(url + "/status", headers=run_auth(run_dir)).json()["service"] in name
                assert http.get(url + "/status").status_code == 401  # not without it
                assert http.get(url + "/healthz").status_code == 200  # probes stay open
                config = http.get(url + "/config", headers=run_auth(run_dir)).text
                token = run_auth(run_dir)["Authorization"].split()[1]
                passwords = json.loads((run_dir / "secrets" / "nats.json").read_text())
                assert token not in config and not any(p["password"] in config for p in passwords.values())
                # least privilege: no child holds the run token; a producer's token opens no service route
                pid = http.get(url + "/status", headers=run_auth(run_dir)).json()["pid"]
                assert token.encode() not in Path(f"/proc/{pid}/environ").read_bytes(), name
                producer = {"Authorization": f"Bearer {role_token(token, 'rollout')}"}
                assert http.get(url + "/status", headers=producer).status_code == 403
            engine = services["engine-0"]
            producer = {"Authorization": f"Bearer {role_token(token, 'rollout')}"}
            assert http.post(engine + "/pause_generation", json={}, headers=producer).status_code == 403
            assert http.get(engine + "/model_info", headers=producer).status_code == 200
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "held-out reward (reverse-digits): before training" in out and "[step    8/8]" in out
    recs = records(run_dir)
    assert [r["step"] for r in recs] == list(range(8))
    assert [r["weight_version"] for r in recs] == list(range(1, 9))  # one push per step
    for key in ("rollout/fully_async/queue_size", "rollout/reward/mean", "rollout/reward/std", "perf/step_time_s",
                "perf/rollout_wait_s", "perf/train_time_s", "train/loss", "rollout/weight_version/mean"):  # fmt: skip
        assert all(key in r for r in recs), key
    assert any("rollout/fully_async/avg_staleness" in r for r in recs)
    assert max(r["rollout/weight_version/max"] for r in recs) >= 1  # samples carry advancing versions
    assert all(r["rollout/num_samples"] == 16 for r in recs)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["final_weight_version"] == 8 and result["heldout_reward_final"] is not None
    # keyed by the steps trained before each point; named on Miles's axis by the step just trained
    assert {k: m["eval/step"] for k, m in result["evals"].items()} == {"0": 0, "4": 3, "8": 7}
    # result.json is written after the audit: the ledger's verdict and counts, as the console shows them
    assert result["ledger_balanced"] is True
    assert result["ledger"] == {"released": 32, "trained": 32, "failed": 0, "filtered": 0, "dropped": 0,
                                "rejected": 0, "in_flight_at_end": 0, "lost": 0, "trained_twice": 0}  # fmt: skip
    last = json.loads(out.strip().splitlines()[-1])
    assert last == {k: v for k, v in result.items() if k != "evals"}
    assert_nothing_left(run_dir)


@pytest.mark.parametrize("command", ["train", "train-async"])
def test_sync_and_one_step_drivers(tmp_path, command):
    run_dir = tmp_path / "run"
    sentinel = tmp_path / "save-now"
    sentinel.write_text("")  # present from the start: a save after step 0 as well, then it is deleted
    r = asyncrl(command, *SMALL, "--num-rollout", "5", "--run-dir", str(run_dir), "--update-weights-interval", "2",
                "--save", str(run_dir / "ckpt"), "--save-interval", "2", "--save-hf", str(run_dir / "hf"),
                "--save-trigger-sentinel", str(sentinel), "--eval-interval", "2", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    recs = records(run_dir)
    if command == "train":  # synchronous is on-policy: a push after every step, whatever the interval says
        assert [r["weight_version"] for r in recs] == [1, 2, 3, 4, 5]
        trainer_log = (run_dir / "logs" / "trainer.log").read_text()
        assert trainer_log.count("--update-weights-interval 2 is ignored by the synchronous driver") == 1
    else:
        assert [r["weight_version"] for r in recs] == [0, 1, 1, 2, 2]  # pushes iff (r + 1) % 2 == 0: none forced
    # saves due after steps 1 and 3 ((r + 1) % 2 == 0) and the last, 4, plus step 0 on the sentinel;
    # checkpoints (the newest 2 kept) and HF snapshots, markers last
    assert not sentinel.exists()
    assert sorted(p.name for p in (run_dir / "ckpt").glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step_1", "step_2", "step_4", "step_5"]
    assert all((p / ".complete").exists() for p in (run_dir / "hf").iterdir())
    # eval points on Miles's axis: the baseline (0), after steps 1 and 3 (named 1 and 3); the last
    # step forces one only in the async drivers
    evals = json.loads((run_dir / "result.json").read_text())["evals"]
    names = {k: m["eval/step"] for k, m in evals.items()}
    assert names == ({"0": 0, "2": 1, "4": 3} if command == "train" else {"0": 0, "2": 1, "4": 3, "5": 4})
    if command == "train":
        # synchronous: every batch was generated on the weights of the previous push
        for rec in recs:
            assert rec["rollout/weight_version/max"] == rec["rollout/weight_version/min"]
        assert [rec["rollout/weight_version/min"] for rec in recs] == [0, 1, 2, 3, 4]
    else:
        # one-step: step r+1's batch is generated while step r trains, so it lags by one step
        assert [rec["rollout/weight_version/min"] for rec in recs] == [0, 0, 0, 1, 1]
    assert_nothing_left(run_dir)


def test_ctrl_c_stops_every_process(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "train-async", "--fully-async", *SMALL, "--num-rollout", "1000",
         "--run-dir", str(run_dir)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "every process of the run was stopped" in out
    assert_nothing_left(run_dir)


def test_multiturn_example_trains_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    r = asyncrl("train-async", "--fully-async", *SMALL, "--num-rollout", "3", "--run-dir", str(run_dir),
                "--custom-generate-function-path", "services.tasks.multiturn.generate",
                "--custom-rm-path", "services.tasks.multiturn.reward", "--skip-eval-before-train", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = records(run_dir)
    assert [x["step"] for x in recs] == [0, 1, 2]
    # two model turns and a masked tool token per sample: more response than loss tokens
    assert all(x["train/num_loss_tokens"] < x["rollout/response_length/mean"] * x["rollout/num_samples"] for x in recs)
    assert_nothing_left(run_dir)


@pytest.mark.parametrize("placement", ["processes", pytest.param("ray", marks=pytest.mark.ray)])  # ray: make test-ray
def test_data_parallel_trainer(tmp_path, placement):
    if placement == "ray":
        pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    extra = ["--use-ray"] if placement == "ray" else []
    r = asyncrl("train-async", "--fully-async", *SMALL, "--num-rollout", "3", "--trainer-num-ranks", "2",
                "--run-dir", str(run_dir), *extra, cwd=tmp_path, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((run_dir / "result.json").read_text())["evals"] == {}  # no --eval-interval: no eval at all
    assert "set --eval-interval N" in r.stdout
    recs = records(run_dir)
    assert [x["step"] for x in recs] == [0, 1, 2] and all(x["train/dp_world_size"] == 2 for x in recs)
    ranks = json.loads((run_dir / "trainer-ranks.json").read_text())
    assert (ranks["ray_actors"], len(ranks["ranks"])) == ((1, 0) if placement == "ray" else (0, 1))
    assert not any(pid_alive(p) for p in ranks["ranks"])
    assert_nothing_left(run_dir)


def test_megatron_backend_trains_and_its_snapshots_serve(tmp_path):
    pytest.importorskip("megatron.core")
    run_dir = tmp_path / "run"
    r = asyncrl("train-async", "--fully-async", *SMALL, "--num-rollout", "3", "--train-backend", "megatron",
                "--eval-interval", "3", "--skip-eval-before-train", "--run-dir", str(run_dir), cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = records(run_dir)
    assert [x["weight_version"] for x in recs] == [1, 2, 3]
    result = json.loads((run_dir / "result.json").read_text())
    # the final eval ran on the engines at version 3: they loaded the Megatron-trained HF snapshot
    assert result["evals"]["3"]["eval/reverse-digits/weight_version/mean"] == 3.0


def test_dedicated_eval_fleet(tmp_path):
    run_dir = tmp_path / "run"
    r = asyncrl("train-async", "--fully-async", *SMALL, "--num-rollout", "4", "--eval-num-gpus", "1",
                "--eval-interval", "2", "--eval-hf-dir", str(run_dir / "evalhf"), "--run-dir", str(run_dir), cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evals = json.loads((run_dir / "result.json").read_text())["evals"]
    assert set(evals) == {"0", "2", "4"}
    for m in evals.values():  # snapshot points: the fleet ran exactly the snapshot of the point, pinned by its name
        assert m["eval/reverse-digits/weight_version/mean"] == m["eval/step"]
        assert m["eval/reverse-digits/weight_version/mixed_version_ratio"] == 0.0
    assert [evals[k]["eval/step"] for k in ("0", "2", "4")] == [0, 1, 3]
    assert "eval/export_time_seconds" not in evals["0"]  # the baseline is --hf-checkpoint itself, not an export
    assert evals["2"]["eval/export_time_seconds"] > 0 and evals["4"]["eval/export_time_seconds"] > 0
    assert sorted(p.name for p in (run_dir / "evalhf").iterdir()) == ["step_2", "step_4"]  # kept: 2
    assert (run_dir / "logs" / "eval-engine-0.log").exists()
    assert_nothing_left(run_dir)


def test_external_evaluator_attached_to_an_sglang_protocol_server(tmp_path, tiny_model_dir):
    from tests.conftest import EngineThread

    run_dir = tmp_path / "run"
    with EngineThread(tiny_model_dir) as server:
        env = {**os.environ, "ASYNCRL_EVAL_SERVER_URL": server.url}
        r = subprocess.run(
            [sys.executable, "-m", "services.cli", "train-async", "--fully-async", *SMALL, "--num-rollout", "2",
             "--eval-function-path", "services.eval.reference.SGLangServerEval", "--eval-interval", "2",
             "--eval-hf-dir", str(run_dir / "evalhf"), "--run-dir", str(run_dir)],
            cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        # the evaluator pinned the server to the last point's snapshot, named as Miles names it: step 1
        assert server.scheduler.weight_version == "1"
    evals = json.loads((run_dir / "result.json").read_text())["evals"]
    assert evals["2"]["eval/reverse-digits/weight_version/mean"] == 1.0 and "eval/skipped_crashed" not in evals["2"]


SLOW_EVAL = """
import time
from services.api import CheckpointEvalFn

class SlowEval(CheckpointEvalFn):
    def evaluate_checkpoint(self, checkpoint_dir, input):
        time.sleep(1.5)  # a slow external benchmark
        return {"slow": 1.0}
"""


def test_busy_points_are_skipped_and_failed_exports_reported(tmp_path):
    (tmp_path / "sloweval.py").write_text(SLOW_EVAL)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "services.cli", "train-async", "--fully-async", *SMALL, "--num-rollout", "6",
            "--eval-function-path", "sloweval.SlowEval", "--eval-interval", "1", "--skip-eval-before-train"]  # fmt: skip
    r = subprocess.run([*base, "--eval-hf-dir", str(run_dir / "evalhf"), "--eval-max-in-flight", "1",
                        "--eval-overflow-policy", "skip", "--run-dir", str(run_dir)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evals = json.loads((run_dir / "result.json").read_text())["evals"]
    busy = [s for s, m in evals.items() if "eval/skipped_busy" in m]
    assert busy and "6" not in busy and evals["6"]["eval/slow"] == 1.0  # the final point is never skipped
    # a snapshot directory that cannot be written: every point reports export_failed, the run goes on
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    run2 = tmp_path / "run2"
    r = subprocess.run([*base, "--eval-hf-dir", str(blocked), "--run-dir", str(run2)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evals = json.loads((run2 / "result.json").read_text())["evals"]
    assert all("eval/skipped_export_failed" in m for m in evals.values()) and set(evals) == {
        str(i) for i in range(1, 7)
    }


def _ledger(run_dir: Path) -> list:
    """Every event of a finished run's ledger, read from its stopped embedded server's store."""
    import asyncio

    from services.audit import admin_credentials
    from services.buffer.state import ledger_events
    from services.common.bus import Bus
    from services.common.natsauth import server_auth_conf
    from services.common.natsserver import EmbeddedNats
    from services.common.secrets import load_roles_file

    run_id = json.loads((run_dir / "config.json").read_text())["run_id"]
    passwords = {r: e["password"] for r, e in load_roles_file(run_dir / "secrets" / "nats.json").items()}

    async def read() -> list:
        with EmbeddedNats(run_dir / "nats", auth_conf=server_auth_conf(run_id, passwords)) as srv:
            bus = await Bus.connect(srv.url, run_id, "test", creds=admin_credentials(run_dir))
            try:
                return [e for d in await bus.read_stream(bus.subjects.ledger_stream, bus.subjects.ledger)
                        for e in ledger_events(d)]  # fmt: skip
            finally:
                await bus.close()

    return asyncio.run(read())


def test_fully_async_staleness_bound_holds_exactly_over_a_whole_run(tmp_path):
    """Every group of a step's lease is judged against one version, the trainer's when it asked
    (no push while a lease is being filled), and none is older than --max-weight-staleness
    versions against it. Step t's lease is filled while step t-1 trains, so the trainer's version
    then is the one pushed after step t-2."""
    run_dir = tmp_path / "run"
    r = asyncrl("train-async", "--fully-async", *SMALL, "--num-rollout", "8", "--max-weight-staleness", "1",
                "--skip-eval-before-train", "--run-dir", str(run_dir), cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = records(run_dir)
    version_before = {rec["step"]: (recs[i - 2]["weight_version"] if i >= 2 else 0) for i, rec in enumerate(recs)}
    events = _ledger(run_dir)
    oldest = {e.group_id: e.oldest_version for e in events if e.kind == "put"}
    leased = [e for e in events if e.kind == "leased"]
    assert {e.step for e in leased} == set(range(8))
    for e in leased:
        assert e.staleness is not None and e.staleness <= 1, e
        # the clock it was judged against is the version the trainer had when it asked
        assert e.staleness + oldest[e.group_id] == version_before[e.step], (e, version_before)


def test_object_store_weights_reach_the_engines_without_the_trainers_disk(tmp_path):
    """--update-weight-transfer-mode object-store: every push goes to the run's NATS object
    bucket, the engine fetches it there (its cache holds the versions), old versions are retired
    like the trainer's own snapshots, and the run's ledger balances."""
    run_dir = tmp_path / "run"
    r = asyncrl("train-async", "--fully-async", *SMALL, "--num-rollout", "6", "--keep-weight-snapshots", "2",
                "--update-weight-transfer-mode", "object-store", "--run-dir", str(run_dir), cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 lost, 0 trained twice (balanced" in r.stdout
    assert [rec["weight_version"] for rec in records(run_dir)] == list(range(1, 7))
    cached = sorted(int(p.name[1:]) for p in (run_dir / "engine-cache" / "engine-0").glob("v*") if p.name[1:].isdigit())
    assert not list((run_dir / "engine-cache" / "engine-0").glob("*.part"))  # a fetch cut off leaves nothing
    assert cached and cached[-1] == 6 and len(cached) <= 3  # fetched, the newest few kept
    sync_log = (run_dir / "logs" / "weight-sync.log").read_text()
    assert "engines now at weight version 6" in sync_log
    audit = json.loads((run_dir / "audit.json").read_text())
    # retired down to --keep-weight-snapshots, but never a version from the engines' live one at
    # the last push on (weight-sync may be loading it; an engine restarted gets the live one back):
    # on a loaded machine the engines lag, and the bucket holds up to SNAPSHOT_LAG_FACTOR x keep
    stored = audit["weights_stored"]
    assert audit["balanced"] and stored[-2:] == [5, 6] and stored == list(range(stored[0], 7))
    assert len(stored) <= SNAPSHOT_LAG_FACTOR * 2, stored
    assert_nothing_left(run_dir)


def test_distributed_weights_reach_the_engines_by_broadcast_from_the_trainer(tmp_path):
    """--update-weight-transfer-mode distributed: weight-sync forms one gloo group of the trainer
    and the engines, every push is broadcast by the trainer (the engine checks the announced
    digest), and the run's ledger balances."""
    run_dir = tmp_path / "run"
    r = asyncrl("train-async", "--fully-async", *SMALL, "--num-rollout", "6", "--update-weight-transfer-mode",
                "distributed", "--update-weight-buffer-size", "65536", "--run-dir", str(run_dir), cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 lost, 0 trained twice (balanced" in r.stdout
    assert [rec["weight_version"] for rec in records(run_dir)] == list(range(1, 7))
    sync_log = (run_dir / "logs" / "weight-sync.log").read_text()
    assert "weight transfer group formed: trainer 127.0.0.1:" in sync_log
    assert "engines now at weight version 6" in sync_log
    assert "update_weights_from_disk" not in (run_dir / "logs" / "engine-0.log").read_text()
    assert_nothing_left(run_dir)
