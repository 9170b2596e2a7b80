"""A synthetic long-tail rollout workload (for bench/scheduler.py and experiments).

Every trajectory's length is drawn from a Pareto distribution - most are short, a few are very
long - and generated in full (`ignore_eos`), the shape that makes a group wait for its slowest
sample. Lengths are a pure function of the sample index, so every mode of a benchmark gets the
same workload. Use it as a plugin:

    --custom-generate-function-path services.tasks.longtail.generate
    --custom-rm-path services.tasks.longtail.reward

Tuned with environment variables (they reach every producer process): ASYNCRL_LONGTAIL_MIN
(default 4), ASYNCRL_LONGTAIL_MAX (default 200), ASYNCRL_LONGTAIL_ALPHA (default 1.2).
"""

from __future__ import annotations

import os
import random

from asyncrl_proto.messages import Sample
from services.common.responses import apply_response
from services.tasks.reverse_digits import score


def response_length(index: int) -> int:
    lo = int(os.environ.get("ASYNCRL_LONGTAIL_MIN", "4"))
    hi = int(os.environ.get("ASYNCRL_LONGTAIL_MAX", "200"))
    alpha = float(os.environ.get("ASYNCRL_LONGTAIL_ALPHA", "1.2"))
    return min(hi, int(lo * random.Random(index).paretovariate(alpha)))


async def generate(config, sample: Sample, engine, sampling_params: dict) -> Sample:
    input_ids = sample.metadata.pop("_input_ids")
    params = {**sampling_params, "max_new_tokens": response_length(sample.index or 0), "ignore_eos": True}
    resp = await engine.generate(input_ids, params, rid=f"s{sample.index}-lt")
    apply_response(sample, input_ids, resp)
    return sample


async def reward(config, sample: Sample) -> float:
    return score(sample.response[: len(str(sample.label))], str(sample.label))
