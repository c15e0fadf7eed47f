"""Build a RunConfig from a YAML file plus ``section.field=value`` overrides.

Every key is checked against the dataclasses before anything else happens: an unknown key is
an error that names it and suggests the closest known one, and a value of the wrong type names
the key, the value and the type expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Union

import yaml

from ray_ppu.config.presets import PRESETS, VISION_PRESETS
from ray_ppu.config.schema import DataConfig, LoraConfig, ModelConfig, RunConfig, VisionConfig
from ray_ppu.errors import ConfigError  # noqa: F401 (also imported from here)


_SCIENTIFIC = re.compile(r"[+-]?\d+(\.\d*)?[eE][+-]?\d+")


def _did_you_mean(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _section_fields() -> dict[str, list[str]]:
    hints = typing.get_type_hints(RunConfig)
    return {name: [f.name for f in dataclasses.fields(hints[name])] for name in hints}


def _misplaced(section: str, key: str) -> str:
    """Where an unknown key of ``section`` lives, if another section has it (or nearly)."""
    others = {name: fields for name, fields in _section_fields().items() if name != section}
    exact = [name for name, fields in others.items() if key in fields]
    if exact:
        return f" (it belongs in {exact[0]}: {exact[0]}.{key})"
    everywhere = {f"{name}.{field}": field for name, fields in others.items() for field in fields}
    close = difflib.get_close_matches(key, list(everywhere.values()), n=1, cutoff=0.75)
    if close:
        where = next(k for k, field in everywhere.items() if field == close[0])
        return f" (did you mean '{where}'?)"
    return ""


def preset_name(name: str) -> Optional[str]:
    """The preset ``name`` denotes: a preset's own name in any case, or a Qwen2.5 size with its
    family (``qwen2.5-7B`` is ``7B``, the reference script's MODEL_SIZE); None if none."""
    by_lower = {key.lower(): key for key in PRESETS}
    lowered = str(name).lower()
    return by_lower.get(lowered) or by_lower.get(lowered.removeprefix("qwen2.5-"))


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a field annotation, converting the lossless cases (1 -> 1.0)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{where}={value!r}: expected one of {', '.join(map(repr, choices))}")
        return value
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        items = value if isinstance(value, list) else [value]
        return [_coerce(item, item_type, f"{where}[{i}]") for i, item in enumerate(items)]
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}={value!r}: expected a mapping, e.g. {{linear_qkv: 8}}")
        return {_coerce(k, key_type, f"{where} key"): _coerce(v, value_type, f"{where}.{k}")
                for k, v in value.items()}
    if annotation in (int, float) and isinstance(value, str) and _SCIENTIFIC.fullmatch(value):
        value = float(value)  # YAML 1.1 reads "1e10" (no dot) as a string
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)  # 1e10 in YAML is a float; train_tokens wants the integer
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        raise TypeError(f"unsupported annotation {annotation!r} for {where}")
    raise ConfigError(f"{where}={value!r}: expected {annotation.__name__}")


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form section.field=value")
    key, raw = text.split("=", 1)
    # YAML typing: 2 -> int, 1e-4 -> float, true -> bool, [a, b] -> list, 1e10 -> float.
    value = yaml.safe_load(raw) if raw.strip() else ""
    return key.strip().split("."), value


def _merge(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(path)}: '{part}' is not a section")
    node[path[-1]] = value


def _build_section(cls: type, values: dict, section: str, base: Any = None) -> Any:
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            hint = _did_you_mean(key, known) or _misplaced(section, key)
            raise ConfigError(f"unknown key '{section}.{key}'{hint}")
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def _build_model(values: dict, pretrained: Any = None, files: bool = True) -> ModelConfig:
    """The model section on top of its preset. With ``checkpoint.pretrained`` and no preset,
    on top of that directory's config.json instead; either way the result must then be
    config.json's architecture (training-only fields aside). ``files=False`` (planning where
    the files are not): a preset's model is taken as it is when that config.json is not
    there."""
    values = dict(values)
    if pretrained and not files and not _present(pretrained, "config.json"):
        if "preset" not in values:  # the model is the directory's, and it is not here
            raise ConfigError(f"--plan-only: {pretrained}/config.json is not here to say what "
                              f"model checkpoint.pretrained is: name it (model.preset=...)")
        pretrained = None  # a preset, or every field (a saved config.yaml), stands in
    given = values.pop("preset", None if pretrained else "tiny")
    name = None if given is None else preset_name(given)
    if given is not None and name is None:
        raise ConfigError(
            f"unknown model.preset '{given}'{_did_you_mean(str(given), PRESETS)}; "
            f"known presets: {', '.join(PRESETS)} (Qwen2.5 sizes also as qwen2.5-<size>)"
        )
    if not pretrained:  # preset null: every field is in the section (a saved config.yaml)
        base = PRESETS[name] if name is not None else ModelConfig()
        return _build_section(ModelConfig, values, "model", base=base)
    # The one import back up the layers (tests/test_layout.py): config.json's architecture
    # is mapped to a ModelConfig beside the weight mapping it must agree with, in ray_ppu.hf.
    from ray_ppu.hf.config import directory_model, require_match

    theirs = directory_model(str(pretrained))
    model = _build_section(ModelConfig, values, "model",
                           base=PRESETS[name] if name is not None else theirs)
    require_match(model, theirs, str(pretrained))
    return model


def from_dict(tree: dict, files: bool = True) -> RunConfig:
    """Typed RunConfig from a nested dict (a parsed YAML file); unknown keys are errors.
    ``files=False`` (``--plan-only``): a preset, or a model section giving every field,
    stands in for a checkpoint.pretrained directory that is not there, and a lora.adapter
    that is not there leaves the lora section as given."""
    sections = {f.name: f for f in dataclasses.fields(RunConfig)}
    hints = typing.get_type_hints(RunConfig)
    built = {}
    for name, values in (tree or {}).items():
        if name not in sections:
            raise ConfigError(f"unknown section '{name}'{_did_you_mean(name, sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"section '{name}' must be a mapping, got {values!r}")
        if name not in ("model", "vision"):
            built[name] = _build_section(hints[name], values, name)
    pretrained = built["checkpoint"].pretrained if "checkpoint" in built else None
    model = (tree or {}).get("model", {})
    built["model"] = (_build_model(model, pretrained, files) if model or pretrained
                      else PRESETS["tiny"])
    # a vision-language preset brings its vision section, a LLaVA checkpoint or a vision
    # tower directory its own; explicit vision.* keys override it
    vision_base = VISION_PRESETS.get(built["model"].preset, (None, VisionConfig()))[1]
    if pretrained and not built["model"].preset and (files or _present(pretrained, "config.json")):
        from ray_ppu.hf.llava import directory_vision  # the arrow back up, as for the model

        checkpoint = built["checkpoint"]
        vision_base = directory_vision(pretrained, checkpoint.pretrained_vision) or vision_base
    built["vision"] = _build_section(VisionConfig, (tree or {}).get("vision") or {}, "vision",
                                     base=vision_base)
    lora = built.get("lora")
    if lora is not None and lora.adapter and (files or _present(lora.adapter, "adapter_config.json")):
        built["lora"] = _lora_from_adapter(lora, (tree or {})["lora"], built["model"])
    if (built["vision"].native and built.get("lora", LoraConfig()).enabled
            and "freeze" not in ((tree or {}).get("vision") or {})):
        # Qwen2.5-VL LoRA: the adapters alone train unless vision.freeze says otherwise
        built["vision"] = built["vision"].with_(freeze=["vision", "projector"])
    if pretrained and "tokenizer" not in (tree or {}).get("data", {}):
        # the model's own tokenizer, as the reference tokenizes with PRETRAIN_CHECKPOINT_PATH
        built["data"] = dataclasses.replace(built.get("data", DataConfig()), tokenizer=pretrained)
    return RunConfig(**built)


# What a PEFT adapter (lora.adapter) decides of the lora section.
_ADAPTER_DECIDES = ("target_modules", "rank", "alpha", "rank_pattern", "alpha_pattern")


def _present(directory: Any, name: str) -> bool:
    """Whether ``directory`` holds the file ``name`` (planning where the files are not)."""
    return (Path(str(directory)).expanduser() / name).is_file()


def _lora_from_adapter(lora, given: dict, model: ModelConfig):
    """The lora section of a run starting from a PEFT adapter: its targets and ranks (q / k /
    v stacked into linear_qkv, ...), LoRA on. Setting what the adapter decides is an error."""
    clash = [f"lora.{key}" for key in _ADAPTER_DECIDES if key in given]
    if clash:
        raise ConfigError(f"{', '.join(clash)} and lora.adapter={lora.adapter} both set: the "
                          f"adapter's targets and ranks are the run's; drop {', '.join(clash)}")
    # The same arrow back up as for checkpoint.pretrained's config.json: the PEFT mapping
    # lives in ray_ppu.hf beside the weight mapping it builds on.
    from ray_ppu.hf.peft import lora_section, read_adapter

    return lora.with_(**lora_section(read_adapter(lora.adapter), model))


# Lengths a config may give in iterations or in tokens: one form each.
LENGTH_FORMS = (("train_iters", "train_tokens"), ("lr_warmup_iters", "lr_warmup_tokens"),
                ("lr_decay_iters", "lr_decay_tokens"))


def _one_form_per_length(tree: dict, overridden: set[str], origin: str) -> None:
    """Both forms of a length is an error naming both, unless one is a command-line override
    of a config file's other: the override wins and a warning says so (a user who types
    ``training.train_iters=100`` for a quick try means it). ``None`` is not a value here."""
    training = tree.get("training")
    if not isinstance(training, dict):
        return
    for pair in LENGTH_FORMS:
        given = [key for key in pair if training.get(key) is not None]
        if len(given) < 2:
            continue
        won = [key for key in given if f"training.{key}" in overridden]
        if len(won) == 1:
            lost = next(key for key in given if key != won[0])
            warnings.warn(f"training.{won[0]}={training[won[0]]} (command line) replaces "
                          f"training.{lost}={training[lost]} of {origin}", stacklevel=3)
            del training[lost]
        else:
            where = "on the command line" if won else f"in {origin}"
            raise ConfigError(f"training.{pair[0]}={training[pair[0]]} and training.{pair[1]}="
                              f"{training[pair[1]]} both set {where}: they are one length in "
                              f"iterations or in tokens; set one")


def load(path: str | Path | None, overrides: Iterable[str] = (), files: bool = True) -> RunConfig:
    """Read ``path`` (YAML; None = all defaults) and apply ``section.field=value`` overrides
    (``files=False``: see :func:`from_dict`)."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from err
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    overridden = set()
    for text in overrides:
        keys, value = _parse_override(text)
        if len(keys) != 2:
            raise ConfigError(f"override '{text}': expected section.field=value")
        _merge(tree, keys, value)
        overridden.add(".".join(keys))
    _one_form_per_length(tree, overridden, str(path) if path is not None else "the defaults")
    return from_dict(tree, files)
