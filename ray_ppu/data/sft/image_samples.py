"""Images in SFT samples: where their files are, how many tokens they take, how rows hold them.

A vision-language sample is a text sample whose user turns hold ``<image>`` tags, one per
image of the record (:func:`ray_ppu.data.sft.records.check_image_tags`). The chat encoder writes
each tag as :attr:`VisionData.tokens_per_image` copies of the image token (Hugging Face's LLaVA
processor expands its ``<image>`` token the same way), never in the loss.

Rows keep each image as its file's bytes, not its pixels: the Ray Data task that packs a
window reads the sample's images and decodes each once to check it (a bad image is counted
there, with its record), and stores the bytes (``image_bytes``: the row's images one after the
other, ``image_lengths`` int64 ``[max_images_per_row]``, ``num_images`` int32). Decoded pixels
would take ~8x the disk of the JPEGs they come from (432 KiB per 384 px image: ~240 GB for
Bunny's 558K), and a shared disk serves one sequential blob faster than 558K small files. The
reader process that serves a rank decodes them again (:func:`decode_rows`, the same Pillow
code, so the same pixels) into the fixed-shape uint8 ``images`` column ``[max_images_per_row,
3, H, W]`` the ranks receive; uint8 is the wire format, 4x fewer bytes than float32, and the
rank normalises on its device (:func:`ray_ppu.model.pixels.normalize`).

A row holds at most ``row_length // tokens_per_image`` images (every image's tokens are in
the row), which fixes the column's width. A sample cut to the row length keeps whole images
only: it is cut before an image whose tokens would not all fit.

Qwen2.5-VL (``VisionData.native``) takes each image at its own size, so an image's token
count is known only once its size is: the window reads each record's images *before* encoding
it (:func:`read_native_images`, one decode and resize each, as the check), and each ``<image>``
tag becomes <|vision_start|>, that image's pads, <|vision_end|>. The reader decodes a row's
images to uint8 ``[3, H, W]`` at their resized sizes and sends them as one flat ``pixels``
array per row (an object column: rows differ in bytes) with ``image_sizes`` ``[slots, 2]``;
it also turns the row's ``position_ids`` into M-RoPE's ``[3, s]``
(:func:`ray_ppu.data.rope_index.packed_mrope_positions`), each packed sample from 0.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from ray_ppu.data.images import ImageProblem, ImageSpec, image_spec, load_image
from ray_ppu.data.native_images import NativeImageSpec, load_native
from ray_ppu.data.rope_index import packed_mrope_positions
from ray_ppu.data.sft.records import RecordProblem

@dataclass(frozen=True)
class VisionData:
    """How a vision-language model's samples carry images."""

    token_id: int
    """The image token's id (``vision.image_token_id``)."""
    tokens_per_image: int
    """Positions one image takes (``vision.image_tokens``); native: the fewest it can take
    with its <|vision_start|> and <|vision_end|> (1 + 2), which sizes the row's slots."""
    spec: Union[ImageSpec, NativeImageSpec]
    """How pixels are prepared (the model's Hugging Face image processor)."""
    max_pixels: int
    """Largest image accepted, in pixels (``data.max_image_pixels``)."""
    image_root: Optional[str] = None
    """Directory relative image paths are under (``data.image_root``); None: the directory
    of the JSON file that names them."""
    start_id: Optional[int] = None
    """Native: <|vision_start|>'s id (``vision.vision_start_token_id``); <|vision_end|> is
    the next id, as in every Qwen2-VL vocabulary."""

    @property
    def native(self) -> bool:
        """Images at their own resolution (Qwen2.5-VL)."""
        return isinstance(self.spec, NativeImageSpec)

    def image_ids(self, tokens: int) -> list[int]:
        """The ids an image of ``tokens`` positions is written as in the text."""
        pads = [self.token_id] * tokens
        return [self.start_id, *pads, self.start_id + 1] if self.native else pads

    def resolve(self, paths: Sequence[str], record_file: str) -> list[str]:
        """Absolute paths of a record's images."""
        root = self.image_root or os.path.dirname(os.path.abspath(record_file))
        return [p if os.path.isabs(p) else os.path.join(root, p) for p in paths]

    def slots(self, row_length: int) -> int:
        """Images a row can hold: ``row_length // tokens_per_image``."""
        return row_length // self.tokens_per_image


def native_spec(vision, model_dir=None) -> NativeImageSpec:
    """Qwen2.5-VL's processor settings: ``model_dir``'s preprocessor_config.json when it has
    one (mean, std, resample), the vision section's patch, merge and pixel bounds."""
    import json

    from ray_ppu.data.images import PROCESSOR_FILE

    path = Path(model_dir).expanduser() / PROCESSOR_FILE if model_dir else None
    base = (NativeImageSpec.from_hf(json.loads(path.read_text()), str(path))
            if path is not None and path.is_file() else NativeImageSpec())
    return dataclasses.replace(base, patch_size=vision.patch_size,
                               temporal_patch_size=vision.temporal_patch_size,
                               merge_size=vision.spatial_merge_size,
                               min_pixels=vision.min_pixels, max_pixels=vision.max_pixels)


def vision_data(cfg) -> VisionData:
    """The image settings of a vision-language run (``cfg``: its RunConfig), its image
    processor that of data.image_processor, else of checkpoint.pretrained
    (:func:`image_spec`, :func:`native_spec`)."""
    vision, model_dir = cfg.vision, processor_dir(cfg)
    if vision.native:
        return VisionData(vision.image_token_id, 3, native_spec(vision, model_dir),
                          cfg.data.max_image_pixels, cfg.data.image_root,
                          vision.vision_start_token_id)
    return VisionData(vision.image_token_id, vision.image_tokens,
                      image_spec(vision, model_dir),
                      cfg.data.max_image_pixels, cfg.data.image_root)


def processor_dir(cfg) -> Optional[str]:
    """Whose preprocessor_config.json prepares a run's images: data.image_processor (the
    launch fills it in: :func:`ray_ppu.checkpoint.processor.image_processor_dir`), else
    checkpoint.pretrained; None: the encoder's default."""
    return cfg.data.image_processor or cfg.checkpoint.pretrained


def processor_file(cfg) -> Optional[bytes]:
    """The ``preprocessor_config.json`` a vision-language run's images are prepared by (None:
    a text model): its source's file as it is when its values are the ones in effect, else
    the values in effect written over it (Qwen2.5-VL's pixel bounds come from the vision
    section), so that transformers prepares images alike."""
    import json

    from ray_ppu.data.images import PROCESSOR_FILE

    if not cfg.vision.enabled:
        return None
    model_dir, spec = processor_dir(cfg), vision_data(cfg).spec
    if model_dir is not None and not (Path(model_dir) / PROCESSOR_FILE).is_file():
        model_dir = None
    if model_dir is None:
        return (json.dumps(spec.to_hf(), indent=2) + "\n").encode()
    path = Path(model_dir) / PROCESSOR_FILE
    given = json.loads(path.read_text())
    as_given = (NativeImageSpec if cfg.vision.native else ImageSpec).from_hf(given, str(path))
    if as_given == spec:
        return path.read_bytes()
    return (json.dumps({**given, **spec.to_hf()}, indent=2) + "\n").encode()


def check_fit(vision: VisionData, row_length: int, n_images: int) -> None:
    """A RecordProblem when a record's images alone fill the row."""
    if n_images * vision.tokens_per_image >= row_length:
        raise RecordProblem("image_tokens_too_long", f"{n_images} image(s) of "
                            f"{vision.tokens_per_image} tokens fill the {row_length}-token row")


def check_native_fit(vision: VisionData, row_length: int, tokens: Sequence[int]) -> None:
    """A RecordProblem when a record's resized images alone fill the row."""
    taken = sum(len(vision.image_ids(n)) for n in tokens)
    if taken >= row_length:
        raise RecordProblem("image_tokens_too_long", f"{len(tokens)} image(s) of {list(tokens)} "
                            f"tokens after resizing (+2 each for <|vision_start|> / "
                            f"<|vision_end|>) fill the {row_length}-token row (data.seq_length)")


def _first_cut_image(tokens: np.ndarray, vision: VisionData) -> tuple[int, Optional[int]]:
    """(whole images, where the first image cut by the row's end starts; None: none cut)."""
    if vision.native:  # an image is whole when its <|vision_end|> made it into the row
        starts = np.flatnonzero(tokens == vision.start_id)
        kept = int(np.count_nonzero(tokens == vision.start_id + 1))
        return kept, (int(starts[kept]) if len(starts) > kept else None)
    places = np.flatnonzero(tokens == vision.token_id)
    kept = len(places) // vision.tokens_per_image
    cut = len(places) % vision.tokens_per_image
    return kept, (int(places[kept * vision.tokens_per_image]) if cut else None)


def whole_images(sample: tuple, vision: VisionData, row_length: int):
    """``sample`` (tokens, labels, loss_mask, truncated) with only whole images, and how many
    images it keeps (None when nothing with loss is left before the first cut image)."""
    tokens, labels, mask, truncated = sample
    kept, end = _first_cut_image(tokens, vision)
    if end is not None:  # the cut fell inside an image: cut before it
        if not mask[:end].any():
            return None, 0
        last = int(np.flatnonzero(mask[:end])[-1]) + 1  # no trailing tokens without loss
        tokens, labels, mask, truncated = tokens[:last], labels[:last], mask[:last], True
    return (tokens, labels, mask, truncated), kept


def read_native_images(paths: Sequence[str], vision: VisionData) -> tuple[list[bytes], list[int]]:
    """The images' file bytes and their token counts at the resized sizes, each image decoded
    and resized once to check it (a bad image: a RecordProblem with its reason)."""
    data, tokens = [], []
    for path in paths:
        try:
            raw = Path(path).read_bytes()
        except OSError:
            raw = None
        try:
            pixels = load_native(path if raw is None else raw, vision.spec, vision.max_pixels,
                                 label=path)
        except ImageProblem as problem:
            raise RecordProblem(problem.reason, problem.message) from None
        if raw is None:
            raise RecordProblem("unreadable_image", f"{path}: cannot be read")
        data.append(raw)
        tokens.append(vision.spec.tokens(pixels.shape[1], pixels.shape[2]))
    return data, tokens


def read_images(paths: Sequence[str], vision: VisionData) -> list[bytes]:
    """The images' file bytes, each decoded once to check it; a bad image is a RecordProblem
    with its reason (missing_image, unreadable_image, empty_image, image_too_large)."""
    out = []
    for path in paths:
        try:
            data = Path(path).read_bytes()
        except OSError:  # the path's own check below names why (missing, a directory, ...)
            data = None
        try:
            load_image(path if data is None else data, vision.spec, vision.max_pixels, name=path)
        except ImageProblem as problem:
            raise RecordProblem(problem.reason, problem.message) from None
        if data is None:
            raise RecordProblem("unreadable_image", f"{path}: cannot be read")
        out.append(data)
    return out


def image_columns(groups: Sequence[Sequence[tuple]], vision: VisionData,
                  row_length: int) -> dict[str, np.ndarray]:
    """The ``image_bytes`` / ``image_lengths`` / ``num_images`` columns of rows made of
    ``groups`` of samples (each sample's image bytes last in its tuple), in row order."""
    slots = vision.slots(row_length)
    blobs = np.empty(len(groups), object)
    lengths = np.zeros((len(groups), slots), np.int64)
    counts = np.zeros(len(groups), np.int32)
    for r, group in enumerate(groups):
        images = [data for sample in group for data in sample[-1]]
        if len(images) > slots:  # each image takes tokens_per_image of the row's positions
            raise AssertionError(f"{len(images)} images in a row of {slots} slots")
        blobs[r] = b"".join(images)
        lengths[r, :len(images)] = [len(data) for data in images]
        counts[r] = len(images)
    return {"image_bytes": blobs, "image_lengths": lengths, "num_images": counts}


def decode_rows(rows: dict[str, np.ndarray], vision: VisionData) -> dict[str, np.ndarray]:
    """``rows`` with their images as pixels: ``image_bytes`` and ``image_lengths`` become
    ``images`` uint8 ``[n, max_images_per_row, 3, H, W]``, the first ``num_images`` slots
    filled (what a reader sends a rank)."""
    rows = dict(rows)
    if vision.native:
        return _decode_native_rows(rows, vision)
    blobs, lengths = rows.pop("image_bytes"), rows.pop("image_lengths")
    spec = vision.spec
    images = np.zeros((len(blobs), lengths.shape[1], 3, spec.height, spec.width), np.uint8)
    for r, (blob, count) in enumerate(zip(blobs, rows["num_images"])):
        ends = np.cumsum(lengths[r, :count])
        for k, (begin, end) in enumerate(zip([0, *ends[:-1]], ends)):
            # checked when the row was made: a failure now means the cache was altered
            images[r, k] = load_image(blob[begin:end], spec, vision.max_pixels,
                                      name=f"image {k} of a stored row")
    rows["images"] = images
    return rows


def _decode_native_rows(rows: dict, vision: VisionData) -> dict:
    """Native rows: ``pixels`` (per row, its images' uint8 [3, H, W] flattened one after the
    other), ``image_sizes`` int32 [n, slots, 2] (H, W; zeros past num_images), and
    ``position_ids`` as M-RoPE's int64 [n, 3, s], each sample of the row from 0."""
    blobs, lengths = rows.pop("image_bytes"), rows.pop("image_lengths")
    spec, merge = vision.spec, vision.spec.merge_size
    pixels = np.empty(len(blobs), object)
    sizes = np.zeros((*lengths.shape, 2), np.int32)
    positions = np.empty((len(blobs), 3, rows["tokens"].shape[1]), np.int64)
    for r, (blob, count) in enumerate(zip(blobs, rows["num_images"])):
        ends = np.cumsum(lengths[r, :count])
        images = [load_native(blob[a:b], spec, vision.max_pixels, label=f"image {k} of a stored row")
                  for k, (a, b) in enumerate(zip([0, *ends[:-1]], ends))]
        sizes[r, :count] = [image.shape[1:] for image in images]
        pixels[r] = (np.concatenate([image.reshape(-1) for image in images]) if images
                     else np.zeros(0, np.uint8))
        starts = np.flatnonzero(rows["position_ids"][r] == 0)  # each packed sample restarts
        grids = [spec.grid(h, w) for h, w in sizes[r, :count]]
        positions[r] = packed_mrope_positions(rows["tokens"][r], np.diff([*starts, len(
            rows["tokens"][r])]), grids, vision.token_id, merge)
    rows.update(pixels=pixels, image_sizes=sizes, position_ids=positions)
    return rows


def empty_image_columns(vision: VisionData, row_length: int) -> dict[str, np.ndarray]:
    """No rows' image columns, with their shapes."""
    return image_columns([], vision, row_length)
