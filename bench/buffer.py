"""Buffer benchmark: the buffer service path vs raw JetStream, same payloads, same server.

Buffer path: a producer (this process) takes released prompts from PROMPTS and publishes a
RolloutGroup of the given size to ROLLOUTS; the buffer service (its own process, the real
service) puts it, leases it to a step and records both in its ledger; a trainer (this process)
asks `buffer.get` (answered once the lease is on the ledger), takes the payload inline or reads
it from ROLLOUTS by sequence and commits each step.
Raw path: publish the same bytes to a JetStream stream, consume them with a push consumer.

Measured for 4 KB and 256 KB groups:
  latency    publish -> the trainer has the decoded group (and, reported beside it, -> the
             lease is durable), at a paced load (B = 1 group per step): --rate, or half of
             what the buffer path sustains if that is less; raw and buffer in alternating
             rounds, so that both see the same machine
  throughput groups/s, all at once (B = 64 groups per step)

With --sync-cost: the buffer path (4 KB groups) on two servers side by side, JetStream's default
fsync interval (2 min) and --nats-sync always (every write fsynced before it is acknowledged), in
alternating rounds: what surviving a machine crash costs the durable lease and the throughput.

    python bench/buffer.py [--groups 2000] [--rounds 6] [--out docs/bench/buffer.json]
    python bench/buffer.py --sync-cost [--out docs/bench/buffer_sync.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nats.errors

from asyncrl_proto import (
    BufferCommit,
    BufferCommitReply,
    BufferGetReply,
    BufferGetRequest,
    PromptMsg,
    RolloutGroup,
    Sample,
    SampleStatus,
    decode,
    encode,
    group_id,
)
from asyncrl_proto.subjects import ConsumerSpec
from services.common import procs
from services.common.bus import Bus, fetch_some, next_batch
from services.common.config import RunConfig
from services.common.natsserver import EmbeddedNats


def model_dir(root: Path) -> Path:
    """The bundled task's tiny model with a context long enough for 256 KB groups (the buffer
    checks every group against its model's vocabulary and context)."""
    path = root / "model"
    if not (path / "config.json").exists():
        from services.tasks.reverse_digits import build_model

        build_model(path, warmup_sft_steps=0, max_position_embeddings=MAX_CONTEXT, log=lambda *_: None)
    return path


MAX_CONTEXT = 80_000


def make_group(p: PromptMsg, size_bytes: int, n: int = 4) -> RolloutGroup:
    per_sample = max(2, size_bytes // n)  # a token id below 128 is one msgpack byte
    samples = [
        Sample(
            index=p.group_index * n + i,
            group_index=p.group_index,
            prompt=p.prompt,
            tokens=[7] * per_sample,
            response_length=1,
            reward=float(i),
            rollout_log_probs=[-1.0],
            weight_versions=[0],
            status=SampleStatus.COMPLETED,
        )  # fmt: skip
        for i in range(n)
    ]
    return RolloutGroup(
        group_id=group_id(p.group_index, p.attempt), group_index=p.group_index, attempt=p.attempt, samples=samples
    )


async def _payload(bus, stream: str, ref) -> bytes:
    return ref.payload if ref.payload is not None else await bus.get_payload(stream, ref.stream_seq)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---- raw JetStream ------------------------------------------------------------------------------


class RawPath:
    """Publish to a JetStream stream, consume with a durable push consumer (the lowest-latency
    raw consumer); the consumer decodes what it receives, as a trainer would."""

    async def start(self, url: str, payload: bytes) -> RawPath:
        self.payload = payload
        self.bus = await Bus.connect(url, "raw" + uuid.uuid4().hex[:6], "bench")
        self.stream, self.subject = f"RAW_{self.bus.subjects.run_id}", f"raw.{self.bus.subjects.run_id}"
        await self.bus.js.add_stream(name=self.stream, subjects=[self.subject])
        spec = ConsumerSpec(stream=self.stream, durable="c", filter_subject=self.subject, ack_wait_s=30.0,
                            max_ack_pending=256, deliver_subject=f"_INBOX.raw.{self.stream}")  # fmt: skip
        self.psub = await self.bus.consume(spec)
        self.n = 0
        return self

    async def run(self, count: int, rate: float | None) -> dict:
        sent: dict[int, float] = {}
        lat: list[float] = []
        first = self.n
        self.n += count

        async def consume():
            while len(lat) < count:
                for m in await next_batch(self.psub, 256, 1.0):
                    i = int(m.headers["i"])
                    _ = decode(m.data, RolloutGroup)
                    lat.append(time.perf_counter() - sent[i])
                    await m.ack()

        task = asyncio.ensure_future(consume())
        t0 = time.perf_counter()
        for k, i in enumerate(range(first, first + count)):
            sent[i] = time.perf_counter()
            if rate:
                await self.bus.js.publish(self.subject, self.payload, headers={"i": str(i)})
                await asyncio.sleep(max(0.0, t0 + (k + 1) / rate - time.perf_counter()))
            else:
                await self.bus.js.publish_async(self.subject, self.payload, headers={"i": str(i)})
        await task
        return {"groups_per_s": count / (time.perf_counter() - t0), "lat": lat}

    async def stop(self) -> None:
        await self.bus.close()


# ---- the buffer service -------------------------------------------------------------------------


class BufferPath:
    """The buffer service (its own process, the real service); this process plays the
    producer fleet (released prompts -> RolloutGroups on ROLLOUTS) and the trainer (one get per
    step, answered when the lease is durable, payloads inline or read by sequence, commits)."""

    async def start(self, url: str, data: Path, run_dir: Path, size: int, batch: int) -> BufferPath:
        self.size, self.batch, self.step = size, batch, 0
        run_id = "bench" + uuid.uuid4().hex[:6]
        cfg = RunConfig(prompt_data=str(data), rollout_batch_size=batch, n_samples_per_prompt=4, fully_async=True,
                        async_data_buffer_capacity_factor=max(4.0, 256 / batch), run_id=run_id,
                        run_dir=str(run_dir), hf_checkpoint=str(model_dir(run_dir)))  # fmt: skip
        self.bus = bus = await Bus.connect(url, run_id, "bench")
        await bus.ensure_streams()
        await bus.kv_put("config", json.dumps(cfg.model_dump(mode="json")).encode())
        self.proc = procs.spawn([sys.executable, "-m", "services.buffer", "--nats-url", url, "--run-id", run_id],
                                log_path=run_dir / f"buffer-{run_id}.log")  # fmt: skip
        s = self.s = bus.subjects
        while True:  # measure the running service, not its start-up
            try:
                await bus.request(
                    s.buffer_get, BufferGetRequest(step=0, count=batch, wait_s=0.0), BufferGetReply, timeout=2
                )
                break
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.1)
        self.psub = await bus.consume(s.consumers(cfg.async_.prompt_ack_wait_s)["producers"])
        self.commits: list[asyncio.Future] = []
        return self

    async def run(self, count: int, rate: float | None) -> dict:
        bus, s = self.bus, self.s
        sent: dict[str, float] = {}  # this round's groups
        lat: list[float] = []
        durable_lat: list[float] = []

        async def publish(m) -> None:
            p = decode(m.data, PromptMsg)
            rg = make_group(p, self.size)
            sent[rg.group_id] = time.perf_counter()
            await bus.js.publish(s.rollouts, encode(rg), headers={"Nats-Msg-Id": rg.group_id})
            await m.ack()

        async def produce():
            """Like a producer fleet: many groups in flight, each published when it is done."""
            t0, i = time.perf_counter(), 0
            while i < count:
                msgs = await fetch_some(self.psub, min(64, count - i), 1.0)
                if rate:
                    for m in msgs:
                        await publish(m)
                        i += 1
                        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
                else:
                    await asyncio.gather(*(publish(m) for m in msgs))
                    i += len(msgs)

        async def train():
            """Like the trainer: the step's commit goes out while the next step is requested. A group published late in the previous round
            may come first: it is consumed, not timed (its latency would include the pause)."""
            while len(lat) < count:
                req = BufferGetRequest(step=self.step, count=self.batch, wait_s=5.0)
                reply = await bus.request(s.buffer_get, req, BufferGetReply, timeout=15)
                if not reply.complete:
                    continue
                leased = time.perf_counter()  # the answer lists a lease that is on the ledger
                datas = await asyncio.gather(*(_payload(bus, s.rollouts_stream, r) for r in reply.refs))
                now = time.perf_counter()
                gids = [decode(d, RolloutGroup).group_id for d in datas]
                lat.extend(now - sent[g] for g in gids if g in sent)
                durable_lat.extend(leased - sent[g] for g in gids if g in sent)
                self.commits.append(asyncio.ensure_future(
                    bus.request(s.buffer_commit, BufferCommit(step=self.step), BufferCommitReply, timeout=15)
                ))  # fmt: skip
                self.step += 1

        t0 = time.perf_counter()
        await asyncio.gather(produce(), train())
        return {"groups_per_s": count / (time.perf_counter() - t0), "lat": lat, "durable_lat": durable_lat}

    async def stop(self) -> None:
        try:
            await asyncio.gather(*self.commits)
        finally:
            procs.stop(self.proc)
            await self.bus.close()


async def measure(url: str, data: Path, run_dir: Path, size: int, count: int, latency_count: int,
                  rate: float, rounds: int) -> dict:  # fmt: skip
    """Throughput of each path, then latency in alternating rounds (raw, buffer, raw, ...), so
    that both see the same machine: a 2-core machine's speed drifts by 20% within a minute."""
    payload = encode(make_group(PromptMsg(group_index=0, prompt="0="), size))
    raw = await RawPath().start(url, payload)
    try:
        raw_tp = (await raw.run(count, None))["groups_per_s"]
        buf = await BufferPath().start(url, data, run_dir, size, 64)
        try:
            buf_tp = (await buf.run(count, None))["groups_per_s"]
        finally:
            await buf.stop()
        # paced well below what the buffer path sustains, or the latency is a queue's
        rate = min(rate, 0.5 * buf_tp)
        print(f"[{size // 1024} KB] latency at {rate:.0f} groups/s, {rounds} rounds ...", flush=True)
        raw_lat, buf_lat, durable_lat = [], [], []
        buf = await BufferPath().start(url, data, run_dir, size, 1)
        try:
            per_round = max(1, latency_count // rounds)
            for _ in range(rounds):
                raw_lat += (await raw.run(per_round, rate))["lat"]
                r = await buf.run(per_round, rate)
                buf_lat += r["lat"]
                durable_lat += r["durable_lat"]
        finally:
            await buf.stop()
    finally:
        await raw.stop()

    def ms(xs, q):
        return 1000 * pct(xs, q)

    return {
        "payload_bytes": len(payload),
        "latency_rate_groups_per_s": rate,
        "raw": {"p50_ms": ms(raw_lat, 0.5), "p99_ms": ms(raw_lat, 0.99), "groups_per_s": raw_tp},
        "buffer": {
            "p50_ms": ms(buf_lat, 0.5),
            "p99_ms": ms(buf_lat, 0.99),
            "groups_per_s": buf_tp,
            "durable_p50_ms": ms(durable_lat, 0.5),
            "durable_p99_ms": ms(durable_lat, 0.99),
        },  # fmt: skip
        "p50_ratio": pct(buf_lat, 0.5) / pct(raw_lat, 0.5),
        "p99_ratio": pct(buf_lat, 0.99) / pct(raw_lat, 0.99),
        "durable_p50_ratio": pct(durable_lat, 0.5) / pct(raw_lat, 0.5),
        "throughput_ratio": buf_tp / raw_tp,
    }


async def measure_sync(urls: dict[str, str], data: Path, run_dir: Path, count: int, latency_count: int, rate: float,
                       rounds: int) -> dict:  # fmt: skip
    """The buffer path on servers that differ only in their fsync policy, side by side."""
    out = {}
    for label, url in urls.items():  # throughput, one after the other
        buf = await BufferPath().start(url, data, run_dir, 4096, 64)
        try:
            out[label] = {"groups_per_s": (await buf.run(count, None))["groups_per_s"]}
        finally:
            await buf.stop()
    paths = {label: await BufferPath().start(url, data, run_dir, 4096, 1) for label, url in urls.items()}
    lat = {label: [] for label in urls}
    try:
        for _ in range(rounds):  # latency, in alternating rounds
            for label, buf in paths.items():
                lat[label] += (await buf.run(max(1, latency_count // rounds), rate))["durable_lat"]
    finally:
        for buf in paths.values():
            await buf.stop()
    for label in urls:
        out[label].update(durable_p50_ms=1000 * pct(lat[label], 0.5), durable_p99_ms=1000 * pct(lat[label], 0.99))
    return out


def sync_cost(a) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"{i}=", "label": str(i)}) + "\n" for i in range(1000)))
        with (
            EmbeddedNats(tmp / "nats-default") as lazy,
            EmbeddedNats(tmp / "nats-always", sync_interval="always") as eager,
        ):
            count = a.groups - a.groups % 64
            r = asyncio.run(measure_sync({"default (2m)": lazy.url, "always": eager.url}, data, tmp, count,
                                         a.latency_groups, a.rate, a.rounds))  # fmt: skip
    base, always = r["default (2m)"], r["always"]
    print(f"\n{'fsync':14}{'durable p50 ms':>16}{'p99 ms':>9}{'groups/s':>10}")
    for label, x in r.items():
        print(f"{label:14}{x['durable_p50_ms']:>16.2f}{x['durable_p99_ms']:>9.2f}{x['groups_per_s']:>10.0f}")
    print(f"{'always/default':14}{always['durable_p50_ms'] / base['durable_p50_ms']:>15.2f}x"
          f"{always['durable_p99_ms'] / base['durable_p99_ms']:>8.2f}x{always['groups_per_s'] / base['groups_per_s']:>9.2f}x")  # fmt: skip
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=2000, help="groups per throughput measurement")
    p.add_argument("--latency-groups", type=int, default=600)
    p.add_argument("--rounds", type=int, default=6, help="alternating raw/buffer latency rounds")
    p.add_argument("--rate", type=float, default=100.0, help="paced load for the latency measurement (groups/s)")
    p.add_argument("--out", default=None)
    p.add_argument("--sync-cost", action="store_true", help="the cost of --nats-sync always (see above)")
    a = p.parse_args()
    if a.sync_cost:
        results = sync_cost(a)
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"{i}=", "label": str(i)}) + "\n" for i in range(1000)))
        with EmbeddedNats(tmp / "nats") as srv:
            for size in (4 * 1024, 256 * 1024):
                count = a.groups if size <= 4096 else max(256, a.groups // 10)
                count -= count % 64  # whole steps of 64 groups
                label = f"{size // 1024} KB"
                print(f"[{label}] throughput, {count} groups ...", flush=True)
                lat_count = a.latency_groups if size <= 4096 else a.latency_groups // 2
                results[label] = asyncio.run(measure(srv.url, data, tmp, size, count, lat_count, a.rate, a.rounds))
    print(f"\n{'':8}{'path':8}{'p50 ms':>9}{'p99 ms':>9}{'groups/s':>10}")
    for label, r in results.items():
        for path in ("raw", "buffer"):
            x = r[path]
            print(f"{label:8}{path:8}{x['p50_ms']:>9.2f}{x['p99_ms']:>9.2f}{x['groups_per_s']:>10.0f}")
        print(f"{label:8}{'ratio':8}{r['p50_ratio']:>8.2f}x{r['p99_ratio']:>8.2f}x{r['throughput_ratio']:>9.2f}x")
    print("\ndurable lease (the buffer's answer, before the payload is read):")
    for label, r in results.items():
        b = r["buffer"]
        print(
            f"{label:8}p50 {b['durable_p50_ms']:.2f} ms ({r['durable_p50_ratio']:.2f}x raw), p99 {b['durable_p99_ms']:.2f} ms"
        )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
    print(
        json.dumps(
            {k: {kk: round(vv, 3) if isinstance(vv, float) else vv for kk, vv in v.items()} for k, v in results.items()}
        )
    )


if __name__ == "__main__":
    main()
