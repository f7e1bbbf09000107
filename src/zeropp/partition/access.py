"""Which torch calls read a parameter's elements, and the error for a parameter used where its values are not
on this rank (partitioned between the engine's passes, or at construction under ``zero.Init``)."""
from __future__ import annotations

from typing import Any, Iterator

import torch


class ParameterAccessError(RuntimeError):
    """A partitioned parameter was used in a way that cannot be served (the message says which and why)."""


# calls on a parameter that read no element: no gather for these
METADATA = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "grad", "grad_fn", "names",
    "is_cuda", "is_meta", "is_sparse", "is_quantized", "is_cpu", "_version", "size", "dim", "numel",
    "nelement", "ndimension", "element_size", "is_floating_point", "is_complex", "is_contiguous", "stride",
    "get_device", "__len__", "__hash__", "requires_grad_", "retain_grad", "register_hook",
    "register_post_accumulate_grad_hook", "_backward_hooks", "_post_accumulate_grad_hooks",
    "_has_compatible_shallow_copy_type",  # nn.Module._apply compares tensor types: no element read
})
# calls that read where a parameter's storage is, not its elements: harmless on a released one
STORAGE_INFO = frozenset({"untyped_storage", "data_ptr", "storage_offset", "is_pinned", "is_shared"})
# in-place operators by name (in-place methods are the names ending in one underscore: is_inplace); `__set__` is
# `p.data = value`
INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                             "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                             "__imatmul__", "__set__"})


def is_inplace(name: str) -> bool:
    """Whether the torch call ``name`` writes its first argument in place (``add_``, ``__iadd__``, ``copy_``...)."""
    return name in INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))


def is_noop(name: str, args: tuple, kwargs: dict) -> bool:
    """A call that gives a parameter back unchanged without reading it: a move to where it already is
    (``p.cpu()``, ``p.to(its device or dtype)``), or ``p.data = p``, which is what ``module.cpu()`` and
    ``module.to(device)`` do with that result."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    t = args[0]
    if name == "__set__":
        return len(args) == 2 and args[1] is t
    if name == "cpu":
        return t.device.type == "cpu"
    if name == "to" and not kwargs.get("copy", False):
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
        except (TypeError, RuntimeError):
            return False
        same_device = device is None or (device.type == t.device.type and device.index in (None, t.device.index))
        return same_device and dtype in (None, t.dtype) and memory_format is None
    return False


def call_name(func: Any) -> str:
    """The attribute a torch-function call stands for (``add_``, ``shape`` for a property getter)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        attr = getattr(owner, "__name__", "")
        return "__set__" if name == "__set__" and attr not in METADATA else attr
    return name


def call_args(args: tuple, kwargs: dict) -> Iterator[tuple[Any, bool]]:
    """Each argument of a torch call (one level into lists and tuples, where parameters travel to ``cat`` or
    ``stack``) and whether it is the first positional one (the tensor a method is called on)."""
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            for b in a:
                yield b, False
        else:
            yield a, i == 0
    for v in kwargs.values():
        yield v, False
