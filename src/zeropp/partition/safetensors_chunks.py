"""Read one rank's chunk of a tensor straight from safetensors files, never the whole tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and
byte range in the data section) and the raw row-major data. A rank's chunk of a parameter is a contiguous run
of its flattened elements (Note [shard layout] in ``spec.py``), so it is one contiguous byte range of the
file: a seek and a read. Nothing is unpickled (the format has no code), and a sharded checkpoint
(``model.safetensors.index.json`` + ``model-0000i-of-0000n.safetensors``) is read file by file through its
index.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

import torch

from zeropp.partition.spec import ShardSpec

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointFormatError(ValueError):
    """A safetensors file or index that cannot be read (the message names the file)."""


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file, dtype, shape and the file offset of its first byte."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _header(path: Path) -> dict[str, Entry]:
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > os.path.getsize(path):
                raise CheckpointFormatError(f"{path}: header length {size} exceeds the file; not safetensors")
            header = json.loads(f.read(size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(f"{path}: not a readable safetensors file ({err})") from err
    base = 8 + size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointFormatError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, not one zeropp "
                                        f"reads ({sorted(DTYPES)})")
        out[name] = Entry(path, dtype, tuple(info["shape"]), base + info["data_offsets"][0])
    return out


class SafetensorsChunks:
    """The tensors of a safetensors checkpoint (a file, or a directory with one file or a sharded index)."""

    def __init__(self, location: Union[str, os.PathLike]) -> None:
        root = Path(location)
        if root.is_file():
            files = [root]
        elif (root / INDEX).is_file():
            try:
                weight_map = json.loads((root / INDEX).read_text())["weight_map"]
            except (OSError, KeyError, json.JSONDecodeError) as err:
                raise CheckpointFormatError(f"{root / INDEX}: not a safetensors index ({err})") from err
            files = [root / name for name in sorted(set(weight_map.values()))]
        elif (root / SINGLE).is_file():
            files = [root / SINGLE]
        else:
            raise CheckpointFormatError(f"{root}: no {SINGLE} or {INDEX} (zeropp loads safetensors checkpoints "
                                        "only: they hold no code; convert a .bin checkpoint with save_pretrained)")
        self.entries: dict[str, Entry] = {}
        for path in files:
            self.entries.update(_header(path))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> Iterator[str]:
        return iter(self.entries)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor (for buffers and small tensors)."""
        e = self.entries[name]
        return self._elements(e, 0, e.numel).view(e.shape)

    def read_chunk(self, name: str, spec: ShardSpec, rank: int) -> torch.Tensor:
        """Rank ``rank``'s chunk of ``name`` as ``spec`` splits it, zero-padded to ``spec.chunk`` elements."""
        e = self.entries[name]
        if e.numel != spec.numel:
            raise CheckpointFormatError(f"{e.path}: tensor {name!r} has shape {list(e.shape)}, the model's is "
                                        f"{list(spec.shape)}")
        start, stop = spec.owned(rank)
        out = torch.zeros(spec.chunk, dtype=e.dtype)
        if stop > start:
            out[: stop - start] = self._elements(e, start, stop)
        return out

    @staticmethod
    def _elements(e: Entry, start: int, stop: int) -> torch.Tensor:
        size = torch.empty((), dtype=e.dtype).element_size()
        buf = bytearray((stop - start) * size)
        with open(e.path, "rb") as f:
            f.seek(e.offset + start * size)
            if f.readinto(buf) != len(buf):
                raise CheckpointFormatError(f"{e.path}: ends inside tensor data (truncated file)")
        return torch.frombuffer(buf, dtype=e.dtype) if buf else torch.empty(0, dtype=e.dtype)
