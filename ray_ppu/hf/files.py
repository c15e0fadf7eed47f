"""Safetensors files of a Hugging Face checkpoint: which file holds which tensor, header-only
shape checks, slice reads, and writing upstream-style shards.

A directory holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name → file). A file is an 8-byte header length, a JSON header (each
tensor's dtype, shape and byte range) and the row-major tensor data. A rank reads the rows it
owns with plain positioned reads straight into the destination (its parameter, when dtype and
device allow), and a column slice in blocks of at most :data:`BLOCK_BYTES` of whole rows: no
memory map (whose touched pages would count as the rank's memory) and no copy of a whole
tensor it does not need.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Optional

import torch

from ray_ppu.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # upstream's default max_shard_size="5GB"
BLOCK_BYTES = 64 * 2**20  # the most a read holds besides its destination
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def header(path: Path) -> tuple[int, dict]:
    """A safetensors file's data start and header {name: {"dtype", "shape", "data_offsets"}}
    (8 + n bytes read, no tensor data)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            meta = json.loads(f.read(size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not a readable safetensors file ({err})") from None
    meta.pop("__metadata__", None)
    return 8 + size, meta


def _read_exactly(f: BinaryIO, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes at ``offset``."""
    view = memoryview(out.detach().view(torch.uint8).numpy()).cast("B")
    f.seek(offset)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ConfigError(f"{f.name}: ends {len(view) - got} bytes early (truncated?)")
        got += n


class Checkpoint:
    """The tensors of a Hugging Face model directory, read by slices (use as a context
    manager: files are opened on first use and closed at exit)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory).expanduser()
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as err:
                raise ConfigError(f"{index}: not a safetensors index ({err})") from None
            self.files = {name: self.dir / file for name, file in weight_map.items()}
        elif (self.dir / SINGLE_FILE).is_file():
            self.files = {name: self.dir / SINGLE_FILE
                          for name in header(self.dir / SINGLE_FILE)[1]}
        else:
            raise ConfigError(f"{self.dir}: neither {SINGLE_FILE} nor {INDEX_FILE} (only "
                              f"safetensors checkpoints are read: no pickles)")
        self._headers: dict[Path, tuple[int, dict]] = {}
        self._open: dict[Path, BinaryIO] = {}
        self.bytes_read = 0

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def _header(self, path: Path) -> tuple[int, dict]:
        if path not in self._headers:
            if not path.is_file():
                raise ConfigError(f"{path} is missing (listed in {self.dir / INDEX_FILE})")
            self._headers[path] = header(path)
        return self._headers[path]

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every expected tensor is there with its shape (headers only): one error listing
        every missing or misshapen tensor, naming its file."""
        problems = []
        for name, shape in expected.items():
            path = self.files.get(name)
            info = self._header(path)[1].get(name) if path is not None else None
            if info is None:
                where = f" (the index names {path.name}, which lacks it)" if path else ""
                problems.append(f"{name} missing{where}")
                continue
            found, kind = tuple(info["shape"]), info["dtype"]
            begin, end = info["data_offsets"]
            if found != tuple(shape):
                problems.append(f"{name} in {path.name} has shape {list(found)}, expected "
                                f"{list(shape)}")
            elif kind not in _DTYPES:
                problems.append(f"{name} in {path.name} is {kind} (expected F32, BF16 or F16)")
            elif end - begin != math.prod(found) * _DTYPES[kind].itemsize:
                problems.append(f"{name} in {path.name} has {end - begin} bytes of data, "
                                f"not {math.prod(found) * _DTYPES[kind].itemsize}")
        if problems:
            more = f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""
            raise ConfigError(f"checkpoint.pretrained {self.dir} does not fit the model: "
                              + "; ".join(problems[:8]) + more)

    def read_into(self, name: str, out: torch.Tensor, rows: Optional[slice] = None,
                  cols: Optional[slice] = None) -> None:
        """Copy ``[rows]`` / ``[rows, cols]`` of tensor ``name`` into ``out`` (any dtype or
        device; its shape is the slice's). Whole rows go straight into ``out`` when it is a
        contiguous CPU tensor of the stored dtype; otherwise through blocks of whole rows of
        at most :data:`BLOCK_BYTES`, each cut and copied in."""
        path = self.files[name]
        start, table = self._header(path)
        info = table[name]
        dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
        first, stop, _ = (rows or slice(None)).indices(shape[0])
        if out.shape[0] != stop - first:
            raise ValueError(f"{name}: rows {first}:{stop} into {out.shape[0]} rows")
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        offset = start + info["data_offsets"][0] + first * row_bytes
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = open(path, "rb", buffering=0)
        whole_rows = cols is None or cols.indices(shape[1])[:2] == (0, shape[1])
        if (whole_rows and out.dtype == dtype and out.device.type == "cpu"
                and out.is_contiguous()):
            _read_exactly(f, offset, out)
        else:
            block = max(1, BLOCK_BYTES // max(row_bytes, 1))
            for at in range(first, stop, block):
                n = min(block, stop - at)
                buffer = torch.empty((n, *shape[1:]), dtype=dtype)
                _read_exactly(f, offset + (at - first) * row_bytes, buffer)
                out[at - first:at - first + n].copy_(buffer if whole_rows else buffer[:, cols])
        self.bytes_read += (stop - first) * row_bytes

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` whole."""
        shape, kind = self.shapes_of(name)
        out = torch.empty(shape, dtype=_DTYPES[kind])
        self.read_into(name, out)
        return out

    def shapes_of(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype) of one tensor."""
        info = self._header(self.files[name])[1][name]
        return tuple(info["shape"]), info["dtype"]


PUBLIC_FILE_MODE = 0o644  # what save_pretrained leaves: a model directory others read


class ShardedWriter:
    """Writes tensors into ``model-0000k-of-0000n.safetensors`` shards of at most
    ``max_bytes`` each (a tensor larger than that gets a shard of its own) plus
    ``model.safetensors.index.json``, or one ``model.safetensors`` when everything fits one
    shard, as ``save_pretrained`` lays them out. Holds one shard in memory at a time."""

    def __init__(self, directory: str | Path, max_bytes: int = MAX_SHARD_BYTES) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def add_all(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.add(name, tensor)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.dir / f".shard-{len(self.written):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        os.chmod(path, PUBLIC_FILE_MODE)  # safetensors writes 0600: others load exports too
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, name the shards and write the index; returns the files."""
        if self.pending or not self.written:
            self._flush()
        n = len(self.written)
        if n == 1:
            final = self.dir / SINGLE_FILE
            os.replace(self.written[0][0], final)
            return [final]
        weight_map, files = {}, []
        for k, (tmp, names) in enumerate(self.written, start=1):
            final = self.dir / f"model-{k:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, final)
            files.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return [*files, self.dir / INDEX_FILE]


def read_all(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a directory, file by file (tests and small models)."""
    with Checkpoint(directory) as ckpt:
        for name in sorted(ckpt.files):
            yield name, ckpt.read(name)
