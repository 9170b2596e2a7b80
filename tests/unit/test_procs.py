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
