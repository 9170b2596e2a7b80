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
