"""Engine benchmark: the built-in engine's decode throughput against a plain Hugging Face
`transformers` generate loop, on the same model, machine and thread count.

Arms, each at 1, 8 and 32 concurrent sequences:
  http        the engine as a process (`python -m services.engine`), N closed-loop clients on
              /generate over HTTP (what a producer sees)
  in-process  the engine's Scheduler in this process, N closed-loop requests (no HTTP)
  hf          transformers' LlamaForCausalLM.generate on a batch of N prompts (a static batch,
              KV cache on; no server)
Every sequence: a 16-token prompt, 64 new tokens sampled at temperature 1, EOS ignored (so every
arm generates the same number of tokens). Throughput is generated tokens over wall seconds, for
--sequences sequences per cell (at least N). Arms alternate in rounds (forward, then backward);
the spread of a cell between rounds is printed beside its figure.

    python bench/engine.py [--sizes tiny,25m] [--concurrency 1,8,32] [--rounds 2] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import torch
from bench_models import SIZES, build_models  # bench/ is the script's folder

from services.common import procs

PROMPT_LEN, NEW_TOKENS = 16, 64
ARMS = ("http", "in-process", "hf")
def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, vocab, (n, PROMPT_LEN), generator=g).tolist()


def run_hf(model_dir: Path, conc: int, sequences: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    done, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        while done < sequences:
            ids = torch.tensor(prompts(conc, vocab))
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 pad_token_id=model.config.pad_token_id or 0)  # fmt: skip
            assert out.shape[1] == PROMPT_LEN + NEW_TOKENS
            done += conc
    return done * NEW_TOKENS / (time.perf_counter() - t0)


def run_in_process(model_dir: Path, conc: int, sequences: int) -> float:
    from services.engine.scheduler import Request, SamplingParams, Scheduler
    from services.model.hf_io import load_model

    model = load_model(model_dir)
    sched = Scheduler(model, max_running_requests=max(conc, 1), seed=0)
    sched.start()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
    lock, finished, generated = threading.Lock(), threading.Event(), [0, 0]  # [submitted, tokens]
    pool = prompts(sequences, model.cfg.vocab_size)

    def submit() -> None:
        with lock:
            if generated[0] >= sequences:
                return
            i = generated[0]
            generated[0] += 1
        sched.add_request(Request(rid=f"r{i}", input_ids=pool[i], params=params, on_done=done))

    def done(req) -> None:
        with lock:
            generated[1] += len(req.output_ids)
            if generated[1] >= sequences * NEW_TOKENS:
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


async def run_http(model_dir: Path, conc: int, sequences: int, threads: int, logs: Path) -> float:
    from services.model.hf_io import read_config

    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs.spawn([sys.executable, "-m", "services.engine", "--model-path", str(model_dir), "--port", str(port),
                        "--torch-num-threads", str(threads), "--max-running-requests", str(max(conc, 1))],
                       log_path=logs / f"engine-{port}.log", env={**os.environ})  # fmt: skip
    try:
        procs.wait_for_port("127.0.0.1", port, 120, proc)
        pool = prompts(sequences, read_config(model_dir).vocab_size)
        todo = iter(range(sequences))
        tokens = 0
        async with aiohttp.ClientSession() as http:

            async def client() -> None:
                nonlocal tokens
                for i in todo:
                    body = {"input_ids": pool[i], "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0,
                                                                      "ignore_eos": True}}  # fmt: skip
                    async with http.post(f"{url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
                        r.raise_for_status()
                        tokens += (await r.json())["meta_info"]["completion_tokens"]

            t0 = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(conc)))
            return tokens / (time.perf_counter() - t0)
    finally:
        procs.stop(proc)


def cell(arm: str, model_dir: Path, conc: int, a, logs: Path) -> float:
    sequences = max(a.sequences, conc)
    if arm == "hf":
        return run_hf(model_dir, conc, sequences)
    if arm == "in-process":
        return run_in_process(model_dir, conc, sequences)
    return asyncio.run(run_http(model_dir, conc, sequences, a.threads, logs))


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.mean(xs) if len(xs) > 1 else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,25m", help=f"model sizes, of {', '.join(SIZES)}")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--sequences", type=int, default=64, help="sequences per cell (at least the concurrency)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads for every arm")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-enginebench-"))
    sizes = a.sizes.split(",")
    models = build_models(tmp / "models", sizes, context=PROMPT_LEN + NEW_TOKENS + 1)
    concs = [int(c) for c in a.concurrency.split(",")]
    cells = [(size, conc, arm) for size in sizes for conc in concs for arm in ARMS]
    results: dict[tuple, list[float]] = {c: [] for c in cells}
    for r in range(a.rounds):
        for size, conc, arm in cells if r % 2 == 0 else list(reversed(cells)):
            tps = cell(arm, models[size], conc, a, tmp)
            results[(size, conc, arm)].append(tps)
            print(f"  round {r + 1}, {size:>5} x{conc:<3} {arm:<10} {tps:9.0f} tokens/s", flush=True)
    rows = []
    print(f"\n{'size':>5} {'conc':>4} {'http':>16} {'in-process':>16} {'hf':>16} {'http/hf':>8} {'in-proc/hf':>10}")
    for size in sizes:
        for conc in concs:
            m = {arm: statistics.mean(results[(size, conc, arm)]) for arm in ARMS}
            s = {arm: spread(results[(size, conc, arm)]) for arm in ARMS}
            rows.append({"size": size, "concurrency": conc, **{f"{k}_tokens_per_s": v for k, v in m.items()},
                         **{f"{k}_spread": v for k, v in s.items()}})  # fmt: skip
            col = {arm: f"{m[arm]:8.0f} ±{s[arm]:4.0%}" for arm in ARMS}
            print(f"{size:>5} {conc:>4} {col['http']:>16} {col['in-process']:>16} {col['hf']:>16} "
                  f"{m['http'] / m['hf']:7.1f}x {m['in-process'] / m['hf']:9.1f}x")  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "settings": vars(a) | {"cpus": os.cpu_count()}}, indent=2))


if __name__ == "__main__":
    main()
