"""Engine benchmark: the built-in engine's decode throughput against Hugging Face `transformers`
generate, on the same model, machine and thread count.

Arms, each at 1, 8 and 32 concurrent requests:
  http        the engine as a process (`python -m services.engine`), N closed-loop clients on
              /generate over HTTP (what a producer sees)
  in-process  the engine's Scheduler in this process, N closed-loop requests (no HTTP)
  hf-loop     a plain generate loop: transformers' LlamaForCausalLM.generate called once per
              request, in arrival order (what serving N concurrent requests with generate is)
  hf-batch    generate on static batches of N requests (KV cache on): the strongest plain-HF
              baseline, which a serving system cannot use as is (requests arrive one by one)
Workloads: `equal` (every request 64 new tokens) and `mixed` (each request its own length,
8-120 tokens, mean 64, as RL responses that end at EOS). Every prompt is 16 tokens; sampling at
temperature 1 with EOS ignored, so every arm generates the same tokens. A static batch runs until
its longest request is done; only requested tokens count. Throughput is requested tokens over wall
seconds, for --sequences requests per cell (at least N). Arms alternate in rounds (forward, then
backward); the spread of a cell between rounds is printed beside its figure.

    python bench/engine.py [--sizes tiny,25m] [--concurrency 1,8,32] [--workloads equal,mixed]
                           [--rounds 2] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import aiohttp
import torch
from bench_models import SIZES, build_models  # bench/ is the script's folder

from services.common import procs

PROMPT_LEN, NEW_TOKENS, MIXED = 16, 64, (8, 120)
ARMS = ("http", "in-process", "hf-loop", "hf-batch")


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, vocab, (n, PROMPT_LEN), generator=g).tolist()


def lengths(n: int, workload: str) -> list[int]:
    """New tokens per request: all NEW_TOKENS (equal), or uniform in MIXED (mean NEW_TOKENS)."""
    if workload == "equal":
        return [NEW_TOKENS] * n
    g = torch.Generator().manual_seed(1000 + n)
    return torch.randint(MIXED[0], MIXED[1] + 1, (n,), generator=g).tolist()


def run_hf(model_dir: Path, conc: int, sequences: int, workload: str, threads: int, batch: bool) -> float:
    """Tokens/s of generate: static batches of `conc` requests (batch), or one request at a time."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pool, want = prompts(sequences, model.config.vocab_size), lengths(sequences, workload)
    size = conc if batch else 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, sequences, size):
            ids = torch.tensor(pool[i : i + size])
            new = max(want[i : i + size])  # a static batch runs until its longest request is done
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 pad_token_id=model.config.pad_token_id or 0)  # fmt: skip
            assert out.shape[1] == PROMPT_LEN + new
    return sum(want) / (time.perf_counter() - t0)


def run_in_process(model_dir: Path, conc: int, sequences: int, workload: str, threads: int) -> float:
    from services.engine.scheduler import Request, SamplingParams, Scheduler
    from services.model.hf_io import load_model

    torch.set_num_threads(1)  # as the engine's process: torch work at `threads` only on the scheduler's thread
    model = load_model(model_dir)
    sched = Scheduler(model, max_running_requests=max(conc, 1), seed=0, torch_threads=threads)
    sched.start()
    want = lengths(sequences, workload)
    lock, finished, generated = threading.Lock(), threading.Event(), [0, 0]  # [submitted, tokens]
    total = sum(want)
    pool = prompts(sequences, model.cfg.vocab_size)

    def submit() -> None:
        with lock:
            if generated[0] >= sequences:
                return
            i = generated[0]
            generated[0] += 1
        params = SamplingParams(max_new_tokens=want[i], temperature=1.0, ignore_eos=True)
        sched.add_request(Request(rid=f"r{i}", input_ids=pool[i], params=params, on_done=done))

    def done(req) -> None:
        with lock:
            generated[1] += len(req.output_ids)
            if generated[1] >= total:
                finished.set()
        submit()

    t0 = time.perf_counter()
    for _ in range(conc):
        submit()
    if not finished.wait(timeout=1800):
        raise TimeoutError("the in-process engine did not finish")
    seconds = time.perf_counter() - t0
    sched.shutdown()
    return generated[1] / seconds


async def run_http(model_dir: Path, conc: int, sequences: int, workload: str, threads: int, logs: Path) -> float:
    from services.model.hf_io import read_config

    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs.spawn([sys.executable, "-m", "services.engine", "--model-path", str(model_dir), "--port", str(port),
                        "--torch-num-threads", str(threads), "--max-running-requests", str(max(conc, 1))],
                       log_path=logs / f"engine-{port}.log", env={**os.environ})  # fmt: skip
    try:
        procs.wait_for_port("127.0.0.1", port, 120, proc)
        pool, want = prompts(sequences, read_config(model_dir).vocab_size), lengths(sequences, workload)
        todo = iter(range(sequences))
        tokens = 0
        async with aiohttp.ClientSession() as http:

            async def client() -> None:
                nonlocal tokens
                for i in todo:
                    body = {"input_ids": pool[i], "sampling_params": {"max_new_tokens": want[i], "temperature": 1.0,
                                                                      "ignore_eos": True}}  # fmt: skip
                    async with http.post(f"{url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
                        r.raise_for_status()
                        tokens += (await r.json())["meta_info"]["completion_tokens"]

            t0 = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(conc)))
            return tokens / (time.perf_counter() - t0)
    finally:
        procs.stop(proc)


def cell(arm: str, model_dir: Path, conc: int, workload: str, a, logs: Path) -> float:
    """One measurement, each in a fresh process: the threads an earlier arm started (OpenMP teams
    that stay for the life of their thread) never share the cores with the next."""
    sequences = max(a.sequences, conc)
    if arm == "http":
        return asyncio.run(run_http(model_dir, conc, sequences, workload, a.threads, logs))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        if arm == "in-process":
            return pool.submit(run_in_process, model_dir, conc, sequences, workload, a.threads).result()
        return pool.submit(run_hf, model_dir, conc, sequences, workload, a.threads, arm == "hf-batch").result()


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.mean(xs) if len(xs) > 1 else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,25m", help=f"model sizes, of {', '.join(SIZES)}")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--workloads", default="equal,mixed", help="of equal, mixed")
    p.add_argument("--sequences", type=int, default=64, help="requests per cell (at least the concurrency)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads for every arm")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-enginebench-"))
    sizes, workloads = a.sizes.split(","), a.workloads.split(",")
    if set(workloads) - {"equal", "mixed"}:
        raise SystemExit(f"unknown workloads {workloads}: use equal, mixed")
    torch.set_num_threads(1)
    models = build_models(tmp / "models", sizes, context=PROMPT_LEN + MIXED[1] + 1)
    concs = [int(c) for c in a.concurrency.split(",")]
    cells = [(size, w, conc, arm) for size in sizes for w in workloads for conc in concs for arm in ARMS]
    results: dict[tuple, list[float]] = {c: [] for c in cells}
    for r in range(a.rounds):
        for size, w, conc, arm in cells if r % 2 == 0 else list(reversed(cells)):
            tps = cell(arm, models[size], conc, w, a, tmp)
            results[(size, w, conc, arm)].append(tps)
            print(f"  round {r + 1}, {size:>5} {w:<5} x{conc:<3} {arm:<10} {tps:9.0f} tokens/s", flush=True)
    rows = []
    print(f"\n{'size':>5} {'load':>5} {'conc':>4} " + " ".join(f"{arm:>14}" for arm in ARMS)
          + f" {'http/hf-loop':>12} {'http/hf-batch':>13}")  # fmt: skip
    for size in sizes:
        for w in workloads:
            for conc in concs:
                m = {arm: statistics.mean(results[(size, w, conc, arm)]) for arm in ARMS}
                s = {arm: spread(results[(size, w, conc, arm)]) for arm in ARMS}
                rows.append({"size": size, "workload": w, "concurrency": conc,
                             **{f"{k}_tokens_per_s": v for k, v in m.items()},
                             **{f"{k}_spread": v for k, v in s.items()}})  # fmt: skip
                cols = " ".join(f"{f'{m[arm]:7.0f} ±{s[arm]:3.0%}':>14}" for arm in ARMS)
                print(f"{size:>5} {w:>5} {conc:>4} {cols} {m['http'] / m['hf-loop']:11.1f}x "
                      f"{m['http'] / m['hf-batch']:12.1f}x")  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "settings": vars(a) | {"cpus": os.cpu_count()}}, indent=2))


if __name__ == "__main__":
    main()
