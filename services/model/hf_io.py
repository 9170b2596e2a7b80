"""Hugging Face checkpoint I/O: config.json + model.safetensors + tokenizer files.

A snapshot directory counts only once its `.complete` marker exists: the writer deletes a stale
marker first and writes it last, so a reader never loads a half-written snapshot.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Generator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from services.common import crash
from services.common.snapshot import COMPLETE_MARKER
from services.model.llama import CausalLM, ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def read_config(path: str | Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((Path(path) / "config.json").read_text()))


def _weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("model-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors in {path}")
    return files


class NonFiniteWeights(ValueError):
    """A weight tensor holds NaN or inf: never loaded into an engine, never written out."""


def check_finite(state: dict[str, torch.Tensor], where: str) -> None:
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteWeights(f"{where}: {name} holds non-finite values (NaN or inf)")


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a snapshot; NonFiniteWeights if any holds NaN or inf."""
    state = {name: t for f in _weight_files(Path(path)) for name, t in load_file(str(f)).items()}
    check_finite(state, f"snapshot {path}")
    return state


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    model = CausalLM(read_config(path))
    load_weights_into(model, path)
    return model.to(dtype)


def load_weights_into(model: CausalLM, path: str | Path) -> None:
    """Copy a snapshot's weights into an existing model in place (the engine's weight update).
    A model in another layout (the Megatron backend) converts through load_hf_state_dict."""
    if hasattr(model, "load_hf_state_dict"):
        model.load_hf_state_dict(load_state_dict(path))
        return
    staged = stage_weights(model, path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(staged[name])


def stage_weights(model: CausalLM, path: str | Path) -> dict[str, torch.Tensor]:
    """A snapshot's weights as new tensors matching `model`'s parameters (names, shapes, dtypes),
    read without touching the model: the engine stages the next version this way while it keeps
    generating. ValueError when the snapshot does not fit the model; NonFiniteWeights on NaN/inf."""
    return run_to_end(iter_stage_weights(model, path))


def run_to_end(gen: Generator):
    """Run a generator to its end; its return value (a chunked job done all at once)."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def iter_stage_weights(model: CausalLM, path: str | Path) -> Generator[None, None, dict[str, torch.Tensor]]:
    """stage_weights one tensor at a time: yields after each, returns the tensors. The names and
    shapes are checked from the files' headers before any tensor is read."""
    files = _weight_files(Path(path))
    own = dict(model.named_parameters())
    shapes: dict[str, tuple] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            shapes.update((n, tuple(fh.get_slice(n).get_shape())) for n in fh.keys())
    missing = sorted(set(own) - set(shapes))
    unexpected = sorted(set(shapes) - set(own) - {"lm_head.weight"})  # a tied lm_head is the embedding
    if missing or unexpected:
        raise ValueError(f"snapshot {path} does not match the model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")  # fmt: skip
    if wrong := [n for n, p in own.items() if shapes[n] != tuple(p.shape)]:
        raise ValueError(f"snapshot {path} does not match the model: {wrong[0]} has shape "
                         f"{shapes[wrong[0]]}, the model's is {tuple(own[wrong[0]].shape)}")  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for n in fh.keys():
                if n in own:
                    t = fh.get_tensor(n)
                    check_finite({n: t}, f"snapshot {path}")
                    out[n] = t.to(own[n].dtype).contiguous()
                    yield
    return out


def swap_in(model: CausalLM, staged: dict[str, torch.Tensor]) -> None:
    """Make staged tensors (stage_weights) the model's parameters: one pointer per tensor, no copy,
    so the time is independent of the model's size."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = staged[name]


def hf_state(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under their HF names, as a snapshot holds them (a tied lm_head is
    left out): detached, not copied, on the model's device."""
    raw = model.hf_state_dict() if hasattr(model, "hf_state_dict") else model.state_dict()
    state = {k: v.detach() for k, v in raw.items()}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_model(model: CausalLM, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> dict:
    """Write an HF snapshot atomically enough for readers: stale marker removed first, weights
    and config written, marker last. Returns {"sha256", "num_bytes"} of the weights file.
    NonFiniteWeights (nothing written) when a weight holds NaN or inf."""
    out = Path(out_dir)
    state = {k: v.contiguous().cpu() for k, v in hf_state(model).items()}
    check_finite(state, f"refusing to write {out}")
    out.mkdir(parents=True, exist_ok=True)
    marker = out / COMPLETE_MARKER
    marker.unlink(missing_ok=True)
    weights = out / "model.safetensors"
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    if os.path.getsize(tmp) < sum(t.numel() * t.element_size() for t in state.values()):
        raise OSError(errno.ENOSPC, "the weights file came out short (is the disk full?)", str(tmp))
    os.replace(tmp, weights)
    (out / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(), indent=2))
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != out.resolve():
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.exists():
                shutil.copyfile(src, out / name)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    crash.point("trainer", "weights_export")  # written, not yet complete
    marker.write_text(json.dumps({"sha256": digest}))
    return {"sha256": digest, "num_bytes": weights.stat().st_size}
