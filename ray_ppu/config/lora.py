"""The ``lora`` section: low-rank adapters on a frozen base model.

Its own module, as the model section is, because the plan's arithmetic, the model build, the
checkpoints and the Hugging Face PEFT mapping all read it, and the names it uses (the targets)
are shared by all of them: :data:`DENSE_TARGETS` / :data:`MOE_TARGETS` are Megatron-Core's
module names, the ones a ``--dry-run`` and a checkpoint show.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

# A dense layer's four linears, in Megatron-Core's names (HF: q/k/v_proj fused, o_proj,
# gate/up_proj fused, down_proj).
DENSE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# A MoE layer (every layer of a ray_ppu MoE model): attention, and each routed expert's MLP.
MOE_TARGETS = ("linear_qkv", "linear_proj", "experts.linear_fc1", "experts.linear_fc2")
# Parts of the base model that may train beside the adapters.
TRAINABLE_PARTS = ("embedding", "output_layer", "norms", "router")
# Column-parallel targets (the output dimension is split over TP: B is sharded, A replicated);
# the others are row-parallel (A sharded along the input, B replicated).
COLUMN_TARGETS = ("linear_qkv", "linear_fc1", "experts.linear_fc1")
# The names users write for targets, as PEFT, transformers and ms-swift spell them: each is
# the Megatron-Core linear that holds that projection (q, k and v are one fused linear_qkv, gate
# and up one linear_fc1: an adapter on it adapts all of them). On a MoE model the MLP names are
# each routed expert's. "all-linear" (PEFT, ms-swift) and "all" are every linear.
ALL_LINEAR = ("all-linear", "all")
HF_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
              "qkv_proj": "linear_qkv", "o_proj": "linear_proj", "gate_proj": "linear_fc1",
              "up_proj": "linear_fc1", "gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}


def canonical_targets(name: str, is_moe: bool) -> tuple[str, ...]:
    """The Megatron-Core targets a name stands for: itself, its Hugging Face projection's
    linear (``q_proj`` → ``linear_qkv``; an MLP's on a MoE model: ``experts.linear_fc1``), or
    every linear (``all-linear``). An unknown name stands for itself (the plan names it)."""
    if name in ALL_LINEAR:
        return MOE_TARGETS if is_moe else DENSE_TARGETS
    megatron = HF_TARGETS.get(name)
    if megatron is None:
        return (name,)
    if is_moe and megatron in ("linear_fc1", "linear_fc2"):
        return (f"experts.{megatron}",)
    return (megatron,)


# An adapter module sits beside the linear it adapts: linear_qkv → linear_qkv_lora, whose A
# and B are checkpointed as …self_attention.linear_qkv_lora.a / .b.
ADAPTER_SUFFIX = "_lora"


def is_adapter_key(key: str) -> bool:
    """Whether a parameter name or checkpoint key is an adapter's."""
    return f"{ADAPTER_SUFFIX}." in key


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on a frozen base: each target linear computes
    ``x·Wᵀ + (alpha / rank)·x·Aᵀ·Bᵀ`` with W frozen and A [rank, in], B [out, rank] trained
    (A drawn as PEFT draws it, B zero: the run starts at the base model's outputs). The base
    costs no gradients and no optimizer state. Off by default."""

    enabled: bool = False
    """Train adapters instead of every parameter. The base weights are read from
    checkpoint.pretrained (a Hugging Face directory) or checkpoint.load (a ray_ppu checkpoint
    with every weight) at every start; checkpoints hold what trains."""
    rank: int = 16
    """Rank of every adapter (PEFT: r), unless rank_pattern names its target. [≥ 1]"""
    alpha: float = 32.0
    """Scale numerator: an adapter's output is multiplied by alpha / rank (PEFT: lora_alpha). [> 0]"""
    dropout: float = 0.0
    """Dropout on an adapter's input during training (PEFT: lora_dropout), 0 ≤ dropout < 1."""
    target_modules: list[str] = field(default_factory=list)
    """Linears that get adapters, in Megatron-Core's names: linear_qkv, linear_proj,
    linear_fc1, linear_fc2 (dense models), experts.linear_fc1 / experts.linear_fc2 (every
    routed expert of a MoE model); or as PEFT and ms-swift write them: q_proj / k_proj /
    v_proj (all three: linear_qkv, which is one fused linear), o_proj, gate_proj / up_proj,
    down_proj, all-linear. Empty = every linear of the model."""
    rank_pattern: dict[str, int] = field(default_factory=dict)
    """Rank of single targets, overriding rank, e.g. {linear_qkv: 64} (PEFT: rank_pattern)."""
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    """Alpha of single targets, overriding alpha (PEFT: alpha_pattern)."""
    trainable: list[str] = field(default_factory=list)
    """Parts of the base that train too (full weights, with optimizer state): embedding,
    output_layer (untied models), norms (every RMSNorm), router (MoE)."""
    adapter: Optional[str] = None
    """A Hugging Face PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
    the adapters start from instead of A random, B zero. Its targets and ranks become this
    section's (q/k/v adapters stacked into one linear_qkv adapter of their summed rank, gate /
    up into linear_fc1), so the run starts at exactly the PEFT model's outputs; setting it turns
    LoRA on."""

    def rank_of(self, target: str) -> int:
        return _pattern_value(self.rank_pattern, target, self.rank)

    def alpha_of(self, target: str) -> float:
        return _pattern_value(self.alpha_pattern, target, self.alpha)

    def scale_of(self, target: str) -> float:
        """What an adapter's output is multiplied by: alpha / rank."""
        return self.alpha_of(target) / self.rank_of(target)

    def targets(self, is_moe: bool) -> tuple[str, ...]:
        """The targets in effect, in Megatron-Core's names: those named (in any spelling:
        :func:`canonical_targets`), else every linear of the model."""
        found: list[str] = []
        for name in self.target_modules:
            found += [t for t in canonical_targets(name, is_moe) if t not in found]
        return tuple(found) or (MOE_TARGETS if is_moe else DENSE_TARGETS)

    def spelled(self, is_moe: bool) -> dict[str, list[str]]:
        """{target: the names the config gave for it}, where they are not the target's own
        (what the launch summary shows beside the targets)."""
        given: dict[str, list[str]] = {}
        for name in self.target_modules:
            for target in canonical_targets(name, is_moe):
                if name != target:
                    given.setdefault(target, []).append(name)
        return given

    def on_experts(self, is_moe: bool) -> bool:
        """Whether adapters go on routed experts (which then run as sequential experts, not
        Transformer Engine's grouped GEMM)."""
        return self.enabled and any(t.startswith("experts.") for t in self.targets(is_moe))

    def with_(self, **changes) -> "LoraConfig":
        return dataclasses.replace(self, **changes)


def _pattern_value(pattern: dict, target: str, default):
    """A rank_pattern / alpha_pattern value for ``target``, its key in any spelling."""
    if target in pattern:
        return pattern[target]
    is_moe = target.startswith("experts.")
    return next((v for k, v in pattern.items() if target in canonical_targets(k, is_moe)),
                default)
