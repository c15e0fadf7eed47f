"""Images at their own resolution for Qwen2-VL / Qwen2.5-VL: decoded and resized on CPUs.

Why: a Qwen2.5-VL vision tower takes each image near its native size, cut into 14 × 14 patches,
instead of squashing it to one fixed square (:mod:`ray_ppu.data.images`). Which size is decided
per image by ``smart_resize``: both sides a multiple of 28 (patch 14 × merge 2, so the 2 × 2
patch merge before the language model comes out even), the pixel count kept within
[min_pixels, max_pixels], the aspect ratio kept as closely as that allows.

The split is the fixed-size path's: a Ray Data reader process (no torch here, so readers stay
small) decodes, converts to RGB and resizes, and ships uint8 ``[3, H, W]`` (:func:`load_native`,
4x fewer bytes than float32); the training rank makes the float ``pixel_values`` and grids on its
device (:func:`ray_ppu.model.native_pixels.patchify`).

Bit-identical to transformers' ``Qwen2VLImageProcessorPil`` (what transformers 5 uses without
torchvision). Its steps, and where each happens here:

1. RGB as the fixed-size path (alpha composited onto white): :func:`images._decode_rgb`.
2. PIL resize of the **uint8** RGB image (HF hands its uint8 array to PIL unscaled and takes
   uint8 back) to ``smart_resize``'s (h, w), BICUBIC by default: here.
3. ``float32(float64(x) * rescale_factor)``, ``(x - mean) / std`` in float32: a per-(channel,
   value) table, :func:`images.value_table` (the arithmetic is the fixed-size path's).
4. The patch layout: on the rank.

Refusals: the file checks of the fixed-size path (missing, unreadable, empty, over
``data.max_image_pixels`` by its header) and, new here, an aspect ratio over 200, which HF's
``smart_resize`` refuses with a ValueError. :func:`smart_resize` raises an
:class:`~ray_ppu.data.images.ImageProblem` with reason ``image_aspect`` instead (a
ValueError would stop a reader over one bad image; an ImageProblem is a skipped, counted one).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from ray_ppu.data.images import (BICUBIC, CLIP_MEAN, CLIP_STD, ImageProblem, Source,
                                 _decode_rgb, _is_int, _is_real, _open)
from ray_ppu.errors import ConfigError

MAX_ASPECT = 200  # smart_resize refuses a longer / shorter side ratio above this
# The processor classes whose settings NativeImageSpec reproduces (Fast / Pil: same settings).
_HF_TYPES = {f"Qwen2VLImageProcessor{s}" for s in ("", "Fast", "Pil")}
# preprocessor_config.json keys that never change an image's values: metadata, batching, output.
_HF_IGNORED = {"processor_class", "image_processor_type", "device", "input_data_format",
               "return_tensors", "disable_grouping", "data_format"}
_HF_FIELDS = {"patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
              "rescale_factor", "resample", "do_rescale", "do_normalize", "do_convert_rgb"}


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """(h, w) HF's Qwen2-VL processor resizes a height × width image to: multiples of
    ``factor``, h·w within [min_pixels, max_pixels] where the rounding allows. Raises
    ImageProblem ``image_aspect`` for an aspect ratio over 200 (HF: ValueError)."""
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT:
        raise ImageProblem("image_aspect", f"{width} x {height} image: aspect ratio {ratio:.4g} "
                                           f"is over {MAX_ASPECT}")
    # Nearest multiples first (Python's round: halves to even, as HF). The float expressions
    # below are HF's operation for operation: a different but equal-on-paper formula can land
    # on the other side of a floor / ceil.
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:  # shrink by sqrt(area / max): floor keeps it under max_pixels
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:  # grow by sqrt(min / area): ceil keeps it over min_pixels
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


@dataclass(frozen=True)
class NativeImageSpec:
    """How one image becomes Qwen2-VL patches: ``Qwen2VLImageProcessor``'s settings as data.
    Hashable (the value table is cached per spec); :meth:`problems` says what is wrong."""

    patch_size: int = 14
    """Side of a ViT patch, pixels. [≥ 1]"""
    temporal_patch_size: int = 2
    """Frames per patch; a still image is repeated this many times. [≥ 1]"""
    merge_size: int = 2
    """Patches merged per side into one language-model token (2 × 2 → 1). [≥ 1]"""
    min_pixels: int = 56 * 56
    """Fewest pixels after the resize (HF size.shortest_edge). [≥ 1]"""
    max_pixels: int = 28 * 28 * 1280
    """Most pixels after the resize (HF size.longest_edge): 1280 tokens. [≥ min_pixels]"""
    image_mean: tuple[float, float, float] = CLIP_MEAN
    """Per-channel (R, G, B) mean subtracted after the rescale."""
    image_std: tuple[float, float, float] = CLIP_STD
    """Per-channel (R, G, B) standard deviation divided by. [≠ 0]"""
    rescale_factor: float = 1 / 255
    """uint8 value → rescaled value factor. [> 0]"""
    resample: int = BICUBIC
    """PIL filter of the resize: 0 nearest, 1 Lanczos, 2 bilinear, 3 bicubic, 4 box, 5 Hamming."""
    do_rescale: bool = True
    """Multiply by rescale_factor first."""
    do_normalize: bool = True
    """Subtract image_mean and divide by image_std."""
    do_convert_rgb: bool = True
    """Convert every mode to RGB (alpha onto white); False: only RGB images are usable."""

    def __post_init__(self):
        # Tuples of floats, so a spec read from JSON lists hashes and equals one from code;
        # anything else is left for problems() to name.
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)) and all(map(_is_real, value)):
                object.__setattr__(self, name, tuple(float(v) for v in value))
        if _is_real(self.rescale_factor):
            object.__setattr__(self, "rescale_factor", float(self.rescale_factor))

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: patch_size × merge_size (28)."""
        return self.patch_size * self.merge_size

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of a resized height × width still image: HF's image_grid_thw."""
        if height % self.factor or width % self.factor:
            raise ValueError(f"{width} x {height} is not a resized image size (sides must be "
                             f"multiples of {self.factor})")
        return 1, height // self.patch_size, width // self.patch_size

    def tokens(self, height: int, width: int) -> int:
        """Image tokens in the text for a resized height × width image (after the merge)."""
        _, h, w = self.grid(height, width)
        return h * w // self.merge_size ** 2

    def problems(self) -> list[str]:
        """What is wrong with the values, one line each; [] when usable."""
        out = []
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels",
                     "max_pixels"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 1):
                out.append(f"{name}={getattr(self, name)!r} must be an integer ≥ 1")
        if not out and self.min_pixels > self.max_pixels:
            out.append(f"min_pixels={self.min_pixels} is over max_pixels={self.max_pixels}: no "
                       f"size fits between them")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if not (isinstance(value, tuple) and len(value) == 3):
                out.append(f"{name}={value!r} must be 3 finite numbers (R, G, B)")
            elif name == "image_std" and 0 in value:
                out.append(f"image_std={value!r} must be free of zeros")
        if not (_is_real(self.rescale_factor) and self.rescale_factor > 0):
            out.append(f"rescale_factor={self.rescale_factor!r} must be a finite number > 0")
        if not (_is_int(self.resample) and 0 <= self.resample <= 5):
            out.append(f"resample={self.resample!r} must be a PIL filter 0-5 (3 bicubic)")
        out += [f"{name}={getattr(self, name)!r} must be true or false"
                for name in ("do_rescale", "do_normalize", "do_convert_rgb")
                if not isinstance(getattr(self, name), bool)]
        return out

    @classmethod
    def from_hf(cls, preprocessor_config: dict, where: str) -> "NativeImageSpec":
        """The spec of a Qwen2-VL / Qwen2.5-VL ``preprocessor_config.json`` dict; absent keys take
        the processor class's defaults. What cannot be reproduced exactly, or is wrong, is a
        ConfigError (a ValueError) of one line naming ``where`` and the key."""
        given = {k: v for k, v in preprocessor_config.items() if v is not None}  # null = absent
        kind = given.get("image_processor_type")
        if kind is not None and kind not in _HF_TYPES:
            raise ConfigError(f"{where}: image_processor_type={kind!r} is not supported: only "
                              f"Qwen2VLImageProcessor (and Fast) are reproduced here")
        for key, fine in (("do_resize", True), ("data_format", "channels_first")):
            if given.pop(key, fine) != fine:
                raise ConfigError(f"{where}: {key}={preprocessor_config[key]!r} is not supported "
                                  f"(only {fine!r})")
        unknown = sorted(set(given) - _HF_FIELDS - _HF_IGNORED - {"size", "min_pixels",
                                                                  "max_pixels"})
        if unknown:
            raise ConfigError(f"{where}: {unknown[0]}={given[unknown[0]]!r} is not understood: "
                              f"its effect on the pixels cannot be reproduced")
        values = {k: v for k, v in given.items() if k in _HF_FIELDS}
        values.update(_hf_pixel_range(given, where))
        if isinstance(values.get("image_mean"), (int, float)):  # HF repeats one number
            values["image_mean"] = (values["image_mean"],) * 3
        if isinstance(values.get("image_std"), (int, float)):
            values["image_std"] = (values["image_std"],) * 3
        spec = cls(**values)
        if spec.problems():
            raise ConfigError(f"{where}: {'; '.join(spec.problems())}")
        return spec

    def to_hf(self) -> dict:
        """A ``preprocessor_config.json`` dict transformers loads back to these values (the
        pixel range both as size, transformers 5, and min/max_pixels, the Qwen release files)."""
        out = asdict(self)
        out.update(image_mean=list(self.image_mean), image_std=list(self.image_std),
                   image_processor_type="Qwen2VLImageProcessor", do_resize=True,
                   size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels})
        return out


def _hf_pixel_range(given: dict, where: str) -> dict:
    """min_pixels / max_pixels as HF's __init__ reads them: top-level keys win over ``size``'s
    shortest_edge / longest_edge; with no size at all the class defaults fill in; a size that
    lacks one (and no top-level key) leaves HF's resize without it, an error."""
    size = given.get("size")
    if size is None:
        size = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
    if not isinstance(size, dict):
        raise ConfigError(f"{where}: size={size!r} is not supported: only {{shortest_edge, "
                          f"longest_edge}}")
    size = dict(size)
    for top, key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if top in given:
            size[key] = given[top]
            size.pop(top, None)  # HF drops a stale duplicate inside size
    extra = sorted(set(size) - {"shortest_edge", "longest_edge"})
    if extra:
        raise ConfigError(f"{where}: size={given.get('size')!r}: {extra[0]} is not understood")
    for top, key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if size.get(key) is None:
            raise ConfigError(f"{where}: size={given.get('size')!r} lacks {key} and there is no "
                              f"{top}: the resize needs both bounds")
    return {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}


def load_native(source: Source, spec: NativeImageSpec, max_file_pixels: int,
                label: Optional[str] = None) -> np.ndarray:
    """One image as uint8 ``[3, H, W]``, H and W the multiples of ``spec.factor`` of
    :func:`smart_resize`: the processor's pixels before its rescale. ``source``: a path or the
    file's bytes (``label`` names them in messages). ``max_file_pixels`` bounds the decoded file
    (its header is read first). A bad image raises :class:`ImageProblem`."""
    binary = isinstance(source, (bytes, bytearray, memoryview))
    label = label or (f"<{len(source)} bytes of image>" if binary else os.fspath(source))
    with _open(source, label, max_file_pixels) as image:
        # _decode_rgb reads only do_convert_rgb from the spec: the fixed-size path's RGB step.
        rgb = _decode_rgb(image, spec, label, max_file_pixels)
    try:
        height, width = smart_resize(rgb.height, rgb.width, spec.factor, spec.min_pixels,
                                     spec.max_pixels)
    except ImageProblem as e:
        raise ImageProblem(e.reason, f"{label}: {e.message}") from None
    # PIL's resize of the uint8 image, as HF's (PIL returns a copy when the size is unchanged,
    # and HF calls it then too).
    resized = rgb.resize((width, height), resample=spec.resample)
    return np.ascontiguousarray(np.asarray(resized).transpose(2, 0, 1))
