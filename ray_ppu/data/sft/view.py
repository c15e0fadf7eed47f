"""SFT / VL rows as the model sees them: each sample's text cut where the loss starts and
stops, its images where their tokens are, the padding; and the corpus's figures.

``inspect_data.py`` shows these in the terminal and on an HTML page. What LLaMA-Factory's and
ms-swift's users look at before they spend a device hour: the chat template rendered, which
tokens are trained, where each image went and how many positions it took, and how well the
rows are packed.

A row's sample is its ids ``[tokens[a]] + labels[a:b]`` (``tokens = t[:-1]``, ``labels =
t[1:]``): id ``k`` of it is trained when ``loss_mask[a + k - 1]`` is 1. Samples of a packed row
are cut by ``cu_seqlens``; the padding is the row's tail of pad ids that carry no loss.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

# what a stretch of a sample is: template and prompt text (no loss), trained text, an image's
# positions, padding
KINDS = ("context", "trained", "image", "pad")


@dataclass
class Segment:
    kind: str
    """One of :data:`KINDS`."""
    text: str
    """The decoded text (an image: its description)."""
    tokens: int
    """Positions it takes in the row."""
    image: Optional[dict] = None
    """An image: ``{"index", "width", "height", "bytes"}`` (the file as the record gave it)."""


@dataclass
class RowView:
    row: int
    """The row's index in the split (a run's sample id cycles over the rows)."""
    length: int
    """Positions in the row."""
    samples: list[list[Segment]] = field(default_factory=list)
    """Each sample's segments, in row order."""
    lengths: list[int] = field(default_factory=list)
    """Each sample's positions in the row."""
    pad: int = 0
    """Padding positions at the row's end."""

    @property
    def trained(self) -> int:
        return sum(s.tokens for sample in self.samples for s in sample if s.kind == "trained")


def row_view(columns: dict, row: int, decode, pad_id: int, vision=None) -> RowView:
    """The view of row ``row`` of a split's ``columns`` (the arrays of
    :func:`ray_ppu.data.sft_store.dataset` or :func:`~ray_ppu.data.sft.sft_rows_from_files`).
    ``decode``: ids → text; ``vision``: the run's :class:`VisionData` (None: a text model)."""
    tokens, labels = np.asarray(columns["tokens"][row]), np.asarray(columns["labels"][row])
    mask = np.asarray(columns["loss_mask"][row])
    length = len(tokens)
    padding = (tokens == pad_id) & (labels == pad_id) & (mask == 0)
    end = length - int(np.argmin(padding[::-1])) if not padding.all() else 0
    if "cu_seqlens" in columns:
        bounds = [int(b) for b in columns["cu_seqlens"][row][:int(columns["num_seqs"][row]) + 1]]
        bounds = [b for b in bounds if b < end] + [end]
    else:
        bounds = [0, end]
    images = iter(_row_images(columns, row) if vision is not None else [])
    view = RowView(row, length, pad=length - end)
    for a, b in zip(bounds, bounds[1:]):
        ids = [int(tokens[a]), *labels[a:b].tolist()]
        trained = [0, *(mask[a:b] > 0).tolist()]
        view.samples.append(_segments(ids, trained, decode, vision, images))
        view.lengths.append(b - a)
    return view


def _segments(ids: list[int], trained: list, decode, vision, images) -> list[Segment]:
    """Consecutive ids of one kind, decoded together; an image's ids as one segment."""
    image_ids = set() if vision is None else {vision.token_id}
    if vision is not None and vision.native:  # <|vision_start|> pads <|vision_end|>
        image_ids |= {vision.start_id, vision.start_id + 1}
    out, k = [], 0
    while k < len(ids):
        if ids[k] in image_ids:
            j = _image_end(ids, k, vision, image_ids)
            image = next(images, None)
            size = f"{image['width']}×{image['height']} px, " if image else ""
            index = image["index"] + 1 if image else "?"
            out.append(Segment("image", f"image {index}: {size}{j - k} tokens", j - k, image))
        else:
            kind = "trained" if trained[k] else "context"
            j = k
            while j < len(ids) and ids[j] not in image_ids and bool(trained[j]) == (kind == "trained"):
                j += 1
            out.append(Segment(kind, decode(ids[k:j]), j - k))
        k = j
    return out


def _image_end(ids: list[int], k: int, vision, image_ids: set) -> int:
    """Where the image whose ids start at ``k`` ends: after its <|vision_end|> (native), or
    ``tokens_per_image`` on (adjacent images' runs are cut there)."""
    j = k + 1
    if vision.native:
        while j < len(ids) and ids[j - 1] != vision.start_id + 1 and ids[j] in image_ids:
            j += 1
        return j
    while j < len(ids) and j - k < vision.tokens_per_image and ids[j] in image_ids:
        j += 1
    return j


def _row_images(columns: dict, row: int) -> list[dict]:
    """The row's image files (bytes as stored) with their size as given."""
    from PIL import Image

    count = int(columns["num_images"][row])
    blob = columns["image_bytes"][np.array([row])][0]  # a stored column or an object array
    ends = np.cumsum(np.asarray(columns["image_lengths"][row][:count]))
    found = []
    for k, (a, b) in enumerate(zip([0, *ends[:-1]], ends)):
        data = bytes(blob[a:b])
        try:
            width, height = Image.open(io.BytesIO(data)).size
        except Exception:  # checked when the row was made; a changed cache still shows the row
            width = height = 0
        found.append({"index": k, "width": width, "height": height, "bytes": data})
    return found


def figures(stats: dict, columns: dict, vision=None) -> dict:
    """The corpus's figures: records read, used, dropped by reason, tokens, packing
    efficiency and (a vision-language model) images and image positions per sample."""
    used = stats["samples_used"]
    found = {"records": stats["records_read"], "used": used,
             "dropped": {k: v for k, v in stats["dropped"].items() if v},
             "truncated": stats["truncated"], "rows": len(columns["tokens"]),
             "sample_tokens": stats["sample_tokens"], "trained_tokens": stats["loss_tokens"],
             "packing_efficiency": round(stats["packing_efficiency"], 4)}
    if vision is not None and used:
        tokens = np.asarray(columns["tokens"])
        image_positions = int(np.isin(tokens, [vision.token_id]).sum())
        found["images_per_sample"] = round(int(np.asarray(columns["num_images"]).sum()) / used, 3)
        found["image_tokens_per_sample"] = round(image_positions / used, 1)
    return found


def inspect(cfg, plan, split: str, sample_ids: np.ndarray, records: int):
    """``(figures, where they come from, [(RowView, sample id)])`` of a run's split: its
    prepared rows when the run's cache holds them (exactly what it trains on), else the first
    ``records`` records of each file (0: all) read here without Ray, the pipeline's way.
    ``sample_ids``: the run's sample ids to show (they cycle over the rows)."""
    from ray_ppu.data import sft_store
    from ray_ppu.data.sft.windows import as_encoder, sft_rows_from_files
    from ray_ppu.data.tokenizer import load_tokenizer

    spec = sft_store.spec_for(cfg, plan)
    encoder = as_encoder(spec.tokenizer_dir)
    meta_path = spec.split_dir(split) / sft_store.META
    if meta_path.is_file():
        import json

        stats = json.loads(meta_path.read_text())["summary"]
        columns = sft_store.dataset(spec, split)
        source = f"the run's prepared rows, {spec.split_dir(split)}"
    else:
        columns, stats = sft_rows_from_files(
            list(spec.paths(split)), encoder, spec.seq_length, spec.max_padding_length,
            spec.packing, vision=spec.vision, max_records=records)
        source = (f"the first {records} records of each file, read here" if records
                  else "every record, read here")
    rows = len(columns["tokens"])
    decode = load_tokenizer(spec.tokenizer_dir).decode  # special tokens kept: the template's
    pad_id = encoder.pad_id
    views = [(row_view(columns, int(i) % rows, decode, pad_id, spec.vision), int(i))
             for i in sample_ids] if rows else []
    return figures(stats, columns, spec.vision), source, views
