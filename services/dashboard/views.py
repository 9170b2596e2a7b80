"""What the dashboard shows, shaped from a run's data (services/dashboard/data.py): the bodies of
the JSON routes that are more than a read (curves, staleness, buffer), the charts' series for the
browser (drawn by uPlot: static/dashboard.js) and the values of the pages' tables, each as text a
reader reads (never a Python repr). The pages themselves are the templates in templates/."""

from __future__ import annotations

import collections
import signal
import time

from services.common.run_store import num  # noqa: F401 - the pages and status.py read it here
from services.dashboard.data import MAX_POINTS, RunData, series

CURVE_KEYS = {"reward": "rollout/reward/mean", "step_time": "perf/step_time_s", "rollout_wait": "perf/rollout_wait_s",
              "train_time": "perf/train_time_s", "entropy": "train/entropy", "clipfrac": "train/pg_clipfrac",
              "kl": "train/ppo_kl", "num_samples": "rollout/num_samples"}  # fmt: skip
"""Each curve of the overview (and the samples per second's count): its metrics key."""
ADAPTER_KEYS = CURVE_KEYS | {"reward": "raw_reward_mean", "rollout_wait": None, "train_time": None}
"""Multi-LoRA: an adapter's own names for the curves (its records' `<name>/...`; None: it has none)."""
AUDIT_KEYS = ("released_prompts", "trained", "failed", "filtered", "aborted_dropped", "stale_dropped", "rejected",
              "recycled", "in_flight_at_end", "lost", "trained_twice", "events")  # fmt: skip
"""The ledger's figures in the overview's audit table, in this order."""


def curves(data: RunData, x: str = "step", adapter: str = "") -> dict:
    """Every curve of the overview, downsampled, over steps or wall-clock time (x=time); with
    `adapter` (a multi-LoRA partition's key), that adapter registration's, on its own step axis."""
    xk = "time" if x == "time" else "step"
    rows, evals, key = data.metrics.rows, [], data.heldout_key()
    keys, rx = CURVE_KEYS, xk  # the metrics keys, and the rows' key for x
    if adapter:
        n, rid = data.part(adapter).name, adapter.partition("@")[2]
        rows = [r for r in rows if r.get("adapter") == n and str(r.get("registration", "")).startswith(rid)]
        keys = {k: v and f"{n}/{v}" for k, v in ADAPTER_KEYS.items()}
        rx = "time" if x == "time" else f"{n}/step"
    elif key:
        evals = [e for e in data.evals.rows if e.get(key) is not None and not e.get("skipped")]
    if evals and xk == "time":  # an eval point is placed at the time of the step it follows
        at = {r["step"]: r["time"] for r in rows if "step" in r and "time" in r}
        evals = [dict(e, time=at.get(e.get("step", 0) - 1, at.get(0))) for e in evals if at]
        evals = [e for e in evals if e.get("time") is not None]
    rate = [
        {rx: b[rx], "v": b.get(keys["num_samples"], 0) / (b["time"] - a["time"])}
        for a, b in zip(rows, rows[1:], strict=False)
        if "time" in a and "time" in b and b["time"] > a["time"]
    ]
    out = {k: series(rows, v, rx) if v else ([], []) for k, v in keys.items() if k != "num_samples"}
    out["heldout"] = series(evals, key, xk) if evals else ([], [])
    return {"x": xk, **out, "samples_per_s": series(rate, "v", rx)}


def staleness_columns(data: RunData, max_columns: int = 300, adapter: str = "") -> list[tuple[int, dict[int, int]]]:
    """The trained groups' staleness per step (from the ledger's leases), binned to at most
    max_columns columns."""
    per_step = data.part(adapter).step_staleness
    steps = sorted(per_step)
    per = max(1, -(-len(steps) // max_columns))
    return [
        (steps[k], dict(sum((per_step[s] for s in steps[k : k + per]), collections.Counter())))
        for k in range(0, len(steps), per)
    ]


def buffer_facts(data: RunData, adapter: str = "") -> dict:
    part = data.part(adapter)
    rep = part.audit()
    st = part.auditor.state
    last = data.metrics.rows[-1] if data.metrics.rows and not adapter else {}
    return {
        "queue": len(st.stored), "capacity": data.capacity, "released": rep["released_prompts"],
        "in_flight": len(st.outstanding), "leased_uncommitted": sum(len(x.refs) for x in st.leases.values()),
        "trained": rep["trained"], "failed": rep["failed"], "filtered": rep["filtered"],
        "dropped_aborted": rep["aborted_dropped"], "dropped_stale": rep["stale_dropped"],
        "recycled": rep["recycled"], "rejected": rep["rejected"], "recycled_waiting": len(st.recycled),
        "queue_at_last_step": last.get("rollout/fully_async/queue_size"),
        "dead_letters": data.dead_letters[-50:], "dead_letters_total": len(data.dead_letters),
    }  # fmt: skip


# ---- the charts (static/dashboard.js draws them) --------------------------------------------------
def _thin(items: list, n: int = MAX_POINTS) -> list:
    """At most about n of `items`, evenly spaced, the last always kept (a step line's points, bands)."""
    if len(items) <= n:
        return items
    k = -(-len(items) // n)
    return items[::k] + ([items[-1]] if (len(items) - 1) % k else [])


def _chart(key: str, title: str, x: str, time_x: bool, y: str, lines: list[tuple[str, tuple, dict]],
           empty: str = "no data yet") -> dict:  # fmt: skip
    """One chart: each line's label, points (x to the millisecond, y to 6 significant digits: the
    page's size) and how it is drawn (`smooth`: the smoothing slider applies; `points`, `dash`,
    `stepped`, `bands`: [start, end] spans shaded in its colour). Lines without a point are left out;
    a chart without any says `empty` instead."""
    out = [{"label": label, "xs": [round(v, 3) for v in xs], "ys": [float(f"{v:.6g}") for v in ys],
            **how} for label, (xs, ys), how in lines if xs]  # fmt: skip
    return {"id": key, "title": title, "x": x, "time": time_x, "y": y, "empty": "" if out else empty, "series": out}


def charts(data: RunData, x: str = "step", adapter: str = "") -> list[dict]:
    """The overview's charts: the curves (over steps or wall-clock), the staleness of the trained
    groups per step (one line per staleness: how many groups of each step had it), and each
    engine's weight version against the trainer's, every update's pause shaded."""
    cv = curves(data, x, adapter)
    tx = cv["x"] == "time"
    xl = "wall-clock" if tx else "step"
    smooth = {"smooth": True}
    columns = staleness_columns(data, adapter=adapter)
    steps = [s for s, _ in columns]
    vt = data.version_timeline()

    def line(points: list[tuple[float, int]]) -> tuple[list, list]:
        points = _thin(sorted(points))
        return [t for t, _ in points], [v for _, v in points]

    return [
        _chart("reward", "rewards", xl, tx, "reward", [("rollout reward", cv["reward"], smooth),
                                                       ("held-out eval", cv["heldout"], {"points": True})]),
        _chart("step-time", "step time", xl, tx, "seconds", [("step", cv["step_time"], smooth),
               ("rollout wait", cv["rollout_wait"], smooth), ("train", cv["train_time"], smooth)]),
        _chart("samples", "samples per second", xl, tx, "samples/s", [("samples/s", cv["samples_per_s"], smooth)]),
        _chart("train", "entropy, clip fraction, KL", xl, tx, "", [("entropy", cv["entropy"], smooth),
               ("clip frac", cv["clipfrac"], smooth), ("KL", cv["kl"], smooth)]),
        _chart("staleness", "staleness of the trained groups per step", "step", False, "groups",
               [(f"staleness {v}", (steps, [c.get(v, 0) for _, c in columns]), {"stepped": True})
                for v in sorted({v for _, c in columns for v in c})], empty="no trained groups yet"),
        _chart("versions", "weight versions: engines and trainer", "wall-clock", True, "weight version",
               [("trainer", line(vt["trainer"]), {"dash": True})]
               + [(name, line(points), {"stepped": True, "bands": _thin(sorted(vt["pauses"].get(name, [])))})
                  for name, points in sorted(vt["engines"].items())], empty="no weight update yet"),
    ]  # fmt: skip


# ---- values as the pages write them (Jinja filters) -----------------------------------------------
def readable(v) -> str:
    """A value as text: a mapping as `key: value` pairs, a list comma-separated ("none" for an
    empty one), None as "-"; never a Python repr (`{}`, `{'recycled_waiting': 0}`)."""
    if isinstance(v, dict):
        return ", ".join(f"{k}: {readable(x)}" for k, x in v.items()) or "none"
    if isinstance(v, (list, tuple)):
        return ", ".join(readable(x) for x in v) or "none"
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def clock(at) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at)) if at else "-"


def _tone(service: dict) -> str:
    """The colour of a service's state: ok running or stopped as asked (exit 0, or the launcher's
    SIGTERM), bad for any other end or one gone while the run goes on, muted when nothing says how."""
    code = service["exit_code"]
    if service["running"] or code in (0, -signal.SIGTERM):
        return "ok"
    return "bad" if code is not None or service["state"] == "not running" else "muted"


def overview(data: RunData, x: str = "step", adapter: str = "") -> dict:
    """The overview page's values (templates/overview.html)."""
    b = buffer_facts(data, adapter)
    rep = data.part(adapter).audit()
    return {
        "s": data.summary(), "charts": charts(data, x, adapter), "adapter": adapter,
        "partitions": data.partitions if len(data.partitions) > 1 else {},
        "buffer": [(k, readable(v)) for k, v in b.items() if k != "dead_letters"],
        "dead": [(d["subject"], d["service"], d["reason"]) for d in b["dead_letters"][-10:]],
        "services": [dict(svc, tone=_tone(svc)) for svc in data.services()],
        "audit": rep, "audit_rows": [(k, readable(rep[k])) for k in AUDIT_KEYS],
        "steps": data.sample_steps(adapter), "errors": data.errors(), "streams_error": data.streams_error,
    }  # fmt: skip
