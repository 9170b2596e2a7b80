"""Trainer checkpoints: `<save>/iter_<step>/` holds the model as an HF snapshot (hf/), the
optimizer, step, weight version and RNG state (trainer_state.pt), and a `.complete` marker
written last; `latest_checkpointed_iteration.txt` names the newest complete one."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch

from services.common.procs import replace_file
from services.common.snapshot import COMPLETE_MARKER, is_complete
from services.model.hf_io import load_weights_into, save_model

LATEST = "latest_checkpointed_iteration.txt"


def save_checkpoint(save_dir: str | Path, step: int, model, optimizer, version: int, tokenizer_dir) -> None:
    save_dir = Path(save_dir)
    path = save_dir / f"iter_{step:07d}"
    path.mkdir(parents=True, exist_ok=True)
    marker = path / COMPLETE_MARKER
    marker.unlink(missing_ok=True)
    save_model(model, path / "hf", tokenizer_dir)
    state = {"optimizer": optimizer.state_dict(), "step": step, "version": version, "torch_rng": torch.get_rng_state()}
    torch.save(state, path / "trainer_state.pt")
    marker.write_text(json.dumps({"step": step, "version": version}))
    replace_file(save_dir / LATEST, str(step))
    for old in _complete(save_dir)[:-2]:  # the two newest stay
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(save_dir: str | Path | None) -> Path | None:
    if not save_dir:
        return None
    save_dir = Path(save_dir)
    with contextlib.suppress(ValueError, FileNotFoundError, NotADirectoryError):
        path = save_dir / f"iter_{int((save_dir / LATEST).read_text().strip()):07d}"
        if is_complete(path):  # LATEST, written after the checkpoint's marker, names the newest complete one
            return path
    return next(reversed(_complete(save_dir)), None)  # e.g. LATEST lost


def _complete(save_dir: Path) -> list[Path]:
    return sorted(p for p in save_dir.glob("iter_*") if is_complete(p))


def load_checkpoint(path: str | Path, model, optimizer) -> dict:
    path = Path(path)
    load_weights_into(model, path / "hf")
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return {"step": state["step"], "version": state["version"]}
