"""Process helpers (services.common.procs)."""

from __future__ import annotations


def test_listening_ports_are_chosen_outside_the_ephemeral_range():
    """An outbound connection can take a port from the ephemeral range between the launcher's
    choice and the service's bind, and keep it: every restart on it would fail to bind."""
    import socket

    from services.common.procs import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_process_never_hands_out_one_port_twice():
    """The launcher picks every child's port before the child binds it: two children drawn the
    same port (a buffer and a producer, once in a suite run) left one failing every restart.
    300 draws from ~20,000 ports would repeat one about 9 times in 10 without the record."""
    from services.common.procs import free_port

    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_a_child_the_run_does_not_need_is_given_up_not_the_run(tmp_path):
    """The dashboard crashing on every start (its port taken, say) is restarted within the budget,
    then left stopped: no LaunchError, and every restart is on record in restarts.jsonl."""
    import json
    import sys

    import pytest

    from services.supervisor import LaunchError, Supervisor

    said = []
    (tmp_path / "logs").mkdir()
    sup = Supervisor(tmp_path, max_restarts=2, health_restart_s=0, out=said.append)
    sup.spawn("dashboard", [sys.executable, "-c", "raise SystemExit(3)"], {}, essential=False)
    sup.spawn("buffer", [sys.executable, "-c", "raise SystemExit(3)"], {})
    for _ in range(2):  # both restarted twice, each exiting again
        for c in sup.children:
            c.proc.wait(10)
        sup.check_exits()
    for c in sup.children:
        c.proc.wait(10)
    with pytest.raises(LaunchError, match="buffer"):  # an essential one ends the run at its budget
        sup.check_exits()
    assert sup.child("dashboard").given_up and any("not restarted again" in x for x in said)
    lines = [json.loads(x) for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [x["name"] for x in lines].count("dashboard") == 2 and all(x["why"] == "exited with code 3" for x in lines)


def test_the_exit_code_of_every_stopped_child_is_on_record(tmp_path):
    """stop_all records each child's pid and exit code in exits.json: the dashboard shows a finished
    run's services as "exited 0" (services/dashboard/data.py), not as "not running"."""
    import json
    import sys

    from services.common.procs import EXITS_FILE
    from services.dashboard.data import RunData
    from services.supervisor import Supervisor

    (tmp_path / "logs").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"run_id": "exits"}))
    sup = Supervisor(tmp_path, max_restarts=0, health_restart_s=0, out=lambda _: None)
    sleeper = sup.spawn("buffer", [sys.executable, "-c", "import time; time.sleep(60)"], {})
    done = sup.spawn("trainer", [sys.executable, "-c", "raise SystemExit(0)"], {})
    done.proc.wait(10)
    sup.stop_all()
    exits = json.loads((tmp_path / EXITS_FILE).read_text())
    assert exits["trainer"] == {"pid": done.proc.pid, "code": 0}
    assert exits["buffer"] == {"pid": sleeper.proc.pid, "code": sleeper.proc.returncode}
    (tmp_path / "result.json").write_text("{}")
    states = {x["name"]: x["state"] for x in RunData(tmp_path).services()}
    assert states["trainer"] == "exited 0" and states["buffer"] == "exited on SIGTERM"  # the launcher's stop
    assert states["launcher"] == "running"  # this process: pids.json names it


def test_a_launcher_that_started_nothing_writes_no_exits(tmp_path):
    from services.common.procs import EXITS_FILE
    from services.supervisor import Supervisor

    Supervisor(tmp_path, max_restarts=0, health_restart_s=0, out=lambda _: None).stop_all()
    assert not (tmp_path / EXITS_FILE).exists()
