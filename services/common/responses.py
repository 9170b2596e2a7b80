"""What an answer of SGLang's /generate means for a Sample: its tokens, log-probs, status and the
weight versions that produced it. The producer, the eval service and the multi-turn tasks apply
answers the same way."""

from __future__ import annotations

from asyncrl_proto.messages import Sample, SampleStatus

FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}
ENGINE_META = {"cached_tokens": 0, "num_retractions": 0, "e2e_latency": 0.0}
"""meta_info entries kept in a sample's metadata["engine"], with their value when absent."""


def versions_of(meta: dict) -> list[int]:
    """The weight versions an engine reports for one /generate call: its version spans, else
    its weight_version; an unparsable one (SGLang's initial "default") is unknown."""
    if spans := meta.get("weight_versions"):
        return [int(s["version"]) for s in spans]
    v = meta.get("weight_version")
    try:
        return [int(v)]
    except (TypeError, ValueError):
        return []  # e.g. SGLang's initial "default": unknown, never filtered


def spans_of(meta: dict, n: int) -> list[tuple[int, int, int]]:
    """(start, end, version) of one /generate call's n output tokens: the engine's version spans,
    else its one weight_version over all of them; none when the version is unknown."""
    if spans := meta.get("weight_versions"):
        out = [(max(0, int(s["start"])), min(n, int(s["end"])), int(s["version"])) for s in spans]
        return [x for x in out if x[1] > x[0]]  # within the n tokens this call returned
    known = versions_of(meta)
    return [(0, n, known[0])] if known and n else []


def apply_response(sample: Sample, input_ids: list[int], resp: dict) -> None:
    """Append one /generate turn to a sample: tokens and log-probs from output_token_logprobs
    (whose ids equal output_ids), text, status from finish_reason, and every weight version
    that produced a token."""
    meta = resp.get("meta_info", {})
    pairs = meta.get("output_token_logprobs")
    new_tokens = list(resp.get("output_ids", [])) if pairs is None else [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) for p in pairs or []]
    if not sample.tokens:
        sample.tokens = list(input_ids)
    offset = sample.response_length
    for start, end, v in spans_of(meta, len(new_tokens)):
        if sample.version_spans and sample.version_spans[-1][1] == offset + start and sample.version_spans[-1][2] == v:
            sample.version_spans[-1][1] = offset + end  # one version across two turns' boundary: one span
        else:
            sample.version_spans.append([offset + start, offset + end, v])
    sample.tokens += new_tokens
    sample.response += resp.get("text", "")
    sample.response_length += len(new_tokens)
    sample.rollout_log_probs += logprobs
    reason = (meta.get("finish_reason") or {}).get("type", "stop")
    sample.status = FINISH_STATUS.get(reason, SampleStatus.COMPLETED)
    for v in versions_of(meta):
        if not sample.weight_versions or sample.weight_versions[-1] != v:
            sample.weight_versions.append(v)
    sample.metadata["engine"] = {k: meta.get(k, default) for k, default in ENGINE_META.items()}
