"""Held-out datasets and their per-set settings: `--eval-prompt-data NAME PATH ...`, or Miles's
`--eval-config` (a YAML/JSON file, or `base64:<payload>` of one):

    eval:                        # optional wrapper
      defaults: {temperature: 0.6, n_samples_per_eval_prompt: 4}
      datasets:                  # a list of {name, path, ...}, or a mapping name -> {path, ...}
        - name: aime
          path: data/aime.jsonl
          max_response_len: 1024
          rm_type: reverse-digits
          metadata_overrides: {difficulty: hard}

Each setting resolves as Miles's: the dataset's value, else `defaults`, else the eval flag
(--n-samples-per-eval-prompt, --eval-temperature, --eval-top-p, --eval-max-response-len, ...),
else the rollout's. The launcher inlines the file (`base64:`), so services elsewhere read the
same document. This module imports no torch.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class EvalDataset:
    name: str
    path: str
    rm_type: str | None
    input_key: str
    label_key: str | None
    metadata_key: str | None
    n_samples_per_eval_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int
    stop_token_ids: list[int]
    metadata_overrides: dict[str, Any]

    def sampling_params(self) -> dict:
        return {"max_new_tokens": self.max_response_len, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "stop_token_ids": list(self.stop_token_ids)}  # fmt: skip


FIELDS = tuple(f.name for f in dataclasses.fields(EvalDataset) if f.name != "name")
"""A dataset's settings (--eval-config), in the order they resolve."""


def read_document(spec: str) -> dict:
    """--eval-config's document: `base64:<payload>` or a file (YAML, or JSON)."""
    if spec.startswith("base64:"):
        try:
            text = base64.b64decode(spec[len("base64:") :], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError) as e:
            raise ValueError(f"--eval-config base64 payload does not decode: {e}") from None
    else:
        try:
            text = Path(spec).read_text()
        except OSError as e:
            raise ValueError(f"--eval-config {spec}: {e.strerror}") from None
    import yaml  # a superset of JSON

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--eval-config is not YAML or JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError("--eval-config must contain a mapping at the root.")
    return doc


def dataset_entries(doc: dict) -> tuple[list[dict], dict]:
    eval_cfg = doc.get("eval", doc)
    if not isinstance(eval_cfg, dict):
        raise ValueError("--eval-config must define an `eval` mapping or be a mapping itself.")
    defaults = eval_cfg.get("defaults") or {}
    raw = eval_cfg.get("datasets")
    if isinstance(raw, dict):
        entries = [{**(cfg or {}), "name": cfg.get("name", name) if cfg else name} for name, cfg in raw.items()]
    else:
        entries = [dict(item or {}) for item in raw] if isinstance(raw, list) else []
        if any("name" not in e for e in entries):
            raise ValueError("Each evaluation dataset entry must include a `name` field.")
    if not entries:
        raise ValueError("--eval-config does not define any datasets under `eval.datasets`.")
    if not isinstance(defaults, dict):
        raise ValueError("--eval-config `defaults` must be a mapping.")
    return entries, defaults


def eval_dataset_configs(config) -> list[EvalDataset]:
    """The run's held-out sets with every setting resolved (see the module)."""
    if config.eval.config:
        entries, defaults = dataset_entries(read_document(config.eval.config))
    else:
        pairs = config.eval.prompt_data
        entries, defaults = [{"name": pairs[i], "path": pairs[i + 1]} for i in range(0, len(pairs), 2)], {}
    if unknown := sorted({k for e in (*entries, defaults) for k in e} - {"name", *FIELDS}):
        raise ValueError(f"--eval-config: unsupported dataset settings {unknown}; supported: {list(FIELDS)}")
    d, e, r = config.data, config.eval, config.rollout
    flags = {"input_key": d.input_key, "label_key": d.label_key, "metadata_key": d.metadata_key,
             "n_samples_per_eval_prompt": e.n_samples_per_eval_prompt, "temperature": e.temperature,
             "top_p": e.top_p if e.top_p is not None else r.top_p, "top_k": r.top_k,
             "max_response_len": e.max_response_len or r.max_response_len,
             "stop_token_ids": list(r.stop_token_ids), "rm_type": None, "metadata_overrides": {}}  # fmt: skip
    if no_path := [e["name"] for e in entries if "path" not in e]:
        raise ValueError(f"--eval-config: dataset {no_path[0]!r} has no `path`")
    out = [EvalDataset(name=str(e["name"]), **{k: e.get(k, defaults.get(k, flags.get(k))) for k in FIELDS})
           for e in entries]  # fmt: skip
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--eval-config: dataset names must be unique (got {names})")
    return out


def load_eval_sets(config, check=None) -> list[tuple[EvalDataset, list[dict]]]:
    """Every held-out set with its rows (its own keys; `metadata_overrides` merged into each
    row's metadata, and `rm_type` recorded there as Miles does); `check`: a row check
    (datasource.load_rows), also run on the set's own rm_type."""
    from services.data.source import load_rows

    out = []
    for ds in eval_dataset_configs(config):
        if check is not None and ds.rm_type is not None and (problem := check({"metadata": {"rm_type": ds.rm_type}})):
            raise ValueError(f"eval dataset {ds.name}: {problem}")
        rows = load_rows(ds.path, ds.input_key, ds.label_key, ds.metadata_key, check, config.data.tool_key)
        rm_type = {"rm_type": ds.rm_type} if ds.rm_type is not None else {}
        for row in rows:
            row["metadata"] = {**(row.get("metadata") or {}), **ds.metadata_overrides, **rm_type}
        out.append((ds, rows))
    return out
