"""Multi-LoRA training pass: k adapters' steps as k separate forward + backward passes (what the
trainer does: each adapter on its own rows) against one pass over all their rows at once (each
row with its own adapter, as the engine batches them). It answers whether coalescing several
adapters' batches into one training pass would pay for a second code path in the trainer.

Per k in 1, 2, 4: every adapter's step is `--groups` groups x `--n` samples of `--seq` tokens on
the given model size with rank-`--rank` adapters on every target module; the loss is a stand-in
(mean log-sum-exp of the logits: the same forward and backward work as the policy loss). Both
ways run in alternating rounds (separate first, then combined first); the median of each round's
repeats is kept, and the spread between rounds is printed beside the ratio.

    python bench/multi_lora_train.py [--size 25m] [--rounds 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_models import SIZES, build_models  # bench/ is the script's folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="25m", help=f"model size, of {', '.join(SIZES)}")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--seq", type=int, default=24)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from services.model.hf_io import load_model
    from services.model.lora import TARGETS, LoraSpec, MultiLora

    root = Path(tempfile.mkdtemp(prefix="asyncrl-loratrain-"))
    model = load_model(build_models(root, [a.size], context=a.seq + 1)[a.size])
    model.requires_grad_(False)
    lora = MultiLora(model, 4, a.rank)
    for slot in range(4):
        lora.init_slot(slot, LoraSpec(rank=a.rank, alpha=2.0 * a.rank, target_modules=TARGETS), seed=slot)
    vocab, rows = model.cfg.vocab_size, a.groups * a.n
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (4 * rows, a.seq), generator=gen)

    def passes(slot_lists: list[list[int]]) -> None:
        start = 0
        for slots in slot_lists:
            x = ids[start : start + len(slots)]
            start += len(slots)
            with lora.rows(slots):
                model(x, torch.ones_like(x)).float().logsumexp(-1).mean().backward()
        lora.zero_grad(set_to_none=True)

    def timed(slot_lists: list[list[int]]) -> float:
        ts = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            passes(slot_lists)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    print(f"{a.size}: {a.groups} groups x {a.n} samples x {a.seq} tokens per adapter step, rank {a.rank}, "
          f"{a.threads} threads, {a.rounds} rounds")  # fmt: skip
    print(f"{'adapters':>8} {'separate ms':>12} {'combined ms':>12} {'combined speed-up':>18} {'spread':>7}")
    for k in (1, 2, 4):
        separate = [[s] * rows for s in range(k)]
        combined = [[s for s in range(k) for _ in range(rows)]]
        passes(combined)  # warm-up
        sep, comb = [], []
        for r in range(a.rounds):
            order = (("sep", separate), ("comb", combined)) if r % 2 == 0 else (("comb", combined), ("sep", separate))
            for name, lists in order:
                (sep if name == "sep" else comb).append(timed(lists))
        ratios = [s / c for s, c in zip(sep, comb, strict=True)]
        spread = (max(ratios) - min(ratios)) / 2
        print(f"{k:>8} {statistics.mean(sep) * 1e3:12.0f} {statistics.mean(comb) * 1e3:12.0f} "
              f"{statistics.mean(ratios):17.2f}x {spread:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
