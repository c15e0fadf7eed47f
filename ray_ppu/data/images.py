"""Images for LLaVA-style training: decoded and checked on CPUs, normalised on the device.

Why: images are decoded by Ray Data CPU tasks, not by the training ranks, whose CPUs feed the
accelerators. Each image travels to the ranks as uint8 ``[3, H, W]`` (:func:`load_image`): 4x
fewer bytes than the float32 ``pixel_values`` of a Hugging Face processor, in the object store
and on the wire. The rank makes those float32 values on its device
(:func:`ray_ppu.model.pixels.normalize`); this module imports no torch, so reader processes
stay small.

The values are bit-identical to the ``pixel_values`` of transformers' ``SiglipImageProcessor`` /
``CLIPImageProcessor`` PIL backend (what transformers 5 uses without torchvision; its torchvision
backend resizes tensors, a few levels apart). Their pipeline, reproduced step by step:

1. RGB: with an alpha band (RGBA, LA, PA) or a ``transparency`` entry (PNG tRNS, GIF) the image
   is composited onto opaque white (PIL's RGBA→RGB would keep the hidden colours); other modes
   go through PIL's ``convert("RGB")``.
2. PIL resize of the uint8 RGB image (HF's resize sees uint8 and does not rescale): SigLIP to
   height × width; CLIP the shorter side to shortest_edge, the longer to
   ``int(shortest_edge * long / short)``.
3. CLIP's centre crop: offset ``(size - crop) // 2`` per axis, zeros past the image's edges.
4. ``float32(float64(x) * rescale_factor)``, then ``(x - mean) / std`` in float32.

Steps 1-3 give integers (CPU). Step 4 depends only on (channel, uint8 value): the rank looks
it up in a 3 × 256 table (:func:`value_table`) made with HF's numpy arithmetic, exact on any
device without float64 (float32 arithmetic there lands up to 2 ulp off).

A bad image is an :class:`ImageProblem` (:data:`IMAGE_REASONS`): the header's size is checked
before any pixel is decoded, then every pixel is (PIL opens lazily), so a truncated file fails
here and not in a training step (with PIL's default LOAD_TRUNCATED_IMAGES = False).
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Literal, Optional, Union

import numpy as np
from PIL import Image

from ray_ppu.errors import ConfigError

# image_aspect: a side over 200 times the other, which Qwen2.5-VL's resize refuses (native_images)
IMAGE_REASONS = ("missing_image", "unreadable_image", "empty_image", "image_too_large",
                 "image_aspect")
MAX_PIXELS_SETTING = "data.max_image_pixels"  # the limit's name in image_too_large messages
PROCESSOR_FILE = "preprocessor_config.json"  # a Hugging Face model's image processor

# transformers.image_utils' OPENAI_CLIP_MEAN / _STD and IMAGENET_STANDARD_MEAN / _STD (SigLIP's).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC: both processors' default

Source = Union[str, os.PathLike, bytes, bytearray, memoryview]

# image_processor_type (or an old config's feature_extractor_type) → family. The Fast
# (torchvision) and Pil classes read the same settings; the values are the PIL backend's.
_HF_TYPES = {f"{name}{suffix}": family for name, family in
             (("SiglipImageProcessor", "siglip"), ("CLIPImageProcessor", "clip"))
             for suffix in ("", "Fast", "Pil")}
_HF_TYPES["CLIPFeatureExtractor"] = "clip"  # openai/clip-vit-* predate image processors
# What an absent key means: the class attributes of transformers' Siglip/CLIPImageProcessor and
# BaseImageProcessor (HF treats a null value as absent too).
_COMMON = dict(do_resize=True, resample=BICUBIC, do_rescale=True, rescale_factor=1 / 255,
               do_normalize=True, do_convert_rgb=True, default_to_square=False, do_pad=False,
               use_square_size=False, data_format="channels_first")
_HF_DEFAULTS = {
    "siglip": dict(_COMMON, size={"height": 224, "width": 224}, crop_size=None,
                   do_center_crop=False, image_mean=SIGLIP_MEAN, image_std=SIGLIP_STD),
    "clip": dict(_COMMON, size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                 do_center_crop=True, image_mean=CLIP_MEAN, image_std=CLIP_STD),
}
# Keys that never change a decoded image's values: metadata; the layout of numpy inputs; output
# type, device, batching; pad_size (do_pad is refused).
_HF_IGNORED = {"processor_class", "image_processor_type", "feature_extractor_type", "device",
               "input_data_format", "return_tensors", "disable_grouping", "image_seq_length",
               "pad_size"}


@dataclass(frozen=True)
class ImageSpec:
    """How one image becomes the ViT's input: HF's SigLIP / CLIP preprocessing as data."""

    height: int
    """Height of the model's input, pixels (after resize and crop). [≥ 1]"""
    width: int
    """Width of the model's input, pixels. [≥ 1]"""
    resize: Literal["exact", "shortest_edge"] = "exact"
    """``exact``: straight to height × width (SiglipImageProcessor); ``shortest_edge``: the
    shorter side to shortest_edge keeping the aspect ratio, then the centre height × width
    (CLIPImageProcessor)."""
    shortest_edge: Optional[int] = None
    """The shorter side's target with resize=shortest_edge; None with exact. [≥ 1]"""
    resample: int = BICUBIC
    """PIL filter: 0 nearest, 1 Lanczos, 2 bilinear, 3 bicubic, 4 box, 5 Hamming."""
    rescale_factor: float = 1 / 255
    """uint8 value → rescaled value factor (HF rescale_factor). [> 0]"""
    image_mean: tuple[float, float, float] = SIGLIP_MEAN
    """Per-channel (R, G, B) mean subtracted after the rescale."""
    image_std: tuple[float, float, float] = SIGLIP_STD
    """Per-channel (R, G, B) standard deviation divided by. [≠ 0]"""
    do_convert_rgb: bool = True
    """Convert every mode to RGB (alpha onto white); False: only RGB images are usable."""
    do_normalize: bool = True
    """Subtract image_mean and divide by image_std."""
    do_rescale: bool = True
    """Multiply by rescale_factor first."""

    def __post_init__(self):
        checks = [
            *((name, _is_int(getattr(self, name)) and getattr(self, name) >= 1, "an integer ≥ 1")
              for name in ("height", "width")),
            ("resize", self.resize in ("exact", "shortest_edge"), "exact or shortest_edge"),
            ("shortest_edge", self.shortest_edge is None if self.resize == "exact" else
             _is_int(self.shortest_edge) and self.shortest_edge >= 1,
             "None with resize=exact, an integer ≥ 1 with shortest_edge"),
            ("resample", _is_int(self.resample) and 0 <= self.resample <= 5,
             "a PIL filter 0-5 (3 bicubic)"),
            ("rescale_factor", _is_real(self.rescale_factor) and self.rescale_factor > 0,
             "a finite number > 0"),
            *((name, isinstance(v, tuple) and len(v) == 3 and all(map(_is_real, v)),
               "3 finite numbers (R, G, B)")
              for name, v in (("image_mean", self.image_mean), ("image_std", self.image_std))),
            ("image_std", not (isinstance(self.image_std, tuple) and 0 in self.image_std),
             "free of zeros"),
            *((name, isinstance(getattr(self, name), bool), "true or false")
              for name in ("do_convert_rgb", "do_normalize", "do_rescale")),
        ]
        for name, fine, want in checks:
            if not fine:
                raise ConfigError(f"ImageSpec.{name}={getattr(self, name)!r}: must be {want}")
        # Floats, so that a spec read from JSON ([0, 0, 0]) equals and hashes as one from code.
        object.__setattr__(self, "rescale_factor", float(self.rescale_factor))
        for name in ("image_mean", "image_std"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))

    @classmethod
    def siglip(cls, image_size: int) -> "ImageSpec":
        """SiglipImageProcessor's defaults for a square ``image_size`` input."""
        return cls(height=image_size, width=image_size, image_mean=SIGLIP_MEAN,
                   image_std=SIGLIP_STD)

    @classmethod
    def clip(cls, image_size: int) -> "ImageSpec":
        """CLIPImageProcessor's defaults: the shorter side to ``image_size``, the centre square."""
        return cls(height=image_size, width=image_size, resize="shortest_edge",
                   shortest_edge=image_size, image_mean=CLIP_MEAN, image_std=CLIP_STD)

    @classmethod
    def from_hf(cls, preprocessor_config: dict, where: str) -> "ImageSpec":
        """The spec of a ``preprocessor_config.json`` dict, absent keys taking the processor
        class's defaults. What this module cannot reproduce exactly is a ConfigError (a
        ValueError) of one line naming ``where``, the key and its value."""
        values = preprocessor_config  # then the defaults-filled config: the values in effect

        def bad(key: str, why: str):
            raise ConfigError(f"{where}: {key}={values.get(key)!r} {why}")

        type_key = "image_processor_type"
        if type_key not in preprocessor_config and "feature_extractor_type" in preprocessor_config:
            type_key = "feature_extractor_type"
        family = _HF_TYPES.get(preprocessor_config.get(type_key))
        if family is None:
            bad(type_key, f"is {'not supported' if type_key in values else 'missing'}: only "
                          f"Siglip/CLIPImageProcessor (and Fast) are reproduced exactly")
        given = {k: v for k, v in preprocessor_config.items() if v is not None}
        for key in given:
            if key not in _HF_DEFAULTS[family] and key not in _HF_IGNORED:
                bad(key, "is not understood: its effect on the pixels cannot be reproduced")
        values = c = dict(_HF_DEFAULTS[family], **given)
        for key, fine in (("do_pad", False), ("use_square_size", False),
                          ("data_format", "channels_first"), ("do_resize", True)):
            if c[key] != fine:
                bad(key, f"is not supported (only {fine!r})")
        # HF repeats a single number over the 3 channels.
        means = {k: (c[k],) * 3 if _is_real(c[k]) else c[k] for k in ("image_mean", "image_std")}
        means = {k: tuple(v) if isinstance(v, list) else v for k, v in means.items()}
        geometry = _hf_geometry(c, bad)
        try:
            return cls(**geometry, **means, resample=c["resample"],
                       rescale_factor=c["rescale_factor"], do_convert_rgb=c["do_convert_rgb"],
                       do_normalize=c["do_normalize"], do_rescale=c["do_rescale"])
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    def to_hf(self) -> dict:
        """A ``preprocessor_config.json`` dict that transformers loads back to these values."""
        out = {"do_resize": True, "resample": self.resample, "do_rescale": self.do_rescale,
               "rescale_factor": self.rescale_factor, "do_normalize": self.do_normalize,
               "image_mean": list(self.image_mean), "image_std": list(self.image_std),
               "do_convert_rgb": self.do_convert_rgb}
        if self.resize == "exact":
            return dict(out, image_processor_type="SiglipImageProcessor", do_center_crop=False,
                        size={"height": self.height, "width": self.width})
        return dict(out, image_processor_type="CLIPImageProcessor", do_center_crop=True,
                    size={"shortest_edge": self.shortest_edge},
                    crop_size={"height": self.height, "width": self.width})


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _hf_size(value, square: bool, bad) -> dict:
    """HF's reading of size / crop_size (get_size_dict): an int is a square, or a shortest edge
    when default_to_square is false; a pair is (height, width)."""
    if _is_int(value):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return {"height": value[0], "width": value[1]}
    if isinstance(value, dict) and set(value) in ({"height", "width"}, {"shortest_edge"}):
        return dict(value)
    bad("is not supported: only {height, width}, {shortest_edge}, an int or [height, width]")


def _hf_geometry(c: dict, bad) -> dict:
    """height, width, resize, shortest_edge of a (defaults-filled) config; a crop must give the
    fixed input size the model needs, and may follow only a shortest-edge resize."""
    size = _hf_size(c["size"], c["default_to_square"], lambda why: bad("size", why))
    crop = _hf_size(c["crop_size"], True, lambda why: bad("crop_size", why)) \
        if c["do_center_crop"] else None
    if crop is not None and set(crop) != {"height", "width"}:
        bad("crop_size", "must give height and width")
    if "shortest_edge" in size:
        if crop is None:
            bad("do_center_crop", f"with size={size} leaves each image its own shape (a centre "
                                  f"crop is needed)")
        return dict(crop, resize="shortest_edge", shortest_edge=size["shortest_edge"])
    if crop is not None and crop != size:
        bad("crop_size", f"differs from size={size}: a crop after an exact resize is not "
                         f"supported")
    return dict(size, resize="exact")


class ImageProblem(Exception):
    """An unusable image: ``reason`` one of IMAGE_REASONS, ``message`` one line naming the file
    and the numbers."""

    def __init__(self, reason: str, message: str):
        if reason not in IMAGE_REASONS:
            raise ValueError(f"ImageProblem reason {reason!r} is not one of {IMAGE_REASONS}")
        super().__init__(message)
        self.reason, self.message = reason, message

    def __reduce__(self):  # Ray pickles it; the default would call __init__(message)
        return ImageProblem, (self.reason, self.message)


def _pixels(n: int) -> str:
    """A pixel count, as 1.2e9 from a million up."""
    return str(n) if n < 1_000_000 else f"{n:.2g}".replace("e+0", "e").replace("e+", "e")


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _open(source: Source, label: str, max_pixels: int) -> Image.Image:
    """Open (the header only) or raise the ImageProblem."""
    binary = isinstance(source, (bytes, bytearray, memoryview))
    try:
        with warnings.catch_warnings():
            # PIL warns from MAX_IMAGE_PIXELS up; our own check follows, naming the sizes.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(bytes(source)) if binary else os.fspath(source))
    except FileNotFoundError:
        raise ImageProblem("missing_image", f"{label}: no such file") from None
    except Image.DecompressionBombError as e:
        # Over 2 × MAX_IMAGE_PIXELS PIL refuses before we see the size; its message has the count.
        found = re.search(r"\((\d+) pixels\)", str(e))
        if found and int(found.group(1)) > max_pixels:
            raise ImageProblem("image_too_large", f"{label}: {_pixels(int(found.group(1)))} "
                               f"pixels by its header, over {MAX_PIXELS_SETTING}={max_pixels}"
                               ) from None
        raise ImageProblem("image_too_large", f"{label}: {_one_line(e)} (PIL.Image."
                           f"MAX_IMAGE_PIXELS={Image.MAX_IMAGE_PIXELS})") from None
    except Image.UnidentifiedImageError:
        raise ImageProblem("unreadable_image", f"{label}: not an image (no format Pillow reads "
                           f"recognises it)") from None
    except Exception as e:  # a directory, no permission, a malformed header
        raise ImageProblem("unreadable_image", f"{label}: cannot be opened ({_one_line(e)})")


def _decode_rgb(image: Image.Image, spec: ImageSpec, label: str, max_pixels: int) -> Image.Image:
    """Check the header's size, decode every pixel, convert to RGB as HF does."""
    width, height = image.size
    if width == 0 or height == 0:
        raise ImageProblem("empty_image", f"{label}: {width} x {height} image has no pixels")
    if width * height > max_pixels:
        raise ImageProblem("image_too_large", f"{label}: {width} x {height} = "
                           f"{_pixels(width * height)} pixels, over "
                           f"{MAX_PIXELS_SETTING}={max_pixels}")
    # Read where HF reads them: on the image as opened, before load().
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image.load()  # the full decode: a truncated or corrupt file fails here
            if not spec.do_convert_rgb:
                if image.mode != "RGB":
                    raise ImageProblem("unreadable_image", f"{label}: a {image.mode} image, and "
                                       f"do_convert_rgb=false (only RGB images are usable)")
                return image.copy()
            if has_alpha:  # onto opaque white, as HF (PIL's convert("RGB") drops the alpha)
                white = Image.new("RGBA", image.size, (255, 255, 255, 255))
                return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
            return image.convert("RGB")
    except ImageProblem:
        raise
    except Image.DecompressionBombError as e:  # some formats check again at load
        raise ImageProblem("image_too_large", f"{label}: {_one_line(e)}") from None
    except Exception as e:  # truncated data, a bad checksum, a mode PIL cannot convert
        raise ImageProblem("unreadable_image", f"{label}: cannot be decoded ({_one_line(e)})")


def resized_size(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """(height, width) an image of that size is resized to, before the crop (HF's rounding)."""
    if spec.resize == "exact":
        return spec.height, spec.width
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(spec.shortest_edge * long / short)  # HF truncates the float quotient
    return (new_long, spec.shortest_edge) if width <= height else (spec.shortest_edge, new_long)


def _center_crop(chw: np.ndarray, height: int, width: int) -> np.ndarray:
    """HF's centre crop: out[y, x] = in[y + (H - height) // 2, x + (W - width) // 2], else 0."""
    _, h, w = chw.shape
    if (h, w) == (height, width):
        return chw.copy()  # C order, writable (torch.from_numpy)
    top, left = (h - height) // 2, (w - width) // 2
    out = np.zeros((chw.shape[0], height, width), dtype=chw.dtype)
    y0, y1, x0, x1 = max(0, -top), min(height, h - top), max(0, -left), min(width, w - left)
    out[:, y0:y1, x0:x1] = chw[:, y0 + top:y1 + top, x0 + left:x1 + left]
    return out


def load_image(source: Source, spec: ImageSpec, max_pixels: int, *,
               name: Optional[str] = None) -> np.ndarray:
    """One image as uint8 ``[3, spec.height, spec.width]``: HF's processor's pixels before its
    rescale. ``source``: a path, or the file's bytes (``name`` labels them in messages). A bad
    image raises :class:`ImageProblem`; so does one whose resize before the crop (a very
    elongated image, CLIP) would exceed ``max_pixels``."""
    binary = isinstance(source, (bytes, bytearray, memoryview))
    label = name or (f"<{len(source)} bytes of image>" if binary else os.fspath(source))
    with _open(source, label, max_pixels) as image:
        rgb = _decode_rgb(image, spec, label, max_pixels)
    out_h, out_w = resized_size(rgb.height, rgb.width, spec)
    if out_h * out_w > max_pixels:
        raise ImageProblem("image_too_large", f"{label}: {rgb.width} x {rgb.height} image "
                           f"resized to {out_w} x {out_h} = {_pixels(out_h * out_w)} pixels before "
                           f"the crop, over {MAX_PIXELS_SETTING}={max_pixels}")
    resized = rgb.resize((out_w, out_h), resample=spec.resample)
    return _center_crop(np.asarray(resized).transpose(2, 0, 1), spec.height, spec.width)


@functools.lru_cache(maxsize=32)
def value_table(spec: ImageSpec) -> np.ndarray:
    """[3, 256] float32, read-only: HF's value for each (channel, uint8 value), made by HF's
    numpy steps (rescale in float64, normalise in float32). The rank looks its uint8 pixels up
    in it on the device (:func:`ray_ppu.model.pixels.normalize`)."""
    values = np.tile(np.arange(256, dtype=np.uint8), (3, 1))
    if spec.do_rescale:
        values = (values.astype(np.float64) * spec.rescale_factor).astype(np.float32)
    else:
        values = values.astype(np.float32)
    if spec.do_normalize:
        mean = np.asarray(spec.image_mean, dtype=np.float32)[:, None]
        values = (values - mean) / np.asarray(spec.image_std, dtype=np.float32)[:, None]
    table = np.ascontiguousarray(values, dtype=np.float32)
    table.flags.writeable = False  # shared by every caller through the cache
    return table


def image_spec(vision, model_dir=None) -> ImageSpec:
    """How a model's images are prepared: the image processor of ``model_dir``'s
    preprocessor_config.json when there is one, else the encoder family's (SigLIP: squash to
    the square; CLIP: short side, centre crop) at ``vision.image_size``."""
    if model_dir and os.path.isfile(os.path.join(model_dir, PROCESSOR_FILE)):
        path = os.path.join(model_dir, PROCESSOR_FILE)
        with open(path, encoding="utf-8") as f:
            return ImageSpec.from_hf(json.load(f), path)
    return (ImageSpec.siglip if vision.encoder == "siglip" else ImageSpec.clip)(vision.image_size)


def image_bytes_per_sample(spec: ImageSpec) -> int:
    """Bytes of one image as load_image gives it (uint8 [3, H, W]); float32 would be 4x."""
    return 3 * spec.height * spec.width
