"""Files that hold no code: a tree of plain data and tensors, as one safetensors file (Note [data, not code]).

Note [data, not code]: a pickle runs whatever its author chose while it is read, and a checkpoint directory is
written by anyone who can write to it (a shared file system, a copied or downloaded checkpoint), so a digest
in the manifest cannot make one safe: the attacker recomputes it. zeropp's own files are therefore data only.
A shard is a safetensors file: its tensors are the tensors of the saved tree, and the rest of the tree is JSON
in the file's ``__metadata__`` (key ``zeropp``), where each tensor stands as ``{"__tensor__": key}``. Reading
one parses a JSON header and copies bytes; nothing is unpickled. Any safetensors reader opens it
(``safetensors.safe_open(path, "pt").metadata()["zeropp"]`` is the tree).

What the tree may hold: dicts (keys str, int, float, bool or None), lists, tuples, str, int, float (NaN and
infinities too), bool, None, tensors and NumPy arrays. Anything else is refused at save time by
:class:`UnstorableError`, naming where it sits (``client_state['model_class']``), before a byte is written.

The writer streams: each tensor's bytes go to the file from the tensor itself (a view of a unit's row costs no
copy), after a header that lists them in order of decreasing element size, so each starts aligned to its
element size and the data section has no holes, as the format requires.
"""
from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import struct
from typing import Any, BinaryIO, Callable

import numpy as np
import torch

from zeropp.partition.safetensors_chunks import DTYPES

TREE_KEY = "zeropp"  # the __metadata__ entry that holds the JSON tree
_TAGS = ("__tensor__", "__ndarray__", "__float__", "__tuple__", "__dict__")
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class UnstorableError(TypeError):
    """A value that is neither plain data nor a tensor; the message says where it sits in the saved tree."""


# ---- the tree <-> (JSON, tensors) -------------------------------------------------------------------------
def encode(tree: Any, where: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """``tree`` as JSON-ready data with tensors replaced by references, and the tensors by key."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = path.lstrip("/") or "tensor"
            while key in tensors:
                key += "#"
            tensors[key] = value.detach()
            return {"__tensor__": key}
        if isinstance(value, np.ndarray):
            return {"__ndarray__": walk(torch.from_numpy(np.ascontiguousarray(value)), path)["__tensor__"]}
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return value
        if isinstance(value, (int, np.integer)):
            return int(value)
        if isinstance(value, (float, np.floating)):
            f = float(value)
            return f if math.isfinite(f) else {"__float__": repr(f)}
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in _TAGS):
                return {k: walk(v, f"{path}/{k}") for k, v in value.items()}
            pairs = []
            for k, v in value.items():
                if not (k is None or isinstance(k, (str, int, float, bool))):
                    raise UnstorableError(f"{_show(where, path)} has a key of type {type(k).__name__} ({k!r}); "
                                          "keys must be str, int, float, bool or None")
                pairs.append([k, walk(v, f"{path}/{k}")])
            return {"__dict__": pairs}
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
            return items if isinstance(value, list) else {"__tuple__": items}
        raise UnstorableError(f"{_show(where, path)} is a {type(value).__module__}.{type(value).__qualname__}: "
                              "zeropp stores only plain data (dict, list, str, numbers, bool, None) and tensors, "
                              "never pickles; convert it (for example to a dict of plain values) before saving")

    return walk(tree, ""), tensors


def _show(where: str, path: str) -> str:
    parts = [p for p in path.split("/") if p]
    return (where or "value") + "".join(f"[{int(p)}]" if p.isdigit() else f"[{p!r}]" for p in parts)


def decode(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, value), = data.items()
        if tag == "__tensor__":
            return tensors[value]
        if tag == "__ndarray__":
            return tensors[value].numpy()
        if tag == "__float__":
            return float(value)
        if tag == "__tuple__":
            return tuple(decode(v, tensors) for v in value)
        if tag == "__dict__":
            return {k: decode(v, tensors) for k, v in value}
    return {k: decode(v, tensors) for k, v in data.items()}


# ---- the file -----------------------------------------------------------------------------------------------
def write_tree(f: BinaryIO, tree: Any, where: str = "") -> None:
    """Write ``tree`` to the binary file ``f`` as a safetensors file (Note [data, not code])."""
    data, tensors = encode(tree, where)
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())  # aligned without holes
    header: dict[str, Any] = {"__metadata__": {TREE_KEY: json.dumps(data, separators=(",", ":"),
                                                                    allow_nan=False)}}
    offset = 0
    for key in order:
        t = tensors[key]
        if t.dtype not in _NAMES:
            raise UnstorableError(f"{where or 'value'}: tensor {key!r} has dtype {t.dtype}, which safetensors "
                                  "cannot hold")
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data section starts 8-byte aligned
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for key in order:
        t = tensors[key].cpu().contiguous()
        if t.numel():
            f.write(_bytes_of(t))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous host tensor ``t``, without a copy. Not through ``Tensor.numpy()``: exporting to
    NumPy marks the storage as not resizable for good, and the engine frees and regrows its rows in place
    (NVMe offload, released units)."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def read_tree(path: str, use_mmap: bool = False, fail: Callable[[str], Exception] = ValueError) -> Any:
    """Read a file :func:`write_tree` wrote. Tensors get storage of their own (resizable, as ``torch.load``
    gives, which NVMe offload needs); ``use_mmap`` maps the file instead (tensors then read it lazily: for
    streaming reads that copy what they need).

    Anything that is not such a file raises ``fail(reason)``: no byte of it is executed either way.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise fail("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        total = os.fstat(f.fileno()).st_size
        if size > total - 8:
            raise fail(f"header length {size} exceeds the file: not a safetensors file (an older pickled shard?)")
        try:
            header = json.loads(f.read(size))
            tree = json.loads(header["__metadata__"][TREE_KEY])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise fail(f"not a zeropp shard ({type(err).__name__}: {err})") from err
        base = 8 + size
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if use_mmap else None  # writable: no warning
        tensors = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype, start, stop, shape = _entry(key, info, fail)
            count = math.prod(shape)
            nbytes = count * torch.empty((), dtype=dtype).element_size()
            if stop - start != nbytes or start < 0 or base + stop > total:
                raise fail(f"tensor {key!r} lies outside the file or does not match its shape")
            if not count:
                tensors[key] = torch.empty(shape, dtype=dtype)
            elif mapped is not None:
                tensors[key] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start).view(shape)
            else:
                t = torch.empty(shape, dtype=dtype)
                f.seek(base + start)
                if f.readinto(_bytes_of(t)) != nbytes:
                    raise fail(f"tensor {key!r}: the file ends inside its data")
                tensors[key] = t
    return decode(tree, tensors)


def _entry(key: str, info: Any, fail: Callable[[str], Exception]) -> tuple[torch.dtype, int, int, list[int]]:
    try:
        start, stop = (int(x) for x in info["data_offsets"])
        shape = [int(x) for x in info["shape"]]
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in {shape}")
        return DTYPES[info["dtype"]], start, stop, shape
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise fail(f"tensor {key!r} has a bad header entry ({type(err).__name__}: {err})") from err
