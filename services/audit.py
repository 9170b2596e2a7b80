"""`asyncrl audit RUN_DIR`: balance a run's ledger, prompt by prompt.

Reads the buffer's ledger (LEDGER_<run>), the prompts still on PROMPTS and the groups still on
ROLLOUTS from the run's NATS server - the live one if it answers, otherwise a temporary
nats-server started on the run's own store (embedded runs keep it under RUN_DIR/nats) - and the
trainer's record of what it trained (RUN_DIR/trained.jsonl). Exit code 0 when balanced. The
report also lists the weight versions the run's object bucket holds (`weights_stored`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

from asyncrl_proto import AdapterRegistryState, PromptMsg, RolloutGroupView, decode, group_id
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.subjects import ADAPTERS_KV_KEY
from services.buffer.state import Auditor, lineage_entry, prompt_of
from services.common.run_store import admin_credentials, registrations, run_config, store_server
from services.weights.store import WeightStore

ELECTION_S = 60.0
"""How long a read waits for a stream of a just-started cluster to elect its leader (read_stream's deadline)."""


async def collect(nats_url: str, run_id: str, run_dir: Path, creds=None, prompt: int | None = None) -> dict:
    """The audit report of a run, read from its NATS server (as the admin role: `creds`, else
    the run's own secrets, else the environment). Ledger messages that are not the buffer's
    (undecodable) are skipped and listed under `ledger_skipped`, never a crash. A multi-LoRA run's
    report holds one more per adapter registration (`adapters`): each balances on its own."""
    from services.common.bus import Bus, BusError
    from services.common.bus.errors import through_outage

    bus = await Bus.connect(nats_url, run_id, "audit", connect_timeout_s=10, creds=creds or admin_credentials(run_dir))
    try:
        report = await _collect_partition(bus, bus.subjects, run_dir / "trained.jsonl", prompt)
        # a cluster just started on the run's store elects each stream's leader in its own time: the
        # reads below wait for theirs (as read_stream does), never fail on the first timeout
        try:  # the versions its object bucket holds: a report beside the ledger, never its failure
            report["weights_stored"] = await through_outage(
                lambda: WeightStore(bus).stored_versions(), "the weight snapshots", ELECTION_S, "list"
            )
        except BusError as e:
            report["weights_stored"] = f"not listed: {e}"
        raw = await through_outage(lambda: bus.kv_get(ADAPTERS_KV_KEY), "the adapter registry", ELECTION_S, "read")
        try:
            reg = decode(raw, AdapterRegistryState) if raw is not None else None
        except MalformedMessage as e:  # its adapters' ledgers cannot be found: nothing says they balance
            report["problems"].append(f"the adapter registry (KV {ADAPTERS_KV_KEY}) does not decode: {e}")
            report["balanced"], reg = False, AdapterRegistryState()
        if reg is not None:  # multi-LoRA: every registration's partition balances on its own
            report["adapters"] = {}
            for name, rid, state in registrations(reg, run_dir):
                trained = run_dir / "adapters" / name / rid / "trained.jsonl"
                part = await _collect_partition(bus, bus.subjects.of(rid), trained)
                part["state"] = state
                report["adapters"][f"{name}@{rid[:12]}"] = part
                if not part["balanced"]:
                    report["problems"] += [f"adapter {name} ({rid[:12]}): {p}" for p in part["problems"]]
                    report["balanced"] = False
    finally:
        await bus.close()
    return report


async def _collect_partition(bus, s, trained_path: Path, prompt: int | None = None) -> dict:
    """The audit report of one partition: the run's (a single model), or one adapter registration's."""
    auditor = Auditor()
    ledger = await bus.read_stream(s.ledger_stream, s.ledger)
    unique = auditor.read([(f"#{i}", d) for i, d in enumerate(ledger, 1)])
    prompts = {
        group_id(p.group_index, p.attempt)
        for p in _decoded(await bus.read_stream(s.prompts_stream, only=s.prompts), PromptMsg)  # a work queue
    }
    rollouts = {
        g.group_id for g in _decoded(await bus.read_stream(s.rollouts_stream, s.rollouts), RolloutGroupView)
    }
    trained = None
    if trained_path.exists():
        trained = {}
        for line in trained_path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):  # a torn last line of a killed trainer
                rec = json.loads(line)
                trained[int(rec["step"])] = list(rec["groups"])
    report = auditor.report(remaining_prompts=prompts, remaining_rollouts=rollouts, trained_by_trainer=trained)
    report["ledger_skipped"] = auditor.skipped
    if prompt is not None:  # one prompt's history and how the audit settles it
        report["prompt"] = {"group_index": prompt, "fate": auditor.fate(prompt),
                            "events": [lineage_entry(e) for e in unique if prompt_of(e) == prompt]}  # fmt: skip
    return report


def _decoded(datas: list[bytes], tp):
    """The messages that decode as `tp` (a malformed one was dead-lettered by its consumer)."""
    for d in datas:
        with contextlib.suppress(MalformedMessage):
            yield decode(d, tp)


def audit_run(run_dir: str | Path, prompt: int | None = None) -> dict:
    """The audit report; with `prompt` (a group index), also that prompt's history and fate."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    url, run_id = cfg.get("nats_url"), cfg["run_id"]
    if url and _answers(url):
        return asyncio.run(collect(url, run_id, run_dir, prompt=prompt))
    with store_server(run_dir) as srv:
        return asyncio.run(collect(srv.url, run_id, run_dir, prompt=prompt))


def _answers(url: str) -> bool:
    import socket
    from urllib.parse import urlparse

    for one in url.split(","):  # a cluster: any node will do
        u = urlparse(one.strip())
        with contextlib.suppress(OSError), socket.create_connection((u.hostname or "127.0.0.1", u.port or 4222), 1.0):
            return True
    return False


def format_report(r: dict) -> str:
    lines = [
        f"released prompts       {r['released_prompts']}",
        f"  trained once         {r['trained']}",
        f"  failed               {r['failed']}  (every sample FAILED: committed, trained nothing)",
        f"  filtered             {sum(r['filtered'].values())}" + (f"  {r['filtered']}" if r["filtered"] else ""),
        f"  dropped (aborted)    {r['aborted_dropped']}",
        f"  dropped (stale)      {r['stale_dropped']}",
        f"  rejected             {r['rejected']}  (groups that failed validation, dead-lettered)",
        *([f"  dropped (foreign)    {r['foreign_dropped']}  (came back after their adapter registration ended)",
           f"  dropped (retired)    {r['retired_dropped']}  (stored when their adapter registration ended)"]
          if "foreign_dropped" in r and r["foreign_dropped"] + r["retired_dropped"] else []),
        f"  in flight at the end {sum(r['in_flight_at_end'].values())}  {r['in_flight_at_end']}",
        *([f"    of them unpublished {r['unpublished_at_end']}  (released, not yet on PROMPTS: a restarted buffer "
           "publishes them from the ledger)"] if r.get("unpublished_at_end") else []),
        f"recycled (then one of the above) {r['recycled']}",
        f"duplicate groups ignored         {r['duplicates_ignored']}",
        f"lost {r['lost']}, trained twice {r['trained_twice']}  ({r['events']} ledger events)",
        *(f"skipped: {x}" for x in r.get("ledger_skipped", [])[:20]),
        "BALANCED" if r["balanced"] else "NOT BALANCED:\n  " + "\n  ".join(r["problems"][:20]),
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="asyncrl audit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--prompt", type=int, default=None, metavar="G",
                   help="also one prompt's history (group index G): every ledger event, and how it ended")  # fmt: skip
    a = p.parse_args(argv)
    try:
        report = audit_run(a.run_dir, a.prompt)
    except (OSError, RuntimeError, ValueError) as e:  # no run dir, a store's server not healthy in time, BusError, SecretError
        print(f"asyncrl audit: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        if (pr := report.get("prompt")) is not None:
            print(f"\nprompt {pr['group_index']}: {pr['fate'] or 'never released'}")
            for e in pr["events"]:
                extra = " ".join(f"{k}={e[k]}" for k in ("outcome", "step", "staleness", "reason", "recycled") if k in e)
                print(f"  {e['seq']:>8} {e['group_id']:<12} {e['kind']:<10} {extra}")
        for name, part in report.get("adapters", {}).items():
            print(f"\nadapter {name} ({part['state']}):\n{format_report(part)}")
    return 0 if report["balanced"] else 1
