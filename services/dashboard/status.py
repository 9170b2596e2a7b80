"""`asyncrl status RUN_DIR [--watch]`: one screen on a live or finished run.

Services and their state, step/total with the ETA, the last rollout reward and held-out reward,
staleness, the buffer, the run's diagnosis (the bound it is under, or why it stalled, with the
flag to change: services/dashboard/diagnosis.py), the ledger's balance and the last errors in the
logs. The ledger is read from the live run's NATS server; a finished run's is its audit.json
(written at its end). With --watch the screen is drawn again every --interval seconds until the
run ends or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from services.buffer.state import ledger_counts
from services.dashboard.data import RunData, StreamSource, is_live
from services.dashboard.views import num as _f


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def render(data: RunData, ledger: dict | None, ledger_note: str = "") -> str:
    s = data.summary()
    state = "live" if s["live"] else ("finished" if s["finished"] else "stopped (no result.json)")
    lines = [f"run {s['run_id']} ({s['mode']}) {state}   {data.run_dir}",
             f"step {s['step']}/{s['total'] or '?'}   ETA {_dur(s['eta_s']) if s['live'] else '-'}   "
             f"step time {_f(s['step_time_s'])}s   weights v{s['weight_version'] if s['weight_version'] is not None else '-'}"]  # fmt: skip
    first, held = s["heldout_first"], s["heldout"]
    heldout = f"{_f(first[1])} (step {first[0]}) -> {_f(held[1])} (step {held[0]})" if held else "-"
    lines.append(f"reward {_f(s['reward'])}   held-out {heldout}")
    lines.append(f"staleness {_f(s['staleness'], '{:.2f}')}   buffer queue {_f(s['queue'], '{:.0f}')}/{data.capacity}")
    lines.append(f"diagnosis: {s['diagnosis']}")
    if s.get("length_warning"):
        lines.append(s["length_warning"])
    if ledger:
        for name, part in (ledger.get("adapters") or {"": ledger}).items():  # multi-LoRA: each registration's
            c = ledger_counts(part)  # dropped: aborted, stale, and an adapter's foreign and retired groups
            lines.append(f"ledger{name and ' of adapter ' + name}: {c['released']} released, {c['trained']} trained, "
                         f"{c['failed']} failed, {c['filtered']} filtered, {c['dropped']} dropped, {c['rejected']} "
                         f"rejected, {part['recycled']} recycled, {c['in_flight_at_end']} in flight, {c['lost']} lost, "
                         f"{c['trained_twice']} trained twice ({'balanced' if part['balanced'] else 'NOT BALANCED'})"
                         f"{ledger_note}")  # fmt: skip
    else:
        lines.append(f"ledger: {ledger_note or 'not read'}")
    lines.append("services:")
    for x in data.services():
        cause = f" (last: {x['last_restart']['why']})" if x["last_restart"] else ""
        lines.append(f"  {x['name']:<12} pid {x['pid'] or '-':<7} {x['state']:<12} "
                     f"restarts {x['restarts']}{cause}   {x['url'] or ''}")  # fmt: skip
    errors = data.errors(5)
    lines.append("last errors:" + ("" if errors else " none"))
    lines += [f"  {e[:200]}" for e in errors]
    return "\n".join(lines)


async def _read_ledger(data: RunData, source) -> tuple[dict | None, str]:
    """A finished run's audit.json, or (live) the ledger read on (its balance comes after the
    files are: `data.main.audit()`); and a note on where it came from."""
    if source is None:
        path = data.run_dir / "audit.json"
        if path.exists():
            return json.loads(path.read_text()), " (audit.json)"
        return None, "no audit.json: `asyncrl audit RUN_DIR` balances it"
    try:
        await data.refresh_streams(await source.bus())
    except Exception as e:  # the broker away: the rest still shows
        await source.reset()
        return None, f"not read ({type(e).__name__}: {str(e)[:120]})"
    return None, ""


async def _run(a) -> int:
    data = RunData(a.run_dir)
    source = StreamSource(data.run_dir, True) if is_live(data.run_dir) else None
    try:
        while True:
            ledger, note = await _read_ledger(data, source)  # the ledger before the files (see Dashboard.refresh)
            data.refresh_files()
            if source is not None and not note:
                ledger = data.main.audit()
            screen = render(data, ledger, note)
            if a.watch and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            print(screen, flush=True)
            if not a.watch or not is_live(data.run_dir):
                return 0
            print(f"(every {a.interval:g}s; Ctrl-C stops)", flush=True)
            await asyncio.sleep(a.interval)
            if source is None:
                break
    finally:
        if source is not None:
            await source.close()
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl status", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("run_dir")
    p.add_argument("--watch", action="store_true", help="draw it again every --interval seconds while the run lives")
    p.add_argument("--interval", type=float, default=2.0)
    a = p.parse_args(argv)
    if not (Path(a.run_dir) / "config.json").exists():
        print(f"asyncrl status: {Path(a.run_dir) / 'config.json'} not found: is {a.run_dir} a run directory?",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        return asyncio.run(_run(a))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
