"""`asyncrl dashboard RUN_DIR`: a finished run's dashboard, and (--live, which the launcher passes)
a running one's.

A finished run is read from its files and from a nats-server of its own on a copy of the run's
store (so its ledger, weights.live and dead letters are there too); a run that is still live is
refused with the URL of its own dashboard. The run token opens it: from $ASYNCRL_RUN_TOKEN, else
RUN_DIR/secrets/run-token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from socket import AF_INET, AF_INET6, create_server


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl dashboard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("run_dir")
    p.add_argument("--http-host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--http-port", type=int, default=0, help="port (default: a free one, printed)")
    p.add_argument("--live", action="store_true", help="the launcher's: serve the run while it runs")
    return p


def _keys(run_dir: Path):
    """Who may open it: the launcher's child gets the tokens' hashes ($ASYNCRL_HTTP_KEYS) and never
    reads the token; `asyncrl dashboard` takes the run token from $ASYNCRL_RUN_TOKEN, else the run's
    secrets directory."""
    import os

    from services.common.httpauth import HTTP_KEYS_ENV, Keys, keys_from_env
    from services.common.secrets import run_token_from_env

    if os.environ.get(HTTP_KEYS_ENV):
        return keys_from_env(None)
    path = run_dir / "secrets" / "run-token"
    token = run_token_from_env() or (path.read_text().strip() if path.exists() else None)
    if token is None:
        raise SystemExit("asyncrl dashboard: no run token: set $ASYNCRL_RUN_TOKEN (the run's token opens it)")
    return Keys.of_run(token)


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    run_dir = Path(a.run_dir)
    if not (run_dir / "config.json").exists():
        print(f"asyncrl dashboard: {run_dir / 'config.json'} not found: is {run_dir} a run directory?", file=sys.stderr)
        return 2
    from services.dashboard.data import StreamSource, _json, is_live

    if not a.live and is_live(run_dir):
        url = (_json(run_dir / "services.json") or {}).get("dashboard")
        print(f"asyncrl dashboard: {run_dir} is still running: open its live dashboard"
              + (f" at {url}" if url else " (the URL the launcher printed)"), file=sys.stderr)  # fmt: skip
        return 2
    import uvicorn

    from services.dashboard.app import Dashboard, build_app

    source = StreamSource(run_dir, a.live)
    try:
        source.start()
    except (OSError, RuntimeError) as e:  # no store here (a run whose broker ran elsewhere): the files only
        print(f"asyncrl dashboard: the run's streams are not shown: {e}", file=sys.stderr)
        source.close_now()
        source = None
    app = build_app(Dashboard(run_dir, _keys(run_dir), source, live=a.live))
    v6 = ":" in a.http_host  # "::" takes IPv4 too; a browser that connects before the server is up waits, not refused
    sock = create_server((a.http_host, a.http_port), family=AF_INET6 if v6 else AF_INET, backlog=128, dualstack_ipv6=v6)
    host = "127.0.0.1" if a.http_host in ("0.0.0.0", "::") else a.http_host
    print(f"dashboard of {run_dir} at http://{host}:{sock.getsockname()[1]}/ (the run token opens it)", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
