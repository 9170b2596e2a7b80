"""The built-in engine's /metrics read as SGLang's: names, types, the latency histograms with
SGLang's buckets, the labels, process metrics; and the engine's command line labels it."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.engine.metrics import E2E_BUCKETS_S, QUEUE_BUCKETS_S, TTFT_BUCKETS_S, engine_metrics

PROMPT = [1, 5, 6, 7, 15]


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def histogram(fam) -> tuple[list[float], float]:
    """(the finite upper bounds, the count)."""
    bounds = [float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    count = next(s.value for s in fam.samples if s.name.endswith("_count"))
    return bounds, count


async def test_engine_metrics_have_sglang_names_types_and_histograms(engine):
    engine_metrics(engine.server, run="run-x", instance="engine-7")
    body = {"input_ids": [PROMPT] * 3, "sampling_params": {"max_new_tokens": 4}}
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as c:
        assert (await c.post("/generate", json=body)).status_code == 200
        text = (await c.get("/metrics")).text
    fams = families(text)
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate", "gen_throughput"):
        assert fams[f"sglang:{name}"].type == "gauge", name
    for name in ("prompt_tokens", "generation_tokens", "cached_tokens", "num_requests", "num_aborted_requests",
                 "num_retracted_requests"):  # fmt: skip
        assert fams[f"sglang:{name}"].type == "counter", name
    assert fams["sglang:num_requests"].samples[0].value == 3
    for name, bounds in (("time_to_first_token_seconds", TTFT_BUCKETS_S), ("e2e_request_latency_seconds", E2E_BUCKETS_S),
                         ("queue_time_seconds", QUEUE_BUCKETS_S)):  # fmt: skip
        fam = fams[f"sglang:{name}"]
        assert fam.type == "histogram"
        assert histogram(fam) == ([float(b) for b in bounds], 3.0), name
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "process_start_time_seconds"} <= set(fams)
    for fam in fams.values():
        for s in fam.samples:
            assert (s.labels["run"], s.labels["service"], s.labels["instance"]) == ("run-x", "engine", "engine-7")
            if fam.name.startswith("sglang:"):
                assert s.labels["model_name"] and s.labels["tp_rank"] == "0"


def test_the_launcher_labels_every_engine_it_starts():
    from services.common.config import RunConfig
    from services.common.engine_commands import builtin_engine_command, builtin_engine_flags
    from services.engine.__main__ import parse_args

    config = RunConfig(run_id="run-x")
    cmd = builtin_engine_command("/m", 30000, builtin_engine_flags(config, 0, "engine-3"))
    args = parse_args(cmd[cmd.index("--model-path") :])
    assert (args.run_id, args.instance_id, args.nats_url) == ("run-x", "engine-3", None)


def test_sglang_tool_call_parser_reaches_the_built_in_engines_too():
    from services.common.config import RunConfig
    from services.common.config_load import split_passthrough
    from services.common.engine_commands import builtin_engine_command, builtin_engine_flags
    from services.engine.__main__ import parse_args

    for argv, want in ((["--sglang-tool-call-parser", "qwen25"], "qwen25"),
                       (["--sglang-tool-call-parser=hermes"], "hermes"), ([], None)):  # fmt: skip
        rest, found = split_passthrough(argv)
        config = RunConfig(sglang_server_args=found["sglang_server_args"])
        cmd = builtin_engine_command("/m", 30000, builtin_engine_flags(config, 0, "engine-0"))
        assert rest == [] and parse_args(cmd[cmd.index("--model-path") :]).tool_call_parser == want
