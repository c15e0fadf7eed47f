"""Qwen2.5-VL inputs at native resolution against transformers 5: the reader's uint8 images
(native_images.load_native) made into pixel_values and grids on the rank
(native_pixels.patchify) equal Qwen2VLImageProcessorPil's output bit for bit; smart_resize
equals HF's; the M-RoPE positions (rope_index) equal Qwen2_5_VLModel.get_rope_index, per
sample and packed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_pil

from ray_ppu.data.images import ImageProblem
from ray_ppu.data.native_images import NativeImageSpec, load_native, smart_resize
from ray_ppu.data.rope_index import mrope_positions, packed_mrope_positions
from ray_ppu.errors import ConfigError
from ray_ppu.model.native_pixels import patchify

IMAGE_TOKEN, START, END = 5, 7, 8
BIG = 10 ** 9  # max_file_pixels that never binds


def _noise(rng, mode_shape):
    return rng.integers(0, 256, mode_shape, dtype=np.uint8)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """(name → path) of noise images: odd sizes, a tall thin one, one below min_pixels, one
    already on the 28 grid, RGBA with varied alpha, a palette image with a transparent index,
    grey, a JPEG."""
    rng, root = np.random.default_rng(0), tmp_path_factory.mktemp("pictures")
    made = {
        "odd.png": Image.fromarray(_noise(rng, (217, 333, 3))),
        "small_odd.png": Image.fromarray(_noise(rng, (45, 61, 3))),
        "tall_thin.png": Image.fromarray(_noise(rng, (1500, 30, 3))),
        "tiny.png": Image.fromarray(_noise(rng, (20, 30, 3))),
        "on_grid.png": Image.fromarray(_noise(rng, (56, 84, 3))),
        "rgba.png": Image.fromarray(_noise(rng, (90, 70, 4)), "RGBA"),
        "grey.png": Image.fromarray(_noise(rng, (64, 48)), "L"),
        "photo.jpg": Image.fromarray(_noise(rng, (120, 160, 3))),
    }
    palette = Image.fromarray(_noise(rng, (77, 101)) % 16, "P")
    palette.putpalette(list(_noise(rng, (16 * 3,))))
    palette.info["transparency"] = 3
    made["palette.png"] = palette
    paths = {}
    for name, image in made.items():
        paths[name] = root / name
        image.save(paths[name], **({"transparency": 3} if name == "palette.png" else {}))
    return paths


def _hf_and_ours(paths, spec):
    processor = hf_pil.Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels,
                                                max_pixels=spec.max_pixels)
    opened = [Image.open(p) for p in paths]
    expected = processor(images=opened, return_tensors="np")
    images = [torch.from_numpy(load_native(p, spec, BIG)) for p in paths]
    pixel_values, grid_thw = patchify(images, spec)
    return expected, images, pixel_values, grid_thw


def test_pixel_values_and_grids_equal_hf(pictures):
    spec = NativeImageSpec()
    paths = list(pictures.values())
    expected, images, pixel_values, grid_thw = _hf_and_ours(paths, spec)
    assert pixel_values.dtype == torch.float32 and pixel_values.shape[1] == 3 * 2 * 14 * 14
    assert torch.equal(grid_thw, torch.from_numpy(expected["image_grid_thw"]))
    assert torch.equal(pixel_values, torch.from_numpy(expected["pixel_values"]))
    for image, (t, h, w) in zip(images, grid_thw.tolist()):
        assert image.dtype == torch.uint8 and image.shape == (3, 14 * h, 14 * w)
        assert spec.tokens(image.shape[1], image.shape[2]) == h * w // 4
    # tiny (20 x 30) grew past min_pixels; on_grid kept its size
    assert tuple(images[3].shape[1:]) == (56, 84) and tuple(images[4].shape[1:]) == (56, 84)


def test_downscale_above_max_pixels_equals_hf(pictures):
    spec = NativeImageSpec(min_pixels=28 * 28, max_pixels=28 * 28 * 12)
    paths = [pictures[n] for n in ("odd.png", "tall_thin.png", "rgba.png", "palette.png")]
    expected, images, pixel_values, grid_thw = _hf_and_ours(paths, spec)
    assert torch.equal(grid_thw, torch.from_numpy(expected["image_grid_thw"]))
    assert torch.equal(pixel_values, torch.from_numpy(expected["pixel_values"]))
    assert all(im.shape[1] * im.shape[2] <= spec.max_pixels for im in images[::2])
    # HF's floor at one 28 column: the 30 x 1500 image ends up 28 x 672, over max_pixels
    assert tuple(images[1].shape[1:]) == (672, 28)
    assert tuple(images[0].shape[1:]) != (224, 336)  # the plain rounding would have been over


def test_patchify_of_nothing_and_of_a_bad_size():
    pixel_values, grid_thw = patchify([], NativeImageSpec())
    assert pixel_values.shape == (0, 1176) and grid_thw.shape == (0, 3)
    with pytest.raises(ValueError, match="multiples of 28"):
        patchify([torch.zeros(3, 28, 30, dtype=torch.uint8)], NativeImageSpec())


def test_smart_resize_equals_hf():
    sizes = [1, 2, 13, 14, 27, 28, 29, 41, 42, 55, 56, 57, 70, 99, 111, 140, 223, 224, 333,
             517, 1000, 1023, 2047, 3000]
    for min_pixels, max_pixels in ((56 * 56, 28 * 28 * 1280), (28 * 28, 28 * 28 * 12),
                                   (3136, 12845056), (100 * 100, 100 * 100)):
        for h in sizes:
            for w in sizes:
                if max(h, w) / min(h, w) > 200:
                    with pytest.raises(ValueError):
                        hf_pil.smart_resize(h, w, 28, min_pixels, max_pixels)
                    with pytest.raises(ImageProblem, match="aspect ratio") as e:
                        smart_resize(h, w, 28, min_pixels, max_pixels)
                    assert e.value.reason == "image_aspect"
                    continue
                assert smart_resize(h, w, 28, min_pixels, max_pixels) == \
                    hf_pil.smart_resize(h, w, 28, min_pixels, max_pixels), (h, w)


def test_load_native_refusals(tmp_path):
    thin = tmp_path / "thin.png"
    Image.new("RGB", (1, 250)).save(thin)
    with pytest.raises(ImageProblem, match=r"thin.png: 1 x 250 image: aspect ratio 250") as e:
        load_native(thin, NativeImageSpec(), BIG)
    assert e.value.reason == "image_aspect"
    with pytest.raises(ImageProblem) as e:
        load_native(tmp_path / "absent.png", NativeImageSpec(), BIG)
    assert e.value.reason == "missing_image"
    with pytest.raises(ImageProblem) as e:
        load_native(thin, NativeImageSpec(), 100, label="rec 3")
    assert e.value.reason == "image_too_large" and e.value.message.startswith("rec 3: ")


QWEN25_CONFIG = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
                 "temporal_patch_size": 2, "merge_size": 2,
                 "image_mean": [0.48145466, 0.4578275, 0.40821073],
                 "image_std": [0.26862954, 0.26130258, 0.27577711],
                 "image_processor_type": "Qwen2VLImageProcessor",
                 "processor_class": "Qwen2_5_VLProcessor"}


def test_spec_from_and_to_hf():
    spec = NativeImageSpec.from_hf(QWEN25_CONFIG, "qwen/preprocessor_config.json")
    assert spec == NativeImageSpec(max_pixels=12845056) and spec.factor == 28
    assert spec.grid(56, 84) == (1, 4, 6) and spec.tokens(56, 84) == 6
    sized = dict(QWEN25_CONFIG, size={"shortest_edge": 100, "longest_edge": 5000})
    del sized["min_pixels"]
    assert NativeImageSpec.from_hf(sized, "x").min_pixels == 100  # max_pixels: top level wins
    assert NativeImageSpec.from_hf({}, "x") == NativeImageSpec()
    # transformers loads to_hf back to the same settings
    back = hf_pil.Qwen2VLImageProcessorPil.from_dict(spec.to_hf())
    assert (back.size["shortest_edge"], back.size["longest_edge"]) == (3136, 12845056)
    assert NativeImageSpec.from_hf(back.to_dict(), "x") == spec
    assert hash(spec) == hash(NativeImageSpec.from_hf(spec.to_hf(), "x"))


def test_spec_problems():
    assert NativeImageSpec().problems() == []
    assert NativeImageSpec(min_pixels=5000, max_pixels=4000).problems() == [
        "min_pixels=5000 is over max_pixels=4000: no size fits between them"]
    with pytest.raises(ConfigError, match=r"^p.json: min_pixels=9 is over max_pixels=8"):
        NativeImageSpec.from_hf({"min_pixels": 9, "max_pixels": 8}, "p.json")
    with pytest.raises(ConfigError, match="do_pad=True is not understood"):
        NativeImageSpec.from_hf({"do_pad": True}, "p.json")
    with pytest.raises(ConfigError, match="image_processor_type='CLIPImageProcessor'"):
        NativeImageSpec.from_hf({"image_processor_type": "CLIPImageProcessor"}, "p.json")
    with pytest.raises(ConfigError, match="lacks longest_edge"):
        NativeImageSpec.from_hf({"size": {"shortest_edge": 10}}, "p.json")
    assert "image_std=(1.0, 0.0, 1.0) must be free of zeros" in \
        NativeImageSpec(image_std=(1, 0, 1)).problems()


@pytest.fixture(scope="module")
def hf_model():
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, vocab_size=64,
                         bos_token_id=None, eos_token_id=None,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                              mrope_section=[2, 1, 1])),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                           out_hidden_size=16, fullatt_block_indexes=[0]),
        image_token_id=IMAGE_TOKEN, video_token_id=6, vision_start_token_id=START,
        vision_end_token_id=END)
    return Qwen2_5_VLModel(config).eval()


def _hf_positions(model, ids, grids):
    ids = torch.tensor([list(ids)])
    positions, _ = model.get_rope_index(
        ids, (ids == IMAGE_TOKEN).int(),
        image_grid_thw=torch.tensor(grids, dtype=torch.int64) if grids else None)
    return positions[:, 0].numpy()


def _sample(rng, grids, text=(3, 9)):
    """Text, then per grid <vision_start> its tokens <vision_end> text."""
    ids = list(rng.integers(10, 60, rng.integers(*text)))
    for t, h, w in grids:
        ids += [START] + [IMAGE_TOKEN] * (t * h * w // 4) + [END]
        ids += list(rng.integers(10, 60, rng.integers(*text)))
    return np.array(ids)


SAMPLES = [[], [(1, 4, 6)], [(1, 10, 4), (1, 2, 2)], [(1, 6, 16), (1, 8, 8), (1, 12, 2)]]


def test_mrope_positions_equal_get_rope_index(hf_model):
    rng = np.random.default_rng(1)
    for grids in SAMPLES:
        ids = _sample(rng, grids)
        ours = mrope_positions(ids, grids, IMAGE_TOKEN)
        assert ours.dtype == np.int64 and ours.shape == (3, len(ids))
        np.testing.assert_array_equal(ours, _hf_positions(hf_model, ids, grids))


def test_packed_positions_restart_per_sample(hf_model):
    rng = np.random.default_rng(2)
    samples = [_sample(rng, grids) for grids in SAMPLES[1:] + SAMPLES[:1]]
    grids = [g for grids in SAMPLES[1:] + SAMPLES[:1] for g in grids]
    lengths = [len(s) for s in samples]
    row = np.concatenate(samples + [np.zeros(11, np.int64)])  # 11 padding tokens
    ours = packed_mrope_positions(row, lengths, grids, IMAGE_TOKEN)
    expected = [_hf_positions(hf_model, s, g) for s, g in zip(samples, SAMPLES[1:] + SAMPLES[:1])]
    expected.append(np.tile(np.arange(11), (3, 1)))
    np.testing.assert_array_equal(ours, np.concatenate(expected, axis=1))


def test_position_errors_name_the_counts():
    ids = _sample(np.random.default_rng(3), [(1, 4, 6), (1, 2, 2)])
    with pytest.raises(ValueError, match="2 runs of image tokens but 1 image grids"):
        mrope_positions(ids, [(1, 4, 6)], IMAGE_TOKEN)
    with pytest.raises(ValueError, match=r"image 1 \(grid \(1, 4, 4\)\) needs 4 image tokens, "
                                         r"its run at token \d+ has 1"):
        mrope_positions(ids, [(1, 4, 6), (1, 4, 4)], IMAGE_TOKEN)
    with pytest.raises(ValueError, match="sample 1 has 2 runs of image tokens but only 0 of 2"):
        packed_mrope_positions(np.concatenate([ids, ids]), [len(ids)] * 2,
                               [(1, 4, 6), (1, 2, 2)], IMAGE_TOKEN)
    with pytest.raises(ValueError, match="have 2 runs of image tokens but 3 image grids"):
        packed_mrope_positions(ids, [len(ids)], [(1, 4, 6), (1, 2, 2), (1, 2, 2)], IMAGE_TOKEN)


def test_reader_modules_import_no_torch():
    code = ("import ray_ppu.data.native_images, ray_ppu.data.rope_index, sys; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
