"""A vision-language model's PEFT adapter: where PEFT finds its parts, and the part a LoRA run
may train in full beside the adapters (LLaVA's projector, Qwen2.5-VL's merger), which PEFT
saves whole as ``modules_to_save``.

PEFT names tensors after the transformers module tree. transformers 5 puts a vision-language
model's language model at ``model.language_model`` (LLaVA and Qwen2.5-VL alike; LLaVA under
transformers 4: ``language_model.model``), its projector at ``model.multi_modal_projector``
and Qwen2.5-VL's merger at ``model.visual.merger``. :func:`split` turns such an adapter's
tensors into what the text mapping of :mod:`ray_ppu.hf.peft` reads (``model.layers.…``) plus
the saved modules by their module path; :func:`load_saved` writes those into a model (the
projector through the LLaVA weight mapping, TP-sharded; the merger, a transformers module
replicated over TP, as it is).
"""

from __future__ import annotations

from typing import Optional

import torch

from ray_ppu.config.vision import VisionConfig
from ray_ppu.errors import ConfigError

# the language model's layers as PEFT names them on transformers 5's module tree
VL_LAYERS = "model.language_model.layers"
_LANGUAGE_SPELLINGS = ("model.language_model.", "language_model.model.")
# the image-side part a LoRA run may train in full, by vision.native: (its parameters'
# prefix in a ray_ppu model, the module path PEFT's modules_to_save names)
SAVED_MODULES = {False: ("vision_projection.", "multi_modal_projector"),
                 True: ("vision_model.visual.merger.", "visual.merger")}
SAVED_NAMES = {name for _, name in SAVED_MODULES.values()} | {"merger"}


def split(tensors: dict[str, torch.Tensor], prefix: str) -> tuple[dict, dict]:
    """(the adapter tensors with a vision-language model's language prefix made the text
    model's, ``{module path: tensor}`` of the saved modules' tensors). ``prefix``: PEFT's
    (``base_model.model.``)."""
    lora, saved = {}, {}
    for key, tensor in tensors.items():
        name = key[len(prefix):] if key.startswith(prefix) else key
        if ".lora_A." in name or ".lora_B." in name:
            for spelling in _LANGUAGE_SPELLINGS:
                if name.startswith(spelling + "layers."):
                    name = "model." + name[len(spelling):]
            lora[prefix + name] = tensor
        else:
            saved[name.removeprefix("model.")] = tensor
    return lora, saved


def problems(config: dict, lora: dict, saved: dict, prefix: str) -> list[str]:
    """What ray_ppu cannot load of a split adapter: saved modules other than a projector or
    merger, adapters on the vision tower."""
    found = []
    modules = config.get("modules_to_save") or []
    unknown = [m for m in modules if m not in SAVED_NAMES]
    if unknown:
        found.append(f"modules_to_save={unknown} (ray_ppu loads a vision-language model's "
                      f"multi_modal_projector or visual.merger only)")
    tower = sorted({k[len(prefix):].split(".lora_")[0] for k in lora
                    if not k[len(prefix):].startswith("model.layers.")})
    if tower:
        found.append(f"adapters outside the language model ({', '.join(tower[:2])}…), which "
                     f"ray_ppu does not adapt")
    if saved and not modules:
        found.append(f"tensors that are no adapter's ({', '.join(sorted(saved)[:2])}…)")
    return found


class _Reader:
    """Saved tensors as a checkpoint that regions are read from (:func:`weights.fill_pieces`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def read_into(self, name, out, rows=None, cols=None) -> None:
        if name not in self.tensors:
            raise ConfigError(f"the adapter's saved module lacks {name}")
        tensor = self.tensors[name]
        tensor = tensor[rows] if rows is not None else tensor
        out.copy_(tensor[:, cols] if cols is not None else tensor)


@torch.no_grad()
def load_saved(chunks: list, saved: dict[str, torch.Tensor], model,
               vision: Optional[VisionConfig]) -> int:
    """Write an adapter's saved projector / merger into this rank's chunks (those holding
    it: the first pipeline stage); returns the tensors written."""
    from ray_ppu.hf import llava_weights, weights
    from ray_ppu.util.wrappers import unwrap

    if not saved:
        return 0
    if vision is None or not vision.enabled:
        raise ConfigError(f"the adapter saves {', '.join(sorted(saved)[:2])}…: a "
                          f"vision-language model's part, and this model has none")
    ours, theirs = SAVED_MODULES[vision.native]
    done = 0
    for chunk in chunks:
        module = unwrap(chunk)
        if vision.native:  # the merger: transformers' module, its names after the prefix
            for name, param in module.named_parameters():
                if name.startswith(ours):
                    _Reader(saved).read_into(f"{theirs}.{name[len(ours):]}", param)
                    done += 1
            continue
        for sh in weights._sharded_tensors(module):
            if sh.key.startswith(ours):
                key = sh.key[len(ours):]
                weights.fill_pieces(_Reader(saved), key, llava_weights.projector_pieces(
                    model, key, llava_weights.EXPORT_NAMES.projector), sh.global_offset,
                    sh.data)
                done += 1
    return done
