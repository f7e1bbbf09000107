"""``zero.Init``: build a model too large for one rank, each module's parameters partitioned as it is built.

Note [construction under zero.Init]: inside the context every module's ``__init__`` runs as written, on real
tensors, and when the outermost ``__init__`` of a module returns, the parameters it holds (and any in its
children not partitioned yet) are partitioned over the ranks from rank 0's values
(Note [partitioned at construction] in ``zero/construction.py``). So code in ``__init__`` works as without
the context: hand-written weights, ``.data`` writes, buffers, one module built from another's weights, and
no rank ever holds more than the module being built in full, plus the shards.

What the context changes, and undoes on exit (also when an ``__init__`` raises):

* the ``__init__`` of every ``nn.Module`` subclass is wrapped (classes defined inside the context too, through
  ``nn.Module.__init_subclass__``), to know when a module is done;
* a torch-function mode serves reads and writes of partitioned parameters inside an ``__init__``: a parameter
  used there (a parent initializing a child's weight, a module copying another's) is gathered from its chunks,
  and partitioned again, from rank 0's values, when the ``__init__`` that used it returns, or earlier when the
  parameters gathered this way exceed a budget (the oldest first). Code in ``__init__`` runs on every rank, so
  every rank issues these collectives alike. Outside an ``__init__`` a partitioned parameter's values are refused
  by name: a read there (``if rank == 0: print(w.sum())``) could hang the other ranks; use
  ``GatheredParameters``, on every rank;
* on a machine with CUDA, modules are created on this rank's device (``LOCAL_RANK``), as DeepSpeed does.

``initialize`` may be called inside the context: it pauses the hooks while it builds the engine.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zeropp.config.loader import read_json
from zeropp.partition.access import METADATA, STORAGE_INFO, call_args, call_name, is_noop
from zeropp.zero.construction import PARAMS, State, local_device
from zeropp.topology import ensure_process_group
from zeropp.zero import gathered, idle_watch
from zeropp.errors import NotBuiltError

#: parameters gathered inside ``__init__``s and not yet partitioned again may hold at most this many bytes,
#: or twice the largest module built so far (the oldest go first)
GATHERED_BUDGET = 256 * 2**20


def _subclasses(cls: type) -> Iterator[type]:
    seen: set[type] = set()
    stack = [cls]
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        yield c
        stack.extend(c.__subclasses__())


class _Construction:
    """The hooks of the outermost entered ``zero.Init`` (nested ones share them)."""

    def __init__(self, dtype: Optional[torch.dtype], shard_device: Optional[torch.device],
                 device: Optional[torch.device]) -> None:
        self.dtype = dtype
        self.shard_device = shard_device
        self.device = device
        self.building: list[int] = []  # ids of the modules whose __init__ runs, outermost first
        self.pending: list[tuple[nn.Parameter, int]] = []  # gathered here: (parameter, depth it was gathered at)
        self.largest = 0
        self.paused = 0
        self._wrapped: list[tuple[type, Callable]] = []
        self._mode = _Access(self)
        self._device_ctx: Optional[torch.device] = None
        self._had_init_subclass = "__init_subclass__" in vars(nn.Module)

    # ---- install / uninstall ---------------------------------------------------------------------------------
    def install(self) -> None:
        for cls in _subclasses(nn.Module):
            self._wrap(cls)
        construction = self

        def __init_subclass__(cls: type, **kwargs: Any) -> None:  # a class defined inside the context
            super(nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
            construction._wrap(cls)
        nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
        if self.device is not None:
            self._device_ctx = self.device
            self._device_ctx.__enter__()
        self._mode.__enter__()

    def uninstall(self, clean: bool) -> None:
        """Undo every change; ``clean``: no exception is propagating, so the pending parameters can be
        partitioned from rank 0's values (a collective); else their gathered values are dropped."""
        try:
            self._mode.__exit__(None, None, None)
            if self._device_ctx is not None:
                self._device_ctx.__exit__(None, None, None)
        finally:
            for cls, original in reversed(self._wrapped):
                cls.__init__ = original  # type: ignore[misc]
            self._wrapped.clear()
            if self._had_init_subclass is False:
                del nn.Module.__init_subclass__
            self.building.clear()
            pending, self.pending = self.pending, []
            for p, _ in pending:
                PARAMS.repartition(p, src=0 if clean else None)

    def _wrap(self, cls: type) -> None:
        original = vars(cls).get("__init__")
        if not inspect.isfunction(original) or getattr(original, "__zeropp_wrapped__", False):
            return
        construction = self

        @functools.wraps(original)
        def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            construction.construct(original, module, args, kwargs)
        __init__.__zeropp_wrapped__ = True  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[misc]
        self._wrapped.append((cls, original))

    # ---- construction ------------------------------------------------------------------------------------------
    def construct(self, original: Callable, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Run ``original`` (a class's own ``__init__``); when it is the module's outermost, partition after."""
        if self.paused or id(module) in self.building:  # super().__init__() of a module being built
            original(module, *args, **kwargs)
            return
        self.building.append(id(module))
        try:
            original(module, *args, **kwargs)
        finally:
            self.building.pop()
        self.done(module)

    def done(self, module: nn.Module) -> None:
        """``module``'s ``__init__`` returned: partition what it gathered and what it (or its children) holds."""
        depth = len(self.building)
        while self.pending and self.pending[-1][1] > depth:
            PARAMS.repartition(self.pending.pop()[0])
        owned = gathered.managed_ids()  # an engine's parameters (a model wrapped after initialize) stay its own
        new = [(f"{type(module).__name__}.{name}", p) for name, p in module.named_parameters()
               if PARAMS.get(p) is None and id(p) not in owned and not p.is_meta
               and not isinstance(p, nn.parameter.UninitializedParameter)]
        if new:
            self.largest = max(self.largest, sum(p.numel() * p.element_size() for _, p in new))
            PARAMS.partition(new, self.dtype, self.shard_device)

    def gather(self, param: nn.Parameter) -> None:
        """A partitioned parameter used inside an ``__init__``: gather it until that ``__init__`` returns."""
        PARAMS.gather(param)
        self.pending.append((param, len(self.building)))
        budget = max(GATHERED_BUDGET, 2 * self.largest)
        while len(self.pending) > 1 and sum(_nbytes(p) for p, _ in self.pending) > budget:
            oldest = next((i for i, (p, _) in enumerate(self.pending) if _pins(p) == 0), None)
            if oldest is None:
                break
            PARAMS.repartition(self.pending.pop(oldest)[0])


def _nbytes(param: nn.Parameter) -> int:
    rec = PARAMS.get(param)
    return rec.nbytes if rec is not None and rec.state is State.GATHERED else 0


def _pins(param: nn.Parameter) -> int:
    rec = PARAMS.get(param)
    return rec.pins if rec is not None else 0


class _Access(TorchFunctionMode):
    """Serves partitioned parameters used inside an ``__init__``; refuses their values outside one."""

    def __init__(self, construction: _Construction) -> None:
        super().__init__()
        self.c = construction

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if self.c.paused or not len(PARAMS):
            return func(*args, **kwargs)
        hits = [a for a, _ in call_args(args, kwargs) if isinstance(a, nn.Parameter) and PARAMS.get(a) is not None]
        name = call_name(func) if hits else ""
        if hits and is_noop(name, args, kwargs):  # model.cpu() on a model already on the CPU
            return func(*args, **kwargs)
        if hits and name not in METADATA and name not in STORAGE_INFO:
            if not self.c.building:
                PARAMS.check_idle(func, args, kwargs)
            for p in hits:
                if PARAMS.get(p).state is State.PARTITIONED:  # type: ignore[union-attr]
                    self.c.gather(p)
        out = func(*args, **kwargs)
        if name == "__set__":  # `param.data = t`: the values go into the gathered buffer, which stays its data
            for p in hits:
                _keep_buffer(p)
        return out


def _keep_buffer(param: nn.Parameter) -> None:
    rec = PARAMS.get(param)
    assert rec is not None
    with torch._C.DisableTorchFunction():
        new = param.data
        if new.shape != rec.spec.shape:
            raise ValueError(f"parameter {rec.label!r} (partitioned by zero.Init, shape {tuple(rec.spec.shape)}) "
                             f"was given data of shape {tuple(new.shape)}; assign a new nn.Parameter instead")
        rec.full[: rec.spec.numel].copy_(new.reshape(-1))
        param.data = rec.full[: rec.spec.numel].view(rec.spec.shape)


_ACTIVE: list[_Construction] = []  # the entered construction (one; nested contexts share it)
_DEPTH = [0]


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No construction hooks for the block (``initialize`` inside ``zero.Init``)."""
    c = _ACTIVE[0] if _ACTIVE else None
    if c is not None:
        c.paused += 1
    try:
        yield
    finally:
        if c is not None:
            c.paused -= 1


class Init:
    """``with zeropp.zero.Init(): model = MyModel()`` builds ``model`` with each module's parameters partitioned
    over the ranks as soon as the module is built (Note [construction under zero.Init]).

    DeepSpeed's arguments: ``enabled=False`` makes the context do nothing; ``dtype`` casts floating-point
    parameters as they are partitioned (default: as the module made them; the engine casts gathered weights to
    the config's compute dtype anyway, and the fp32 masters keep the values exactly); ``remote_device="cpu"``
    (or ``"nvme"``) keeps the chunks in host memory (NVMe residency is arranged by ``initialize`` from the
    config's ``offload_param``); ``module=`` partitions an already built model now. ``config_dict_or_path`` /
    ``config``, ``pin_memory`` and ``mem_efficient_linear`` are accepted and have no effect on construction.
    ``mpu`` and the parallel groups ask for model parallelism, which zeropp does not implement. The process group
    is created on entry when none exists (torchrun's environment, else a world of one).
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 sequence_data_parallel_group: Any = None, **kwargs: Any) -> None:
        for name, value in (("mpu", mpu), ("zero_param_parallel_group", zero_param_parallel_group),
                            ("sequence_data_parallel_group", sequence_data_parallel_group),
                            ("data_parallel_group", data_parallel_group), *kwargs.items()):
            if value not in (None, False):
                raise NotBuiltError(f"zero.Init({name}=...) is not implemented by zeropp yet")
        if remote_device is None:
            remote_device = _offload_param_device(config_dict_or_path if config_dict_or_path is not None else config)
        if remote_device not in (None, "cpu", "nvme", "none"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): expected None, 'cpu' or 'nvme'")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"zero.Init(dtype={dtype}): expected a floating-point dtype")
        self.enabled = enabled
        self.dtype = dtype
        self.remote_device = remote_device
        self._entered = False
        if module is not None and enabled:
            _ensure_group()
            named = [(f"{type(module).__name__}.{n}", p) for n, p in module.named_parameters()]
            PARAMS.partition(named, dtype, self._shard_device())
            idle_watch.watch(PARAMS)
            self.enabled = False  # the module is done; the context (if entered) changes nothing

    def _shard_device(self) -> Optional[torch.device]:
        return torch.device("cpu") if self.remote_device in ("cpu", "nvme") else None

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        _ensure_group()
        if not _ACTIVE:
            device = local_device()
            c = _Construction(self.dtype, self._shard_device(), device if device.type != "cpu" else None)
            c.install()
            _ACTIVE.append(c)
        _DEPTH[0] += 1
        self._entered = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._entered:
            return
        self._entered = False
        _DEPTH[0] -= 1
        if _DEPTH[0] == 0:
            c = _ACTIVE.pop()
            c.uninstall(clean=exc_type is None)
            if len(PARAMS):
                idle_watch.watch(PARAMS)  # Note [reads between passes]: partitioned values refused by name


def _offload_param_device(config: Any) -> Optional[str]:
    """DeepSpeed's default ``remote_device``: the config's ``zero_optimization.offload_param.device``."""
    if config is None:
        return None
    raw = read_json(os.fspath(config)) if isinstance(config, (str, os.PathLike)) else config
    zero = raw.get("zero_optimization") if isinstance(raw, dict) else None
    offload = zero.get("offload_param") if isinstance(zero, dict) else None
    device = offload.get("device") if isinstance(offload, dict) else None
    return device if isinstance(device, str) else None


def _ensure_group() -> None:
    ensure_process_group()
