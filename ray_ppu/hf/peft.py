"""Hugging Face PEFT LoRA adapters ↔ ray_ppu's adapters.

A PEFT adapter directory holds ``adapter_config.json`` (r, lora_alpha, rank_pattern,
alpha_pattern, target_modules, target_parameters) and ``adapter_model.safetensors``, one
``lora_A`` [r, in] / ``lora_B`` [out, r] pair per adapted module, named after the transformers
model (``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``); each module's output
gains ``(alpha / r)·x·Aᵀ·Bᵀ``.

ray_ppu adapts Megatron-Core's fused linears, so:

* **out** (:func:`to_peft`): a ``linear_qkv`` adapter is q, k and v adapters sharing its A,
  each taking its rows of B (the grouped GQA row layout of :mod:`ray_ppu.hf.weights`);
  ``linear_fc1`` likewise gate and up; ``linear_proj`` → o_proj, ``linear_fc2`` → down_proj. A
  Qwen3-MoE model's experts are transformers 5's fused 3-D parameters, adapted by PEFT's
  ``target_parameters``: ``mlp.experts.gate_up_proj`` (from ``experts.linear_fc1``) and
  ``mlp.experts.down_proj``, A [E·r, in] grouped by expert, B [out, r·E] interleaved (column
  ``i·E + e`` is expert e's i-th). A vision-language model's adapters sit on its language
  model, whose modules PEFT sees under another prefix (Qwen2.5-VL in transformers 5:
  ``model.language_model.layers.…``): ``language`` renames them, and ``target_modules`` is
  then a regular expression over that prefix, since the vision tower has modules of the same
  short names (``mlp.gate_proj``) that the adapter leaves alone.
* **in** (:func:`adapter_tensors`): q / k / v adapters that share one A (an export of ours)
  become one ``linear_qkv`` adapter of that rank; otherwise they are stacked, A = [A_q; A_k;
  A_v] and B block-diagonal, an adapter of their summed rank whose output is exactly the three
  adapters' (a module left out is a zero block). Each B is rescaled by its module's alpha / r
  over the target's, and a layer of lower rank than the target's is padded with zeros, which
  stay zero in training (their gradients are zero), so the run starts at exactly the PEFT
  model's outputs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from ray_ppu.config.lora import LoraConfig
from ray_ppu.config.schema import ModelConfig
from ray_ppu.errors import ConfigError
from ray_ppu.hf import peft_modules, weights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# target → (Megatron's weight key, whose row layout B shares; the HF modules it stands for)
HF_MODULES = {
    "linear_qkv": (weights.QKV, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "linear_proj": (weights.PROJ, ("self_attn.o_proj",)),
    "linear_fc1": (weights.FC1, ("mlp.gate_proj", "mlp.up_proj")),
    "linear_fc2": (weights.FC2, ("mlp.down_proj",)),
}
# transformers 5's fused expert parameters (Qwen3-MoE), adapted by PEFT's target_parameters
EXPERT_PARAMETERS = {"experts.linear_fc1": "mlp.experts.gate_up_proj",
                     "experts.linear_fc2": "mlp.experts.down_proj"}
# checkpoint keys of each target's adapter (a leading layer axis; experts: an expert axis too)
ADAPTER_KEYS = {"linear_qkv": "decoder.layers.self_attention.linear_qkv_lora",
                "linear_proj": "decoder.layers.self_attention.linear_proj_lora",
                "linear_fc1": "decoder.layers.mlp.linear_fc1_lora",
                "linear_fc2": "decoder.layers.mlp.linear_fc2_lora",
                "experts.linear_fc1": "decoder.layers.mlp.experts.experts.linear_fc1_lora",
                "experts.linear_fc2": "decoder.layers.mlp.experts.experts.linear_fc2_lora"}


def target_of_key(key: str) -> tuple[str, str]:
    """(target, "a" or "b") of an adapter checkpoint key."""
    stem, _, piece = key.rpartition(".")
    for target, known in ADAPTER_KEYS.items():
        if stem == known:
            return target, piece
    raise KeyError(f"{key} is no adapter key ray_ppu writes")


# ---------------------------------------------------------------------------------------------
# reading a PEFT adapter
# ---------------------------------------------------------------------------------------------

@dataclass
class PeftAdapter:
    """A PEFT LoRA adapter directory, read whole (adapters are small: MBs, not GBs)."""

    path: Path
    config: dict
    tensors: dict[str, torch.Tensor]
    saved: dict[str, torch.Tensor] = field(default_factory=dict)
    """A vision-language model's projector / merger saved whole (PEFT's modules_to_save), by
    module path (:mod:`ray_ppu.hf.peft_modules`)."""

    def module(self, name: str) -> Optional[tuple[torch.Tensor, torch.Tensor, float]]:
        """(A, B, alpha / r) of the adapted module ``name`` (``model.layers.3.self_attn.
        q_proj``), or None if the adapter leaves it alone."""
        a = self.tensors.get(f"{PREFIX}{name}.lora_A.weight")
        b = self.tensors.get(f"{PREFIX}{name}.lora_B.weight")
        if a is None or b is None:
            return None
        return a.float(), b.float(), self.scale(name, a.shape[0])

    def scale(self, name: str, rank: int) -> float:
        """alpha / r of a module (alpha_pattern as PEFT matches it; rsLoRA: alpha / √r). For
        an expert parameter, r is one expert's rank."""
        alpha = self.config.get("lora_alpha", 8)
        for pattern, value in (self.config.get("alpha_pattern") or {}).items():
            if re.match(rf"(.*\.)?({pattern})$", name):
                alpha = value
                break
        return alpha / (rank ** 0.5 if self.config.get("use_rslora") else rank)


def read_adapter(path: str | Path, what: str = "lora.adapter") -> PeftAdapter:
    """Read a PEFT adapter directory; a ConfigError (``what``: the setting that named it)
    names what ray_ppu cannot reproduce."""
    from safetensors.torch import load_file

    path = Path(path).expanduser().resolve()
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"{what} {path}: no {CONFIG_FILE} (a PEFT adapter directory holds it "
                          f"and {WEIGHTS_FILE})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{what} {path / CONFIG_FILE}: not JSON ({err})") from None
    if not (path / WEIGHTS_FILE).is_file():
        raise ConfigError(f"{what} {path}: no {WEIGHTS_FILE} (only safetensors adapters are "
                          f"read: no pickles)")
    unsupported = [f"{key}={config.get(key)!r}" for key, fine in (
        ("peft_type", "LORA"), ("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"),
        ("lora_bias", False)) if config.get(key, fine) not in (fine, [])]
    lora, saved = peft_modules.split(load_file(str(path / WEIGHTS_FILE)), PREFIX)
    unsupported += peft_modules.problems(config, lora, saved, PREFIX)
    if unsupported:
        raise ConfigError(f"{what} {path}: {', '.join(unsupported)} (ray_ppu reads plain LoRA "
                          f"adapters without DoRA or biases)")
    return PeftAdapter(path, config, lora, saved)


def _expert_modules(adapter: PeftAdapter, layer: int) -> dict[str, str]:
    """{target: the PEFT module holding it} of a layer's expert parameters. PEFT wraps
    ``experts`` once per targeted parameter, gate_up_proj first: with both targeted,
    gate_up's adapter is the inner one (``experts.base_layer``)."""
    targeted = [t for t, param in EXPERT_PARAMETERS.items()
                if any(p.endswith(param.split(".", 1)[1])
                       for p in adapter.config.get("target_parameters") or [])]
    stem = f"model.layers.{layer}.mlp.experts"
    if len(targeted) == 2:
        return {"experts.linear_fc1": f"{stem}.base_layer", "experts.linear_fc2": stem}
    return {t: stem for t in targeted}


def _experts_of(adapter: PeftAdapter, model: ModelConfig, target: str, layer: int):
    """Per expert (A [r, in], B [out, r], scale) of a 3-D expert parameter's adapter."""
    name = _expert_modules(adapter, layer).get(target)
    found = adapter.module(name) if name else None
    if found is None:
        return None
    a, b, _ = found
    n = model.num_moe_experts
    r = a.shape[0] // n
    scale = adapter.scale(name, r)
    b = b.reshape(b.shape[0], r, n)
    return [(a[e * r:(e + 1) * r], b[:, :, e], scale) for e in range(n)]


def adapter_tensors(adapter: PeftAdapter, model: ModelConfig, target: str, layer: int,
                    expert: Optional[int] = None, rank: Optional[int] = None,
                    scale: Optional[float] = None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The full (A [rank, in], B [out, rank]) of ray_ppu's ``target`` adapter at ``layer``
    (and ``expert``), fp32, in Megatron's row layout, its B scaled for ``scale``; None when
    the PEFT adapter adapts none of its modules there. ``rank`` None: the natural rank (no
    padding), ``scale`` None: the first module's (what :func:`lora_section` derives)."""
    if target in EXPERT_PARAMETERS:
        per_expert = _experts_of(adapter, model, target, layer)
        if per_expert is None:
            return None
        parts = [("expert", *per_expert[expert])]
    else:
        key, names = HF_MODULES[target]
        found = {n: adapter.module(f"model.layers.{layer}.{n}") for n in names}
        parts = [(n, *v) for n, v in found.items() if v is not None]
        if not parts:
            return None
    scale = parts[0][3] if scale is None else scale
    shared = all(torch.equal(p[1], parts[0][1]) for p in parts)
    if shared:  # one A for all (an export of ours): B's rows side by side
        a = parts[0][1]
        rows = {n: b * (s / scale) for n, _, b, s in parts}
        columns = {n: (0, a.shape[0]) for n, *_ in parts}
    else:  # stacked: A = [A_1; A_2; …], each B in its own columns
        a = torch.cat([p[1] for p in parts])
        rows, columns, at = {}, {}, 0
        for n, pa, b, s in parts:
            rows[n], columns[n] = b * (s / scale), (at, at + pa.shape[0])
            at += pa.shape[0]
    rank = a.shape[0] if rank is None else rank
    if a.shape[0] > rank:
        raise ConfigError(f"lora.adapter {adapter.path}: layer {layer}'s {target} adapter has "
                          f"rank {a.shape[0]}, above the {rank} the run builds")
    a = torch.cat([a, a.new_zeros(rank - a.shape[0], a.shape[1])])
    if target in EXPERT_PARAMETERS:
        b = a.new_zeros(rows["expert"].shape[0], rank)
        b[:, :columns["expert"][1]] = rows["expert"]
        return a, b
    return a, _megatron_rows(model, target, layer, rows, columns, rank)


def _megatron_rows(model: ModelConfig, target: str, layer: int, rows: dict, columns: dict,
                   rank: int) -> torch.Tensor:
    """B [out, rank] in Megatron's row order from the HF modules' B rows (zeros for a module
    the adapter leaves alone), each in its own columns."""
    key, names = HF_MODULES[target]
    hf = f"model.layers.{layer}."
    out = []
    for piece in weights.pieces(model, model.vocab_size, key, layer):
        module = piece.name.removeprefix(hf).removesuffix(".weight")
        block = torch.zeros(piece.rows, rank)
        if module in rows:
            lo, hi = columns[module]
            block[:, lo:hi] = rows[module][piece.start:piece.start + piece.rows]
        out.append(block)
    return torch.cat(out)


def lora_section(adapter: PeftAdapter, model: ModelConfig) -> dict:
    """The lora section a run starting from ``adapter`` has: its targets, and per target the
    highest rank a layer's adapter has once stacked, with the alpha that keeps the first
    module's alpha / r (so B needs no rescaling where the modules share it)."""
    from ray_ppu.config.lora import DENSE_TARGETS, MOE_TARGETS

    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for target in (MOE_TARGETS if model.is_moe else DENSE_TARGETS):
        experts = range(model.num_moe_experts) if target in EXPERT_PARAMETERS else [None]
        for layer in range(model.num_layers):
            found = adapter_tensors(adapter, model, target, layer, experts[0])
            if found is None:
                continue
            r = found[0].shape[0]
            if r > ranks.get(target, 0):
                ranks[target] = r
                scale = _first_scale(adapter, model, target, layer)
                alphas[target] = scale * r
    if not ranks:
        raise ConfigError(f"lora.adapter {adapter.path}: adapts no module ray_ppu maps (q/k/v/o, "
                          f"gate/up/down projections, Qwen3-MoE experts) of this "
                          f"{model.num_layers}-layer model")
    return {"enabled": True, "target_modules": list(ranks), "rank_pattern": ranks,
            "alpha_pattern": alphas}


def _first_scale(adapter: PeftAdapter, model: ModelConfig, target: str, layer: int) -> float:
    if target in EXPERT_PARAMETERS:
        return _experts_of(adapter, model, target, layer)[0][2]
    for n in HF_MODULES[target][1]:
        found = adapter.module(f"model.layers.{layer}.{n}")
        if found is not None:
            return found[2]
    raise AssertionError(target)


# ---------------------------------------------------------------------------------------------
# writing a PEFT adapter
# ---------------------------------------------------------------------------------------------

def to_peft(model: ModelConfig, target: str, layer: int, a: torch.Tensor,
            b: torch.Tensor, both_expert_targets: bool,
            language: Callable[[str], str] = lambda name: name
            ) -> list[tuple[str, torch.Tensor]]:
    """PEFT tensors of one layer's ``target`` adapter (whole, Megatron layout; experts: A
    [E, r, in], B [E, out, r]); ``language`` maps a causal LM's module name
    (``model.layers.…``) to the adapted model's."""
    if target in EXPERT_PARAMETERS:
        n, r = a.shape[0], a.shape[1]
        stem = f"model.layers.{layer}.mlp.experts"
        if both_expert_targets and target == "experts.linear_fc1":
            stem += ".base_layer"
        return [(f"{PREFIX}{stem}.lora_A.weight", a.reshape(n * r, a.shape[2])),
                (f"{PREFIX}{stem}.lora_B.weight",
                 b.permute(1, 2, 0).reshape(b.shape[1], r * n))]  # column i·E + e
    key = HF_MODULES[target][0]
    out = []
    for name, rows in weights.to_hf(model, model.vocab_size, key, layer, b):
        module = language(name.removesuffix(".weight"))
        out += [(f"{PREFIX}{module}.lora_A.weight", a.clone()),
                (f"{PREFIX}{module}.lora_B.weight", rows)]
    return out


def adapter_config(model: ModelConfig, lora: LoraConfig, base: Optional[str],
                   layers: Optional[str] = None,
                   modules_to_save: Optional[list[str]] = None) -> dict:
    """adapter_config.json for the exported adapter: the most common rank and alpha as r and
    lora_alpha, the others in rank_pattern / alpha_pattern. ``layers``: the language model's
    layers' prefix in a vision-language model (``model.language_model.layers``): the targets
    are then matched under it alone. ``modules_to_save``: modules saved whole (a trained
    projector)."""
    targets = lora.targets(model.is_moe)
    short = {t: [n.rpartition(".")[2] for n in HF_MODULES[t][1]]
             for t in targets if t in HF_MODULES}
    ranks = {t: lora.rank_of(t) for t in targets}
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    alpha = lora.alpha_of(next(t for t in targets if ranks[t] == r))
    rank_pattern, alpha_pattern = {}, {}
    for t in targets:
        names = short.get(t, [EXPERT_PARAMETERS.get(t, t)])
        for name in names:
            if ranks[t] != r:
                rank_pattern[name] = ranks[t]
            if lora.alpha_of(t) != alpha:
                alpha_pattern[name] = lora.alpha_of(t)
    modules = sorted(n for names in short.values() for n in names)
    if layers is not None:  # PEFT full-matches a string against each module's name
        whole = sorted(n for t in targets if t in HF_MODULES for n in HF_MODULES[t][1])
        modules = rf"{re.escape(layers)}\.\d+\.({'|'.join(map(re.escape, whole))})"
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": r, "lora_alpha": alpha, "lora_dropout": lora.dropout,
        "target_modules": modules,
        "target_parameters": [EXPERT_PARAMETERS[t] for t in targets if t in EXPERT_PARAMETERS]
        or None,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": modules_to_save, "inference_mode": True,
    }


# ---------------------------------------------------------------------------------------------
# into a model's adapters
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def load_into(chunks: list, adapter: PeftAdapter, model: ModelConfig, lora: LoraConfig,
              vision=None) -> int:
    """Set this rank's adapters (any TP / PP / EP) from ``adapter``: each adapter shard is its
    region of the full tensor :func:`adapter_tensors` builds (zeros where the PEFT adapter
    leaves the module alone: an adapter that adds nothing, and stays so); and a
    vision-language model's saved projector / merger (``vision``: its section). Returns the
    adapter shards set."""
    from ray_ppu.config.lora import is_adapter_key
    from ray_ppu.util.wrappers import unwrap

    full: dict = {}
    done = 0
    for chunk in chunks:
        for sh in weights._sharded_tensors(unwrap(chunk)):
            if not is_adapter_key(sh.key):
                continue
            target, piece = target_of_key(sh.key.removeprefix("language_model."))
            prepend = sh.prepend_axis_num
            layer = sh.global_offset[0]
            expert = sh.global_offset[1] if prepend > 1 else None
            if (target, layer, expert) not in full:
                full[target, layer, expert] = adapter_tensors(
                    adapter, model, target, layer, expert, lora.rank_of(target),
                    lora.scale_of(target))
            tensors = full[target, layer, expert]
            if tensors is None:
                sh.data.zero_()
            else:
                region = tensors[0 if piece == "a" else 1]
                for dim, (start, size) in enumerate(zip(sh.global_offset[prepend:],
                                                        sh.local_shape)):
                    region = region.narrow(dim, start, size)
                sh.data.copy_(region)
            done += 1
    peft_modules.load_saved(chunks, adapter.saved, model, vision)
    return done
