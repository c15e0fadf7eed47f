"""Megatron-LM command-line options → ray_ppu config keys: the model and expert options that
``run_mcore_qwen3.sh`` passes to ``pretrain_qwen.py``, read the way Megatron's argparse reads
them (the last of a repeated option wins; an absent switch is Megatron's default).

Its own module because the Qwen3 script describes its model with Megatron options rather than
with positional arguments, and a user's copy may change any of them: each option is mapped
to a key, taken as mapped by design (ray_ppu always does it, so there is nothing to set),
reported as not reproduced, or refused with its value when no ray_ppu run could match it.
The caller (:mod:`.qwen3`) decides which values to write against the preset.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from ray_ppu.errors import MigrationError

VALUED = {  # option: (key, type), as Megatron's argparse converts the value
    "--num-layers": ("model.num_layers", int),
    "--hidden-size": ("model.hidden_size", int),
    "--num-attention-heads": ("model.num_attention_heads", int),
    "--ffn-hidden-size": ("model.ffn_hidden_size", int),
    "--num-query-groups": ("model.num_query_groups", int),
    "--max-position-embeddings": ("model.max_position_embeddings", int),
    "--padded-vocab-size": ("model.vocab_size", int),
    "--norm-epsilon": ("model.norm_epsilon", float),
    "--rotary-base": ("model.rotary_base", int),
    "--kv-channels": ("model.kv_channels", int),
    "--num-experts": ("model.num_moe_experts", int),
    "--moe-router-topk": ("model.moe_router_topk", int),
    "--moe-ffn-hidden-size": ("model.moe_ffn_hidden_size", int),
    "--moe-aux-loss-coeff": ("model.moe_aux_loss_coeff", float),
    "--expert-model-parallel-size": ("parallel.expert_model_parallel_size", int),
    "--expert-tensor-parallel-size": ("parallel.expert_tensor_parallel_size", int),
}
SWITCHES = {  # option: (key, value when given, value when absent: Megatron's default)
    "--qk-layernorm": ("model.qk_layernorm", True, False),
    "--untie-embeddings-and-output-weights":
        ("model.untie_embeddings_and_output_weights", True, False),
    "--disable-bias-linear": ("model.add_qkv_bias", False, None),  # absent: a bias everywhere
    "--moe-router-pre-softmax": ("model.moe_norm_topk_prob", False, True),
}
BY_DESIGN = {  # switch: why ray_ppu needs no setting for it
    "--swiglu": "ray_ppu's MLP is always SwiGLU",
    "--group-query-attention": "model.num_query_groups alone sets grouped-query attention",
    "--moe-grouped-gemm": "the experts run as one grouped GEMM by default (Transformer "
                          "Engine's, or torch's without it: training.moe_grouped_gemm)",
}
CHOICES = {  # option taking a word: the words ray_ppu reproduces
    "--normalization": ("RMSNorm",),
    "--moe-token-dispatcher-type": ("alltoall", "allgather"),
    "--moe-router-load-balancing-type": ("aux_loss", "none"),
    "--moe-layer-freq": None,  # a pattern: read by layer_pattern
}
# Megatron's defaults for a MoE model whose options leave these out.
MOE_DEFAULTS = {"model.moe_router_topk": 2, "model.moe_aux_loss_coeff": 0.0,
                "parallel.moe_token_dispatcher_type": "allgather"}
MOE_OPTION = re.compile(r"--(moe-|expert-)")
MAX_PATTERN = 100_000  # entries a --moe-layer-freq list may build (no model has more layers)


@dataclass
class Options:
    """What a list of Megatron options sets: key → value, key → the option as written, the
    notes for what ray_ppu reinterprets or does not reproduce."""

    values: dict[str, Any] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any, flag: str) -> None:
        self.values[key] = value
        self.flags[key] = flag


def split_options(words: Sequence[str], origin: str) -> dict[str, str]:
    """option → its value ('' for a switch) in order, the last of a repeated option winning."""
    given: dict[str, str] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            raise MigrationError(f"{origin}: {word!r} follows no option (Megatron's argparse "
                                 f"would stop: unrecognized arguments)")
        value = ""
        if word not in SWITCHES and word not in BY_DESIGN and i + 1 < len(words) \
                and not words[i + 1].startswith("--"):
            value = words[i + 1]
            i += 1
        given.pop(word, None)
        given[word] = value
        i += 1
    return given


def converted(option: str, value: str, kind: type, origin: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise MigrationError(f"{origin}: {option} {value!r}: expected {what} (Megatron's "
                             f"argparse would stop)") from None


def read_options(words: Sequence[str], origin: str) -> Options:
    """Map Megatron options (``origin`` names where they come from in errors and notes)."""
    given, out = split_options(words, origin), Options()
    for option, value in given.items():
        if option in VALUED:
            key, kind = VALUED[option]
            out.set(key, converted(option, value, kind, origin), f"{option} {value}")
        elif option in SWITCHES:
            key, value_given, _ = SWITCHES[option]
            out.set(key, value_given, option)
        elif option in BY_DESIGN:
            out.notes.append(f"{option}: mapped by design, {BY_DESIGN[option]}")
        elif option not in CHOICES:
            written = f"{option} {value}".strip()
            out.notes.append(f"{written} ({origin}): ray_ppu has no setting for it; not "
                             f"reproduced")
    for option, (key, _, absent) in SWITCHES.items():
        if option not in given and absent is not None and not MOE_OPTION.match(option):
            out.set(key, absent, f"no {option}")
    if given.get("--group-query-attention") is None and "model.num_query_groups" in out.values:
        # without --group-query-attention Megatron ignores --num-query-groups: one per head
        out.notes.append(f"{out.flags['model.num_query_groups']} without "
                         f"--group-query-attention: Megatron ignores it (one key/value head per "
                         f"query head)")
        out.values.pop("model.num_query_groups")
    if "model.num_attention_heads" in out.values and "model.num_query_groups" not in out.values:
        out.set("model.num_query_groups", out.values["model.num_attention_heads"],
                "no --group-query-attention")
    choices(given, out, origin)
    if "model.num_moe_experts" in out.values:
        moe(given, out, origin)
    else:
        ignored = [o for o in given if MOE_OPTION.match(o)]
        for key in [k for k, flag in out.flags.items() if MOE_OPTION.match(flag)]:
            del out.values[key], out.flags[key]
        if ignored:
            out.notes.append(f"{' '.join(ignored)} without --num-experts ({origin}): a dense "
                             f"model, Megatron builds no experts; ignored")
    return out


def choices(given: dict[str, str], out: Options, origin: str) -> None:
    """--normalization: RMSNorm, the only norm ray_ppu builds, or an error."""
    norm = given.get("--normalization")
    if norm is not None and norm != "RMSNorm":
        raise MigrationError(f"{origin}: --normalization {norm!r}: ray_ppu builds RMSNorm only")
    if norm is not None:
        out.notes.append("--normalization RMSNorm: mapped by design, ray_ppu's norms are RMSNorm")


def moe(given: dict[str, str], out: Options, origin: str) -> None:
    """A MoE model: the token dispatcher, Megatron's defaults for what is left out, load
    balancing, the layer pattern."""
    dispatcher = given.get("--moe-token-dispatcher-type")
    if dispatcher is not None:
        if dispatcher not in CHOICES["--moe-token-dispatcher-type"]:
            raise MigrationError(f"{origin}: --moe-token-dispatcher-type {dispatcher!r}: ray_ppu "
                                 f"dispatches with alltoall or allgather "
                                 f"(parallel.moe_token_dispatcher_type)")
        out.set("parallel.moe_token_dispatcher_type", dispatcher,
                f"--moe-token-dispatcher-type {dispatcher}")
    for key, default in MOE_DEFAULTS.items():
        if key not in out.values:
            out.set(key, default, "Megatron's default")
    if "model.moe_norm_topk_prob" not in out.values:  # softmax over the top-k: renormalised
        out.set("model.moe_norm_topk_prob", SWITCHES["--moe-router-pre-softmax"][2],
                "no --moe-router-pre-softmax")
    balancing = given.get("--moe-router-load-balancing-type", "aux_loss")
    coeff = out.values["model.moe_aux_loss_coeff"]
    if balancing == "none":
        out.set("model.moe_aux_loss_coeff", 0.0, "--moe-router-load-balancing-type none")
        if coeff:
            out.notes.append(f"--moe-router-load-balancing-type none with --moe-aux-loss-coeff "
                             f"{coeff:g} ({origin}): Megatron adds no load-balancing loss; "
                             f"model.moe_aux_loss_coeff=0")
    elif balancing != "aux_loss":
        out.notes.append(f"--moe-router-load-balancing-type {balancing} ({origin}): unsupported, "
                         f"ray_ppu balances with the aux_loss loss only "
                         f"(model.moe_aux_loss_coeff={coeff:g}); not reproduced")
    freq = given.get("--moe-layer-freq")
    if freq is not None:
        layers = out.values.get("model.num_layers")
        if layers is None:
            raise MigrationError(f"{origin}: --moe-layer-freq {freq} without --num-layers")
        dense = dense_layers(freq, layers, origin)
        if not dense:
            out.notes.append(f"--moe-layer-freq {freq}: mapped by design, every layer MoE as "
                             f"ray_ppu builds them")
        else:
            out.notes.append(f"--moe-layer-freq {freq} ({origin}): unsupported, {len(dense)} of "
                             f"{layers} layers dense (layers {compact(dense)}); ray_ppu builds "
                             f"every layer as MoE; not reproduced")


def dense_layers(freq: str, num_layers: int, origin: str) -> list[int]:
    """The layers a --moe-layer-freq leaves dense: an integer k (every k-th layer MoE, from
    layer 0) or a list expression of 0 / 1 of length num_layers such as ``([1]*48)``, which
    Megatron evaluates as Python and which is parsed here without eval."""
    try:
        pattern = layer_pattern(freq)
    except ValueError:
        raise MigrationError(f"{origin}: --moe-layer-freq {freq!r}: expected an integer or a "
                             f"list of 0 and 1 such as ([1]*{num_layers})") from None
    if isinstance(pattern, int):
        if pattern < 1:
            raise MigrationError(f"{origin}: --moe-layer-freq {freq}: expected k ≥ 1 "
                                 f"(every k-th layer MoE)")
        pattern = [int(i % pattern == 0) for i in range(num_layers)]
    if len(pattern) != num_layers or set(pattern) - {0, 1}:
        raise MigrationError(f"{origin}: --moe-layer-freq {freq}: {len(pattern)} entries for "
                             f"{num_layers} layers, each 0 or 1 (Megatron would stop: invalid "
                             f"moe_layer_pattern)")
    return [i for i, moe_layer in enumerate(pattern) if not moe_layer]


def layer_pattern(text: str) -> int | list[int]:
    """An integer or list built from integer lists, ``*`` and ``+`` (``([1]*46+[0,0])``)."""
    tokens = re.findall(r"\d+|\S", text)
    pos = 0

    def take() -> str:
        nonlocal pos
        if pos == len(tokens):
            raise ValueError(text)
        pos += 1
        return tokens[pos - 1]

    def atom() -> int | list[int]:
        token = take()
        if token.isdigit():
            return int(token)
        if token == "(":
            value = expression()
            if take() != ")":
                raise ValueError(text)
            return value
        if token != "[":
            raise ValueError(text)
        items: list[int] = []
        while tokens[pos:pos + 1] != ["]"]:
            item = atom()
            if not isinstance(item, int):
                raise ValueError(text)
            items.append(item)
            if tokens[pos:pos + 1] == [","]:
                take()
        take()
        return items

    def chained(operand, symbol: str, combine):
        value = operand()
        while tokens[pos:pos + 1] == [symbol]:
            take()
            value = combine(value, operand())
        return value

    def times(x, y):
        lists = [v for v in (x, y) if isinstance(v, list)]
        if len(lists) == 2:
            raise ValueError(text)
        if lists and len(lists[0]) * (y if lists[0] is x else x) > MAX_PATTERN:
            raise ValueError(text)  # no list longer than any model's layers
        return x * y

    def plus(x, y):
        if isinstance(x, int) != isinstance(y, int):
            raise ValueError(text)
        return x + y

    def term() -> int | list[int]:
        return chained(atom, "*", times)

    def expression() -> int | list[int]:
        return chained(term, "+", plus)

    result = expression()
    if pos != len(tokens):
        raise ValueError(text)
    return result


def compact(numbers: list[int]) -> str:
    """0,1,2,5 → '0-2, 5' (ranges of consecutive layer numbers)."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
