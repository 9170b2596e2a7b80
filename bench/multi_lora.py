"""Multi-LoRA benchmark: the built-in engine's throughput serving 1, 2 and 4 LoRA adapters at once
against the base model alone, on the same engine process, model and machine.

Arms (each an engine process, `--enable-lora`, with 4 adapters loaded; N closed-loop clients on
/generate over HTTP, as the producers drive it):
  base     no lora_path: the full model alone (the single-model run)
  k=1,2,4  request i names adapter i mod k: every batch holds rows of k adapters
Every request: a 16-token prompt, 48 new tokens sampled at temperature 1, EOS ignored. Samples/s
are requests finished per wall second. Arms alternate in rounds (forward, then backward); the
spread between rounds is printed beside each figure. The goal: 4 adapters at least 80% of one.

    python bench/multi_lora.py [--size 25m] [--concurrency 32] [--requests 128] [--rank 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch
from bench_models import SIZES, build_models  # bench/ is the script's folder

from services.common import procs

PROMPT_LEN, NEW_TOKENS = 16, 48
ARMS = ("base", "k=1", "k=2", "k=4")


def make_adapters(model_dir: Path, out: Path, rank: int) -> list[Path]:
    """Four random adapters (B non-zero, so they change the output) on every target module."""
    from services.model.hf_io import load_model
    from services.model.lora import TARGETS, LoraSpec, MultiLora, save_adapter

    lora = MultiLora(load_model(model_dir), n_slots=4, max_rank=rank)
    paths = []
    for slot in range(4):
        lora.init_slot(slot, LoraSpec(rank=rank, alpha=float(rank), target_modules=TARGETS), seed=slot)
        with torch.no_grad():
            for key in lora.B:
                lora.B[key][slot].normal_(0, 0.02)
        paths.append(save_adapter(lora, slot, out / f"adapter{slot}"))
    return paths


async def run_arm(url: str, arm: str, conc: int, requests: int, vocab: int) -> float:
    k = 0 if arm == "base" else int(arm.split("=")[1])
    g = torch.Generator().manual_seed(requests)
    prompts = torch.randint(3, vocab, (requests, PROMPT_LEN), generator=g).tolist()
    todo = iter(range(requests))
    async with aiohttp.ClientSession() as http:

        async def client() -> None:
            for i in todo:
                body = {"input_ids": prompts[i], "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0,
                                                                     "ignore_eos": True}}  # fmt: skip
                if k:
                    body["lora_path"] = f"adapter{i % k}"
                async with http.post(f"{url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
                    r.raise_for_status()
                    assert (await r.json())["meta_info"]["completion_tokens"] == NEW_TOKENS

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(conc)))
        return requests / (time.perf_counter() - t0)


async def measure(model_dir: Path, adapters: list[Path], a, logs: Path) -> dict[str, list[float]]:
    from services.model.hf_io import read_config

    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    lora_paths = [f"adapter{i}={p}" for i, p in enumerate(adapters)]
    proc = procs.spawn([sys.executable, "-m", "services.engine", "--model-path", str(model_dir), "--port", str(port),
                        "--torch-num-threads", str(a.threads), "--max-running-requests", str(a.concurrency),
                        "--max-lora-rank", str(a.rank), "--max-loras-per-batch", "4", "--lora-paths", *lora_paths],
                       log_path=logs / f"engine-{port}.log", env={**os.environ})  # fmt: skip
    results: dict[str, list[float]] = {arm: [] for arm in ARMS}
    try:
        procs.wait_for_port("127.0.0.1", port, 120, proc)
        vocab = read_config(model_dir).vocab_size
        await run_arm(url, "k=4", a.concurrency, a.concurrency, vocab)  # warm-up, not counted
        for r in range(a.rounds):
            for arm in ARMS if r % 2 == 0 else tuple(reversed(ARMS)):
                sps = await run_arm(url, arm, a.concurrency, a.requests, vocab)
                results[arm].append(sps)
                print(f"  round {r + 1}, {arm:<5} {sps:8.1f} samples/s", flush=True)
    finally:
        procs.stop(proc)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="25m", help=f"model size, of {', '.join(SIZES)}")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=128, help="requests per arm and round")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-lorabench-"))
    model_dir = build_models(tmp / "models", [a.size], context=PROMPT_LEN + NEW_TOKENS + 1)[a.size]
    adapters = make_adapters(model_dir, tmp / "adapters", a.rank)
    results = asyncio.run(measure(model_dir, adapters, a, tmp))
    mean = {arm: statistics.mean(v) for arm, v in results.items()}
    spread = {arm: (max(v) - min(v)) / statistics.mean(v) if len(v) > 1 else 0.0 for arm, v in results.items()}
    print(f"\n{'arm':<6} {'samples/s':>10} {'spread':>7} {'of base':>8} {'of k=1':>7}")
    for arm in ARMS:
        print(f"{arm:<6} {mean[arm]:10.1f} {spread[arm]:6.0%} {mean[arm] / mean['base']:7.2f}x "
              f"{mean[arm] / mean['k=1']:6.2f}x")  # fmt: skip
    print(f"\n4 adapters: {mean['k=4'] / mean['k=1']:.0%} of one adapter's throughput (goal: at least 80%)")
    if a.out:
        Path(a.out).write_text(json.dumps({"samples_per_s": results, "mean": mean, "spread": spread,
                                           "settings": vars(a) | {"cpus": os.cpu_count()}}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
