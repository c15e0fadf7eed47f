"""Image decoding and preprocessing (ray_ppu/data/images.py) against Hugging Face's processors.

What must hold: ``normalize(load_image(...))`` is bit-identical (torch.equal, difference 0) to
the ``pixel_values`` of transformers' SiglipImageProcessor / CLIPImageProcessor, built from the
same preprocessor_config.json dict, for Pillow-drawn PNG / JPEG / GIF files in modes RGB, L, P (with
and without transparency), RGBA, LA, CMYK, I;16 and 1, of every shape (landscape, portrait,
1 × N, smaller than the crop); ``to_hf`` exports a config that loads back to the same values;
every bad image raises ImageProblem with its reason and its path; a configuration that cannot be
reproduced exactly is refused in one line naming the key.

The processors are transformers' PIL backend: torchvision is not installed here, so that is also
what AutoImageProcessor gives (checked); the torchvision backend resizes tensors, not with PIL.
"""

import importlib.util
import io
import json
import pickle
import struct
import time
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFile

from ray_ppu.data.images import (
    IMAGE_REASONS,
    ImageProblem,
    ImageSpec,
    image_bytes_per_sample,
    load_image,
    resized_size,
)
from ray_ppu.model.pixels import normalize

transformers = pytest.importorskip("transformers")

MAX_PIXELS = 10**8

CONFIGS = {
    # google/siglip-so400m-patch14-384's preprocessor_config.json.
    "siglip384": {"do_normalize": True, "do_rescale": True, "do_resize": True,
                  "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "SiglipImageProcessor",
                  "image_std": [0.5, 0.5, 0.5], "processor_class": "SiglipProcessor",
                  "resample": 3, "rescale_factor": 0.00392156862745098,
                  "size": {"height": 384, "width": 384}},
    # The tiny-vl preset's: everything else SigLIP's defaults.
    "siglip32": {"image_processor_type": "SiglipImageProcessor",
                 "size": {"height": 32, "width": 32}},
    # llava-hf/llava-1.5-7b-hf's, with the nulls transformers' fast processors used to save.
    "clip336": {"crop_size": {"height": 336, "width": 336}, "do_center_crop": True,
                "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
                "do_resize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_processor_type": "CLIPImageProcessor",
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "processor_class": "LlavaProcessor", "resample": 3,
                "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 336},
                "do_pad": None, "pad_size": None, "data_format": "channels_first",
                "input_data_format": None, "device": None},
    # openai/clip-vit-*'s older form: a feature extractor type, ints for the sizes.
    "clip28": {"feature_extractor_type": "CLIPFeatureExtractor", "size": 28, "crop_size": 28,
               "do_center_crop": True, "do_normalize": True, "do_resize": True, "resample": 3,
               "image_mean": [0.48145466, 0.4578275, 0.40821073],
               "image_std": [0.26862954, 0.26130258, 0.27577711]},
    # A crop larger than the resized image (zero padding), not square; bilinear, one-number mean,
    # another rescale factor.
    "clip_pad": {"image_processor_type": "CLIPImageProcessorFast", "size": {"shortest_edge": 20},
                 "crop_size": {"height": 24, "width": 30}, "resample": 2, "image_mean": 0.3,
                 "image_std": [0.2, 0.25, 0.3], "rescale_factor": 1 / 127.5},
    # Not square, size as [height, width], Lanczos, no normalisation.
    "siglip_rect": {"image_processor_type": "SiglipImageProcessorFast", "size": [20, 30],
                    "resample": 1, "do_normalize": False},
}


def _write_config(directory, config) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "preprocessor_config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name → transformers' processor, loaded from that config as a checkpoint's would be."""
    root = tmp_path_factory.mktemp("processors")
    return {name: transformers.AutoImageProcessor.from_pretrained(
                _write_config(root / name, config), backend="pil")
            for name, config in CONFIGS.items()}


def _drawing(width: int, height: int, seed: int) -> Image.Image:
    """A gradient with shapes, lines and a noise patch: smooth and sharp content for the filters."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1),
                     127 + 120 * np.sin((x + y) / 5.0)], axis=-1)
    image = Image.fromarray(base.round().astype(np.uint8))
    draw = ImageDraw.Draw(image)
    draw.ellipse([width // 5, height // 5, width * 3 // 4, height * 4 // 5], fill=(250, 30, 60),
                 outline=(0, 0, 0))
    draw.rectangle([0, 0, width // 3, height // 3], fill=(12, 200, 34))
    draw.line([0, height - 1, width - 1, 0], fill=(255, 255, 255), width=2)
    patch = rng.integers(0, 256, (max(height // 4, 1), max(width // 4, 1), 3), dtype=np.uint8)
    image.paste(Image.fromarray(patch), (width // 2, height // 2))
    return image


def _with_alpha(image: Image.Image) -> Image.Image:
    w, h = image.size
    alpha = (np.add.outer(np.arange(h), np.arange(w)) * 255 // max(w + h - 2, 1)).astype(np.uint8)
    alpha[: h // 3, : w // 3] = 0  # fully transparent over the green rectangle
    rgba = image.convert("RGBA")
    rgba.putalpha(Image.fromarray(alpha))
    return rgba


def _make_pictures(directory) -> dict:
    out = {}

    def save(name, image, **kwargs):
        out[name] = directory / name
        image.save(out[name], **kwargs)

    save("rgb_landscape.png", _drawing(97, 61, 1))
    save("rgb_portrait.jpg", _drawing(45, 113, 2), quality=90)
    save("rgb_large.jpg", _drawing(640, 480, 3), quality=85)
    save("rgb_tiny.png", _drawing(11, 7, 4))  # smaller than every crop
    save("rgb_column.png", _drawing(1, 40, 5))  # 1 × N
    save("rgb_row.png", _drawing(37, 1, 6))
    save("l_square.png", _drawing(64, 64, 7).convert("L"))
    save("p.png", _drawing(70, 50, 8).quantize(32))
    palette = _drawing(50, 70, 9).quantize(16)
    save("p_transparent.png", palette, transparency=int(np.asarray(palette)[0, 0]))
    save("p_transparent.gif", palette, transparency=int(np.asarray(palette)[-1, -1]))
    save("rgb_trns.png", _drawing(40, 30, 10), transparency=(12, 200, 34))  # the rectangle's green
    save("rgba.png", _with_alpha(_drawing(57, 41, 11)))
    save("la.png", _with_alpha(_drawing(33, 71, 12)).convert("LA"))
    save("cmyk.jpg", _drawing(80, 52, 13).convert("CMYK"), quality=92)
    # 16-bit grey from 0 to 469: Pillow's I;16 → RGB clips at 255, so both sides are exercised.
    ramp = (np.add.outer(np.arange(30), np.arange(40)) * 7).astype(np.uint16)
    save("i16.png", Image.fromarray(ramp))
    save("one_bit.png", _drawing(29, 47, 14).convert("1"))
    return out


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    return _make_pictures(tmp_path_factory.mktemp("pictures"))


def _theirs(processor, path, **overrides):
    with Image.open(path) as image:
        return processor(images=image, return_tensors="pt", **overrides).pixel_values[0]


def _ours(path, spec):
    return normalize(torch.from_numpy(load_image(path, spec, MAX_PIXELS)), spec)


def test_pictures_cover_the_modes(pictures):
    modes = set()
    for path in pictures.values():
        with Image.open(path) as image:
            modes.add(image.mode)
    assert {"RGB", "L", "P", "RGBA", "LA", "CMYK", "I;16", "1"} <= modes


@pytest.mark.parametrize("config", CONFIGS)
def test_pixel_values_equal_hf(config, hf, pictures):
    spec = ImageSpec.from_hf(CONFIGS[config], where=f"{config}/preprocessor_config.json")
    for name, path in pictures.items():
        theirs, ours = _theirs(hf[config], path), _ours(path, spec)
        assert ours.dtype == theirs.dtype == torch.float32, name
        assert ours.shape == theirs.shape == (3, spec.height, spec.width), name
        # Exact: the difference is 0 for every value (no tolerance needed).
        assert torch.equal(ours, theirs), (name, (ours - theirs).abs().max().item())


@pytest.mark.parametrize("config", ["siglip384", "clip336", "clip_pad"])
def test_uint8_stage_equals_hf_before_rescale(config, hf, pictures):
    """load_image is HF's image after convert, resize and crop, before any float arithmetic."""
    spec = ImageSpec.from_hf(CONFIGS[config], where=config)
    for name, path in pictures.items():
        theirs = _theirs(hf[config], path, do_rescale=False, do_normalize=False)
        assert theirs.dtype == torch.uint8, name
        assert np.array_equal(load_image(path, spec, MAX_PIXELS), theirs.numpy()), name


def test_default_processor_is_the_pil_backend(tmp_path):
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: AutoImageProcessor's default is its backend")
    directory = _write_config(tmp_path / "siglip", CONFIGS["siglip384"])
    processor = transformers.AutoImageProcessor.from_pretrained(directory)
    assert processor.backend == "pil" and type(processor).__name__ == "SiglipImageProcessorPil"


@pytest.mark.parametrize("config", CONFIGS)
def test_to_hf_round_trips(config, pictures, tmp_path):
    spec = ImageSpec.from_hf(CONFIGS[config], where=config)
    exported = spec.to_hf()
    assert ImageSpec.from_hf(json.loads(json.dumps(exported)), where="exported") == spec
    processor = transformers.AutoImageProcessor.from_pretrained(
        _write_config(tmp_path, exported), backend="pil")
    for name in ("rgba.png", "rgb_portrait.jpg", "rgb_tiny.png"):
        assert torch.equal(_theirs(processor, pictures[name]), _ours(pictures[name], spec)), name


def test_constructors_are_the_checkpoints_defaults():
    assert ImageSpec.siglip(384) == ImageSpec.from_hf(CONFIGS["siglip384"], "s")
    assert ImageSpec.siglip(32) == ImageSpec.from_hf(CONFIGS["siglip32"], "s")
    assert ImageSpec.clip(336) == ImageSpec.from_hf(CONFIGS["clip336"], "c")
    assert ImageSpec.clip(28) == ImageSpec.from_hf(CONFIGS["clip28"], "c")
    assert image_bytes_per_sample(ImageSpec.siglip(384)) == 3 * 384 * 384


def test_resized_size_rounds_as_hf():
    clip = ImageSpec.clip(336)
    assert resized_size(480, 640, clip) == (336, 448)
    assert resized_size(1000, 3, clip) == (112000, 336)  # int(336 * 1000 / 3) = 112000
    assert resized_size(7, 11, clip) == (336, 528)  # 528.0
    assert resized_size(7, 10, clip) == (336, 480)
    assert resized_size(3, 1000, ImageSpec.siglip(32)) == (32, 32)


def test_transparent_pixels_become_white(pictures):
    """HF composites alpha onto white; PIL's convert("RGB") would keep the green underneath."""
    same_size = ImageSpec(height=41, width=57, resample=0)  # no resize, no crop
    pixels = load_image(pictures["rgba.png"], same_size, MAX_PIXELS)
    assert pixels[:, 0, 0].tolist() == [255, 255, 255]
    with Image.open(pictures["rgba.png"]) as image:
        assert image.convert("RGB").getpixel((0, 0)) == (12, 200, 34)


def test_bytes_and_batches(pictures):
    spec = ImageSpec.clip(28)
    path = pictures["rgba.png"]
    from_bytes = load_image(path.read_bytes(), spec, MAX_PIXELS, name="shard-0/rgba.png")
    assert np.array_equal(from_bytes, load_image(path, spec, MAX_PIXELS))
    batch = torch.stack([torch.from_numpy(load_image(pictures[n], spec, MAX_PIXELS))
                         for n in ("rgba.png", "cmyk.jpg")])
    assert batch.dtype == torch.uint8 and batch.shape == (2, 3, 28, 28)
    out = normalize(batch, spec)
    assert out.shape == batch.shape and out.dtype == torch.float32
    assert torch.equal(out[1], normalize(batch[1], spec))
    with pytest.raises(ValueError, match="uint8"):
        normalize(batch.float(), spec)


def test_float32_arithmetic_would_not_be_exact():
    """Why normalize looks values up: HF rescales in float64; float32 arithmetic on the device
    lands a few ulp off for some values (measured here: 4.8e-7, 2 ulp at |x| ≈ 2)."""
    spec = ImageSpec.clip(336)
    values = torch.arange(256, dtype=torch.uint8).view(1, 1, 256).expand(3, 1, 256)
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (spec.image_mean, spec.image_std))
    direct = (values.float() * spec.rescale_factor - mean) / std
    difference = (direct - normalize(values.contiguous(), spec)).abs().max().item()
    assert 0 < difference <= 1e-6


# -- bad images ------------------------------------------------------------------------------


def _problem(source, reason, max_pixels=MAX_PIXELS, spec=ImageSpec.siglip(32)) -> str:
    with pytest.raises(ImageProblem) as caught:
        load_image(source, spec, max_pixels)
    assert caught.value.reason == reason, caught.value.message
    assert "\n" not in caught.value.message and str(caught.value) == caught.value.message
    return caught.value.message


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width × height (RGB, 8 bits) with one tiny IDAT."""
    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


def test_missing_image(tmp_path):
    path = tmp_path / "gone.jpg"
    assert str(path) in _problem(path, "missing_image")


def test_unreadable_images(tmp_path, pictures):
    text = tmp_path / "notes.jpg"
    text.write_text("not an image\n")
    assert str(text) in _problem(text, "unreadable_image")
    for name in ("rgb_large.jpg", "rgb_landscape.png"):  # the first half of a real file
        half = tmp_path / f"half_{name}"
        data = pictures[name].read_bytes()
        half.write_bytes(data[: len(data) // 2])
        message = _problem(half, "unreadable_image")
        assert str(half) in message and "truncated" in message
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False  # what finding truncation relies on
    message = _problem(pictures["l_square.png"], "unreadable_image",
                       spec=ImageSpec(height=8, width=8, do_convert_rgb=False))
    assert "l_square.png" in message and "do_convert_rgb=false" in message


def test_empty_image(monkeypatch, tmp_path):
    """Pillow refuses to open a zero-width or zero-height file of every format tried (PNG, JPEG,
    GIF, BMP, PPM headers), so the check is tested on an image Pillow makes in memory."""
    monkeypatch.setattr(Image, "open", lambda fp: Image.new("RGB", (0, 5)))
    message = _problem(tmp_path / "blank.png", "empty_image")
    assert "blank.png" in message and "0 x 5" in message


def test_image_too_large_is_found_before_decoding(monkeypatch, tmp_path):
    def no_decode(self):
        raise AssertionError("pixels were decoded")
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    cases = [(100_000, 100_000, 10**9, "1e10 pixels"),  # refused by Pillow's own bomb check
             (12_000, 8_000, 10**6, "12000 x 8000 = 9.6e7 pixels"),  # Pillow would only warn
             (300, 200, 10_000, "300 x 200 = 60000 pixels")]
    for width, height, limit, numbers in cases:
        path = tmp_path / f"{width}x{height}.png"
        path.write_bytes(_png_header(width, height))
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing may be printed
            message = _problem(path, "image_too_large", max_pixels=limit)
        assert time.perf_counter() - start < 0.5
        assert str(path) in message and numbers in message, message
        assert f"data.max_image_pixels={limit}" in message


def test_elongated_image_too_large_after_resize(pictures):
    message = _problem(pictures["rgb_column.png"], "image_too_large", max_pixels=100_000,
                       spec=ImageSpec.clip(336))
    assert "1 x 40 image resized to 336 x 13440" in message


def test_image_problem_pickles():
    problem = pickle.loads(pickle.dumps(ImageProblem("empty_image", "a.png: 0 x 5 image")))
    assert (problem.reason, problem.message) == ("empty_image", "a.png: 0 x 5 image")
    assert set(IMAGE_REASONS) == {"missing_image", "unreadable_image", "empty_image",
                                  "image_too_large", "image_aspect"}
    with pytest.raises(ValueError):
        ImageProblem("ugly_image", "x")


# -- configurations that cannot be reproduced ----------------------------------------------

CLIP = CONFIGS["clip336"]
REFUSED = [
    (dict(CLIP, image_processor_type="LlavaNextImageProcessor"), "image_processor_type"),
    ({"size": {"height": 384, "width": 384}}, "image_processor_type"),
    (dict(CLIP, do_pad=True), "do_pad"),
    (dict(CLIP, do_resize=False), "do_resize"),
    (dict(CLIP, size={"shortest_edge": 336, "longest_edge": 672}), "size"),
    (dict(CLIP, do_center_crop=False), "do_center_crop"),
    (dict(CLIP, size={"height": 384, "width": 384}), "crop_size"),
    (dict(CLIP, image_mean=[0.5, 0.5]), "image_mean"),
    (dict(CLIP, image_std=[0.5, 0.0, 0.5]), "image_std"),
    (dict(CLIP, resample=7), "resample"),
    (dict(CLIP, use_square_size=True), "use_square_size"),
    (dict(CLIP, image_grid_pinpoints=[[336, 672]]), "image_grid_pinpoints"),
    ({"image_processor_type": "SiglipImageProcessor", "size": 384}, "do_center_crop"),
]


@pytest.mark.parametrize("config,key", REFUSED)
def test_from_hf_refuses_in_one_line(config, key):
    with pytest.raises(ValueError) as caught:
        ImageSpec.from_hf(config, where="ckpt/preprocessor_config.json")
    message = str(caught.value)
    assert message.startswith("ckpt/preprocessor_config.json: ") and "\n" not in message
    assert message.count("preprocessor_config.json") == 1
    assert key in message, message


def test_spec_validates_itself():
    with pytest.raises(ValueError, match=r"ImageSpec\.height=0"):
        ImageSpec(height=0, width=4)
    with pytest.raises(ValueError, match=r"ImageSpec\.shortest_edge=None"):
        ImageSpec(height=4, width=4, resize="shortest_edge")
    with pytest.raises(ValueError, match=r"ImageSpec\.resize='pad'"):
        ImageSpec(height=4, width=4, resize="pad")
