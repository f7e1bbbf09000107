"""The module-level part of DeepSpeed's API that training scripts call, so ``import zeropp as deepspeed`` works:
``initialize`` (DeepSpeed's arguments, over ``zeropp.api.build``), ``add_config_arguments`` and
``init_distributed``."""
from __future__ import annotations

import argparse
import datetime
import os
import warnings
from typing import Any, Callable, Iterable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from zeropp.api import build
from zeropp.config.loader import ZeroppConfig
from zeropp.deepspeed.missing import DeepSpeedAPIError
from zeropp.deepspeed.runtime.config_utils import decoded_config, deepspeed_config_errors
from zeropp.deepspeed.runtime.engine import ZeroppEngine
from zeropp.deepspeed.utils import logger
from zeropp.topology import ensure_process_group
from zeropp.zero import gathered
from zeropp.zero import param_state as ps


class InitResult(NamedTuple):
    """What :func:`initialize` returns, in DeepSpeed's order."""

    engine: ZeroppEngine
    optimizer: torch.optim.Optimizer
    training_dataloader: Optional[torch.utils.data.DataLoader]
    lr_scheduler: Any

def initialize(
    args: Any = None,
    model: Optional[nn.Module] = None,
    optimizer: Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer], None] = None,
    model_parameters: Optional[Iterable[torch.Tensor]] = None,
    training_data: Optional[torch.utils.data.Dataset] = None,
    lr_scheduler: Any = None,
    distributed_port: Optional[int] = None,
    mpu: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn: Optional[Callable] = None,
    config: Union[str, os.PathLike, dict, ZeroppConfig, None] = None,
    mesh_param: Any = None,
    config_params: Optional[dict] = None,
    *,
    param_init_fn: Optional[Callable[[nn.Module], None]] = None,
    engine_class: type[ZeroppEngine] = ZeroppEngine,
) -> InitResult:
    """Partition ``model`` over the data-parallel ranks and return ``(engine, optimizer, dataloader, scheduler)``.

    The arguments are DeepSpeed's, in its order, so ``import zeropp as deepspeed`` works for scripts.

    Args:
        args: an argparse namespace; its ``deepspeed_config`` is the config when ``config`` is not given
            (see :func:`zeropp.add_config_arguments`; ``deepscale_config``, DeepSpeed's deprecated name, is read
            as it, with DeepSpeed's warning).
        model: an unchanged ``nn.Module``; its parameters are sharded in place (each rank keeps its chunk).
            ``None`` is DeepSpeed's AssertionError. A model a live engine still holds is given back by that
            engine first (Note [a second initialize]).
        optimizer: a torch optimizer built over ``model``'s parameters (the same object then steps the fp32
            master shards: Note [the client's optimizer] in ``zeropp/api.py``), or a callable
            ``params -> optimizer``; default: the config's ``optimizer`` section.
        model_parameters: the parameters to train; others are kept frozen (default: all of them).
        training_data: a dataset; if given, a loader of ``train_micro_batch_size_per_gpu`` with a
            distributed sampler (and ``collate_fn``) is returned.
        lr_scheduler: a callable ``optimizer -> scheduler``, or a scheduler built over ``optimizer`` (it is
            pointed at the engine's optimizer, the same object when built over the one given); default: the config's
            ``scheduler`` section. A scheduler object with an optimizer that is not one is refused (the alias's
            ``deepspeed.initialize``, as DeepSpeed).
        distributed_port: the rendezvous port when the environment sets none (torchrun sets it).
        mpu, mesh_param: model parallelism; not supported (an error says so).
        dist_init_required: False asserts that the process group already exists.
        config: a DeepSpeed-style JSON (or Hjson) path, a dict, or a base64-encoded JSON string, as DeepSpeed
            takes it (``config_params`` is DeepSpeed's older spelling). Hugging Face's ``"auto"`` values are
            resolved from the model and the arguments where they can be (see :mod:`zeropp.config.auto`). Its
            errors are :class:`~zeropp.deepspeed.runtime.config.DeepSpeedConfigError`, a ``ConfigError``.
        param_init_fn: for a model built under ``torch.device("meta")`` (or ``zeropp.zero.Init``): called on
            each module once its parameters exist on the host (default: ``module.reset_parameters()``);
            parameters are created, initialized and sharded a unit at a time, so no rank ever holds the
            whole model.
        engine_class: the engine's class (the alias's ``deepspeed.initialize`` asks for ``DeepSpeedEngine``).
    """
    if model is None:  # DeepSpeed's check, with its error type (raised, so that python -O keeps it)
        raise AssertionError("deepspeed.initialize requires a model")
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise DeepSpeedAPIError(f"initialize({name}=...): model parallelism is not implemented by zeropp; "
                                    "zeropp partitions over data-parallel ranks only")
    source = _config_source(args, config, config_params)
    if dist_init_required is False and not dist.is_initialized():
        raise RuntimeError("initialize(dist_init_required=False): no process group exists yet")
    if distributed_port is not None:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    give_back_holders(model)
    with deepspeed_config_errors():  # DeepSpeed's error type, still zeropp's ConfigError (a ValueError)
        engine = build(model, config=source, optimizer=optimizer, model_parameters=model_parameters,
                       lr_scheduler=lr_scheduler, param_init_fn=param_init_fn, engine_class=engine_class)
    # DeepSpeed's engine has an optimizer only when the arguments or the config name one (zeropp's default AdamW
    # is not one it would have: Note [no optimizer])
    engine.__dict__["_has_optimizer"] = optimizer is not None or engine.config.optimizer is not None
    loader = None
    if training_data is not None:  # DeepSpeed's loader: micro-batches of this rank's part of each epoch
        topo = engine.topo
        sampler = torch.utils.data.DistributedSampler(
            training_data, num_replicas=topo.world_size, rank=topo.rank, shuffle=True
        )
        loader = torch.utils.data.DataLoader(training_data, batch_size=engine.policy.micro_batch_per_rank,
                                             sampler=sampler, collate_fn=collate_fn)
    return InitResult(engine, engine.master_optimizer, loader, engine.lr_scheduler)


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The config as DeepSpeed's ``initialize`` finds it: ``config`` (``config_params`` its older name), else
    ``args.deepspeed_config`` (``args.deepscale_config`` its deprecated name: moved there, with DeepSpeed's warning);
    both at once is DeepSpeed's AssertionError. A base64 string is a config too. None given: zeropp's defaults."""
    if config is None:
        config = config_params
    if getattr(args, "deepscale_config", None) is not None:
        logger.warning("************ --deepscale_config is deprecated, please use --deepspeed_config ************")
        if getattr(args, "deepspeed_config", None) is not None:
            raise AssertionError("Not sure how to proceed, we were given both a deepscale_config and deepspeed_config")
        args.deepspeed_config, args.deepscale_config = args.deepscale_config, None
    args_config = getattr(args, "deepspeed_config", None)
    if args_config is not None:
        if config is not None:
            raise AssertionError("Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments "
                                 "and deepspeed.initialize() function call")
        config = args_config
    return decoded_config(config) if config is not None else {}


def give_back_holders(model: nn.Module) -> None:
    """Note [a second initialize]: DeepSpeed's ``initialize`` on a model a live engine still holds builds a second
    engine over the same parameters, each writing their storage (at stage 3 both step the same partitions). zeropp
    gives the earlier engine's model back whole first (``engine.destroy()``: each parameter holds its current value,
    the 16-bit weights the next forward would use, every hook removed), with a warning, and builds the new engine from
    those values; the earlier engine then refuses to train, save or load (:class:`EngineGivenBackError`). Collective,
    as ``initialize`` is."""
    managed = gathered.managed_ids()
    if not managed or not any(id(p) in managed for p in model.parameters()):
        return
    holders: list[Any] = []
    for p in model.parameters():
        loc = ps.locate(p) if id(p) in managed else None
        if loc is not None and not any(loc.engine is h for h in holders):
            holders.append(loc.engine)
    for engine in holders:
        warnings.warn("initialize: the model's parameters are held by a live engine; DeepSpeed would build a second "
                      "engine over the same parameters (two engines writing one parameter's storage). zeropp gives "
                      "the earlier engine's model back whole (engine.destroy()) and builds the new engine from those "
                      "values; the earlier engine refuses further use", RuntimeWarning, stacklevel=3)
        engine.unpartition()
        engine.__dict__["_given_back"] = "a later initialize() took its model"


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line switches: ``--deepspeed``, ``--deepspeed_config`` (and the older
    ``--deepscale``/``--deepscale_config``); ``initialize(args=...)`` reads ``args.deepspeed_config``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by zeropp)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a no-op flag for zeropp: initialize always partitions)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: Optional[int] = None, verbose: bool = True,
                     timeout: Optional[datetime.timedelta] = None, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Create the default process group as torchrun describes it (a no-op when it exists; a lone process
    without torchrun forms a world of one, as in ``initialize``).

    ``dist_backend``: "gloo", "nccl" or None (gloo for host tensors, NCCL for CUDA ones where available).
    ``rank``/``world_size``/``init_method``/``timeout`` are passed to ``torch.distributed`` when given; MPI
    discovery and ``config`` are DeepSpeed's and have no effect here (torchrun's environment is read instead).
    """
    if distributed_port is not None:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0 and world_size > 0:
        kwargs.update(rank=rank, world_size=world_size)
    ensure_process_group(dist_backend, **kwargs)
