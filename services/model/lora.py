"""Many LoRA adapters on one base model, each row of a batch with its own adapter (or none).

`MultiLora(model, n_slots, max_rank, targets)` adds, for every target linear of every layer, the
stacked low-rank factors A [slots, max_rank, in] and B [slots, out, max_rank] and a per-slot
scale (alpha / rank). Inside `with lora.rows(slot_n):` every target linear returns
`W x + scale[s] * B[s] A[s] x` for a row whose slot is s, and `W x` for a row whose slot is -1:
one batch serves several adapters (the built-in engine), and one training batch trains several
(the trainer). An adapter of a smaller rank fills the first `rank` rows of A (and columns of B)
and leaves the rest zero, which adds exactly nothing. The base model is not modified: its
parameter names, snapshots and weight updates stay as they are (the factors hang on forward
hooks, not on replaced modules).

Where the factors attach is a model's `LoraSite`s: by default every target `nn.Linear` of the
built-in model (batch first, one module per factor pair, the delta added in place). A model with
other modules declares its own with `lora_sites(targets)`: the Megatron backend's fused QKV and
gate/up linears (sequence first) take the deltas of q, k, v (or gate, up) laid out as their fused
output. The factors are kept per Hugging Face module either way, so an adapter trained on either
backend is the same PEFT directory.

On disk an adapter is a PEFT LoRA directory, the format SGLang's `/load_lora_adapter` and
`--lora-paths` read: `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules) and
`adapter_model.safetensors` with `base_model.model.model.layers.{i}.{self_attn|mlp}.{m}.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]; the `.complete` marker is written last.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from asyncrl_proto.messages import MAX_LORA_SCALE
from services.common.procs import replace_file
from services.common.snapshot import COMPLETE_MARKER
from services.model.llama import CausalLM

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = ATTENTION + ("gate_proj", "up_proj", "down_proj")
_PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    """An adapter that does not fit this model (shapes, rank, targets) or holds NaN/inf."""


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ATTENTION

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise LoraError(f"rank must be at least 1, got {self.rank}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise LoraError(f"alpha must be positive, got {self.alpha}")
        if self.alpha / self.rank > MAX_LORA_SCALE:
            raise LoraError(f"alpha / rank is {self.alpha / self.rank:g}, above {MAX_LORA_SCALE:g}")
        unknown = sorted(set(self.target_modules) - set(TARGETS))
        if unknown or not self.target_modules:
            raise LoraError(f"target_modules must be among {', '.join(TARGETS)}, got {list(self.target_modules)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, base_model: str = "") -> dict:
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "target_modules": list(self.target_modules), "lora_dropout": 0.0, "bias": "none",
                "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": base_model}  # fmt: skip

    @classmethod
    def from_peft_config(cls, cfg: dict) -> LoraSpec:
        if cfg.get("peft_type", "LORA") != "LORA":
            raise LoraError(f"not a LoRA adapter: peft_type {cfg.get('peft_type')!r:.40}")
        targets = cfg.get("target_modules")
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise LoraError("adapter_config.json: target_modules must be a list of module names")
        rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
        if type(rank) is not int or not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise LoraError("adapter_config.json: r must be an integer and lora_alpha a number")
        if not math.isfinite(alpha):
            raise LoraError(f"adapter_config.json: lora_alpha must be finite, got {alpha}")
        unsupported = [k for k in ("use_rslora", "use_dora", "alpha_pattern", "rank_pattern") if cfg.get(k)]
        if unsupported:  # each changes the adapter's output: serving it without them would be silently wrong
            raise LoraError(f"adapter_config.json: {', '.join(unsupported)} is not supported (plain LoRA only)")
        return cls(rank=rank, alpha=float(alpha), target_modules=tuple(targets))


@dataclass(frozen=True)
class LoraSite:
    """A module whose forward output gets the adapter deltas of the HF modules `names` of `layer`:
    one name, or several fused into its output by `fuse` (their deltas, in `names` order, each
    [..., out of that module] -> [..., the module's out]). `batch_dim` is where batch rows are
    in its input and output (0: [batch, seq, features]; 1: [seq, batch, features])."""

    module: nn.Module
    layer: int
    names: tuple[str, ...]
    batch_dim: int = 0
    fuse: Callable[[list[torch.Tensor]], torch.Tensor] | None = None


def module_shape(cfg, name: str) -> tuple[int, int]:
    """(in, out) features of a Llama layer's HF module `name` under a model config."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}[name]  # fmt: skip


def peft_key(layer: int, name: str, factor: str) -> str:
    part = "self_attn" if name in ATTENTION else "mlp"
    return f"base_model.model.model.layers.{layer}.{part}.{name}.lora_{factor}.weight"


class MultiLora(nn.Module):
    def __init__(self, model: CausalLM, n_slots: int, max_rank: int, targets: Sequence[str] = TARGETS):
        super().__init__()
        if n_slots < 1 or max_rank < 1:
            raise LoraError(f"n_slots and max_rank must be at least 1, got {n_slots} and {max_rank}")
        LoraSpec(rank=max_rank, alpha=1.0, target_modules=tuple(targets))  # checks the names
        self.n_slots, self.max_rank, self.targets = n_slots, max_rank, tuple(targets)
        self.num_layers = model.cfg.num_hidden_layers
        self.out_features = {name: module_shape(model.cfg, name)[1] for name in TARGETS}
        ref = next(model.parameters())
        self.A = nn.ParameterDict()
        self.B = nn.ParameterDict()
        for i in range(self.num_layers):
            for name in self.targets:
                fan_in, fan_out = module_shape(model.cfg, name)
                self.A[f"l{i}_{name}"] = nn.Parameter(torch.zeros(n_slots, max_rank, fan_in, dtype=ref.dtype))
                self.B[f"l{i}_{name}"] = nn.Parameter(torch.zeros(n_slots, fan_out, max_rank, dtype=ref.dtype))
        if hasattr(model, "lora_sites"):
            sites = model.lora_sites(self.targets)
        else:  # the built-in model's: each target linear of a layer's attention or MLP
            blocks = model.model.layers
            sites = [LoraSite(getattr(blocks[i].self_attn if name in ATTENTION else blocks[i].mlp, name), i, (name,))
                     for i in range(self.num_layers) for name in self.targets]  # fmt: skip
        self._hooks = [site.module.register_forward_hook(self._hook(site)) for site in sites]
        self.register_buffer("scale", torch.zeros(n_slots, dtype=ref.dtype))
        self.specs: list[LoraSpec | None] = [None] * n_slots
        self._rows: tuple[int, list[tuple[int, int, int]]] | None = None
        """Inside rows(): (batch size, [(slot, first row, end row) of each run of one adapter])."""

    # ---- the forward -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def rows(self, slot_n: torch.Tensor | Sequence[int] | None) -> Iterator[None]:
        """Forward passes inside use adapter slot_n[i] for batch row i (-1: the base model). Rows
        of one adapter next to each other cost least (the engine sorts its batch by adapter)."""
        runs = None
        if slot_n is not None:  # (slot, first row, end row) of each run of one adapter
            slots = [int(x) for x in torch.as_tensor(slot_n, dtype=torch.long).flatten()]
            if any(not -1 <= x < self.n_slots for x in slots):
                raise LoraError(f"rows must be slot numbers in -1..{self.n_slots - 1}")
            ends = itertools.accumulate(len(list(run)) for _, run in itertools.groupby(slots))
            runs = (len(slots), [(slots[s], s, e) for s, e in itertools.pairwise([0, *ends])
                                 if slots[s] >= 0 and self.specs[slots[s]] is not None])  # fmt: skip
        previous, self._rows = self._rows, runs
        try:
            yield
        finally:
            self._rows = previous

    def _hook(self, site: LoraSite):
        def add_delta(_module: nn.Module, inputs: tuple, out):
            """The deltas of the site's modules for each run of rows of one adapter, two matmuls
            per run at the adapter's own rank. One linear: out[rows] += scale * (x A^T) B^T, in
            place, on views. Fused or sequence first: laid out by `fuse` (zeros for a module the
            adapter does not target), not in place: the output may be a tuple (Megatron's linears
            return (output, bias))."""
            if self._rows is None or not self._rows[1]:
                return None
            n, runs = self._rows
            y = out[0] if isinstance(out, tuple) else out
            bd = site.batch_dim
            if y.shape[bd] != n:
                raise LoraError(f"rows name {n} slots for a batch of {y.shape[bd]}")
            x = inputs[0]
            if not (site.fuse or bd):
                module, key = site.names[0], f"l{site.layer}_{site.names[0]}"
                for slot, s, e in runs:
                    spec = self.specs[slot]
                    if module not in spec.target_modules:  # its factors here are zero: nothing to add
                        continue
                    a, b = self.A[key][slot, : spec.rank], self.B[key][slot, :, : spec.rank]
                    h = x[s:e].reshape(-1, x.shape[-1]) @ a.t()
                    out[s:e].view(-1, out.shape[-1]).addmm_(h, b.t(), alpha=spec.scale)
                return out
            delta = torch.zeros_like(y)
            for slot, s, e in runs:
                spec, xs = self.specs[slot], x.narrow(bd, s, e - s)
                parts = []
                for name in site.names:
                    key = f"l{site.layer}_{name}"
                    if name in spec.target_modules and key in self.A:
                        a, b = self.A[key][slot, : spec.rank], self.B[key][slot, :, : spec.rank]
                        parts.append((xs @ a.t()) @ b.t() * spec.scale)
                    else:
                        parts.append(x.new_zeros(*xs.shape[:-1], self.out_features[name]))
                delta.narrow(bd, s, e - s).add_(site.fuse(parts) if site.fuse else parts[0])
            return (y + delta, *out[1:]) if isinstance(out, tuple) else y + delta

        return add_delta

    # ---- slots -----------------------------------------------------------------------------------
    def _check_spec(self, spec: LoraSpec) -> None:
        if spec.rank > self.max_rank:
            raise LoraError(f"rank {spec.rank} is above this model's max LoRA rank {self.max_rank}")
        if missing := sorted(set(spec.target_modules) - set(self.targets)):
            raise LoraError(f"target_modules {missing} are not served here (LoRA targets: {', '.join(self.targets)})")

    @torch.no_grad()
    def init_slot(self, slot: int, spec: LoraSpec, seed: int) -> None:
        """A fresh adapter: A uniform in +-1/sqrt(in) (PEFT's default), B zero, so it starts as the base."""
        self._check_spec(spec)
        self.clear_slot(slot)
        gen = torch.Generator().manual_seed(seed)
        for key in (f"l{i}_{m}" for i in range(self.num_layers) for m in spec.target_modules):
            a = self.A[key]
            bound = 1.0 / math.sqrt(a.shape[-1])
            a[slot, : spec.rank] = (torch.rand(spec.rank, a.shape[-1], generator=gen) * 2 - 1) * bound
        self.adopt_slot(slot, spec)

    @torch.no_grad()
    def adopt_slot(self, slot: int, spec: LoraSpec) -> None:
        """The slot holds an adapter of `spec` whose factors are already in place (written by
        init_slot, set_slot, or a broadcast from another trainer rank)."""
        self._check_spec(spec)
        self.scale[slot] = spec.scale
        self.specs[slot] = spec

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        for key in self.A:
            self.A[key][slot].zero_()
            self.B[key][slot].zero_()
        self.scale[slot] = 0.0
        self.specs[slot] = None

    def slot_tensors(self, slot: int) -> dict[str, torch.Tensor]:
        """The slot's adapter under PEFT names, trimmed to its rank (copies)."""
        spec = self.specs[slot]
        if spec is None:
            raise LoraError(f"slot {slot} holds no adapter")
        return {
            peft_key(i, m, f): self._factor(f"l{i}_{m}", f, slot, spec.rank).detach().clone()
            for i in range(self.num_layers)
            for m in spec.target_modules
            for f in "AB"
        }

    def _factor(self, key: str, factor: str, slot: int, rank: int) -> torch.Tensor:
        """A slot's factor A [rank, in] or B [out, rank] of the module `key`: a view."""
        return self.A[key][slot, :rank] if factor == "A" else self.B[key][slot, :, :rank]

    @torch.no_grad()
    def set_slot(self, slot: int, spec: LoraSpec, tensors: dict[str, torch.Tensor]) -> None:
        """Put an adapter (PEFT names, as slot_tensors or load_adapter give) into a slot, checked
        first: nothing changes unless every tensor fits and is finite."""
        self._check_spec(spec)
        want = {peft_key(i, m, f) for i in range(self.num_layers) for m in spec.target_modules for f in "AB"}
        missing, unexpected = sorted(want - set(tensors)), sorted(set(tensors) - want)
        if missing or unexpected:
            raise LoraError(f"the adapter does not match rank/targets: missing {missing[:3]}, unexpected "
                            f"{unexpected[:3]}")  # fmt: skip
        placed = []
        for name, t in tensors.items():
            layer, _, module, factor = _PEFT_KEY.match(name).groups()
            target = self._factor(f"l{layer}_{module}", factor, slot, spec.rank)
            if t.shape != target.shape:
                raise LoraError(f"{name} has shape {tuple(t.shape)}, this model needs {tuple(target.shape)}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise LoraError(f"{name} holds non-finite values (NaN or inf)")
            placed.append((target, t))
        self.clear_slot(slot)
        for target, t in placed:
            target.copy_(t)
        self.adopt_slot(slot, spec)


# ---- PEFT directories ------------------------------------------------------------------------------
def save_adapter(lora: MultiLora, slot: int, out_dir: str | Path, base_model: str = "") -> Path:
    """Write a slot's adapter as a PEFT directory: stale marker removed first, marker written last."""
    tensors = {k: v.contiguous().cpu() for k, v in lora.slot_tensors(slot).items()}  # LoraError for an empty slot
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / COMPLETE_MARKER).unlink(missing_ok=True)
    if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
        raise LoraError(f"refusing to write {out}: the adapter holds non-finite values")
    replace_file(out / "adapter_model.safetensors", save(tensors))  # a full disk is an OSError, as callers expect
    (out / "adapter_config.json").write_text(json.dumps(lora.specs[slot].peft_config(base_model), indent=2))
    (out / COMPLETE_MARKER).write_text("")
    return out


def load_adapter(path: str | Path) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A PEFT LoRA directory's spec and tensors (LoraError if it is not one this code reads)."""
    p = Path(path)
    try:
        cfg = json.loads((p / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"{p} is not a LoRA adapter directory (adapter_config.json: {e})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{p}/adapter_config.json is not a JSON object")
    spec = LoraSpec.from_peft_config(cfg)
    try:
        tensors = load_file(str(p / "adapter_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:  # a missing, truncated or corrupt file
        raise LoraError(f"{p}: cannot read adapter_model.safetensors ({e})") from None
    if bad := [k for k in tensors if not _PEFT_KEY.match(k)]:
        raise LoraError(f"{p}: {bad[0]!r:.120} is not a LoRA weight of a Llama layer")
    return spec, tensors


# ---- per-slot AdamW --------------------------------------------------------------------------------
class SlotAdamW:
    """AdamW on a MultiLora's factors, per slot: `step(slots)` updates only those slots (the adapters
    whose batch completed), each with its own step count (bias correction), and `reset(slot)`
    zeroes a slot's moments (when it is freed)."""

    def __init__(self, lora: MultiLora, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        self.params = list(lora.A.values()) + list(lora.B.values())
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.steps = [0] * lora.n_slots

    @torch.no_grad()
    def step(self, slots: Sequence[int]) -> None:
        b1, b2 = self.betas
        for s in slots:
            self.steps[s] += 1
            t = self.steps[s]
            c1, c2 = 1 - b1**t, 1 - b2**t
            for p, m, v in zip(self.params, self.m, self.v, strict=True):
                if p.grad is None:
                    continue
                g = p.grad[s]
                m[s].mul_(b1).add_(g, alpha=1 - b1)
                v[s].mul_(b2).addcmul_(g, g, value=1 - b2)
                if self.weight_decay:
                    p[s].mul_(1 - self.lr * self.weight_decay)
                p[s].addcdiv_(m[s] / c1, (v[s] / c2).sqrt_().add_(self.eps), value=-self.lr)

    @torch.no_grad()
    def reset(self, slot: int) -> None:
        for m, v in zip(self.m, self.v, strict=True):
            m[slot].zero_()
            v[slot].zero_()
        self.steps[slot] = 0
