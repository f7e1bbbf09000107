"""``zeropp.install_deepspeed_alias()``: the ``deepspeed`` package and its submodules on request, never over a
DeepSpeed already imported, and gone again after ``uninstall_deepspeed_alias``."""
from __future__ import annotations

import importlib
import sys
import types

import pytest

import zeropp
from zeropp.deepspeed.alias import DeepSpeedAliasError, uninstall_deepspeed_alias
from zeropp.deepspeed.missing import DeepSpeedAPIError


def test_deepspeeds_module_paths_import(alias):
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus
    from deepspeed.utils import safe_get_full_fp32_param, set_z3_leaf_modules
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    zero = importlib.import_module("deepspeed.zero")
    assert deepspeed.initialize.__wrapped__ is zeropp.initialize and zero.Init is zeropp.zero.Init
    assert GatheredParameters is zeropp.zero.GatheredParameters and ZeroParamStatus.NOT_AVAILABLE.value == 2
    assert zero.TiledLinear is zeropp.zero.TiledLinear
    assert callable(safe_get_full_fp32_param) and callable(set_z3_leaf_modules)
    assert callable(get_fp32_state_dict_from_zero_checkpoint) and deepspeed.__version__ == "0.19.8"
    with pytest.raises(DeepSpeedAPIError, match="deepspeed.ops.adam.FusedAdam"):
        from deepspeed.ops.adam import FusedAdam  # noqa: F401
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
    with pytest.raises(DeepSpeedAPIError, match="unwrap_model_for_generation takes the engine.*NoneType"):
        with unwrap_model_for_generation(None):
            pass
    zeropp.install_deepspeed_alias()  # a second call changes nothing


def test_a_real_deepspeed_already_imported_is_never_shadowed():
    real = types.ModuleType("deepspeed")
    real.__file__ = "/site-packages/deepspeed/__init__.py"
    sys.modules["deepspeed"] = real
    try:
        with pytest.raises(DeepSpeedAliasError, match="already imported.*/site-packages/deepspeed"):
            zeropp.install_deepspeed_alias()
        assert sys.modules["deepspeed"] is real
    finally:
        del sys.modules["deepspeed"]


def test_uninstall_takes_every_name_away(alias):
    import deepspeed.utils  # noqa: F401
    uninstall_deepspeed_alias()
    assert not [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("deepspeed")


def test_deepspeeds_comm_is_provided_and_works_without_a_process_group(alias):
    import deepspeed
    from deepspeed.comm import ReduceOp, get_rank, get_world_size, log_summary, reset_log
    assert deepspeed.comm.__name__ == "zeropp.deepspeed.comm" and ReduceOp.SUM is not None
    assert (get_rank(), get_world_size()) == (0, 1)  # as DeepSpeed's, before any group exists
    reset_log()
    assert log_summary(return_dict=True) == {} and log_summary() is None


def test_import_zeropp_as_deepspeed_reaches_the_subpackages():
    import zeropp as deepspeed
    assert deepspeed.utils.safe_get_full_fp32_param.__module__ == "zeropp.deepspeed.utils"
    assert deepspeed.runtime.zero.ZeroParamStatus.AVAILABLE.value == 1
    with pytest.raises(DeepSpeedAPIError, match="deepspeed.moe"):
        deepspeed.moe  # noqa: B018


def test_the_alias_reports_a_deepspeed_distribution_that_transformers_accepts(alias):
    """Libraries check DeepSpeed's package metadata before using it (transformers' ``HfDeepSpeedConfig`` requires
    ``deepspeed>=0.9.3``): the alias reports its version while installed, and the report goes with it."""
    import importlib.metadata

    import torch
    from transformers.dependency_versions_check import dep_version_check
    from transformers.integrations.deepspeed import is_deepspeed_available, prevent_arange_dtype_change
    assert importlib.metadata.version("deepspeed") == "0.19.8"
    assert "deepspeed" in {d.metadata["Name"] for d in importlib.metadata.distributions()}
    assert is_deepspeed_available()
    dep_version_check("deepspeed")  # transformers' requirement (deepspeed>=0.9.3) is met
    # transformers swaps DeepSpeed's constructor wrapper around zero.Init; zeropp's Init wraps none
    from deepspeed.runtime.zero import partition_parameters as pp
    original = pp.zero_wrapper_for_fp_tensor_constructor
    with prevent_arange_dtype_change():
        assert pp.zero_wrapper_for_fp_tensor_constructor is not original
        with zeropp.zero.Init(enabled=False):
            assert torch.arange(3, dtype=torch.float32).dtype == torch.float32
    assert pp.zero_wrapper_for_fp_tensor_constructor is original
    wrapped = original(torch.ones, torch.bfloat16)
    assert wrapped(2).dtype == torch.bfloat16 and wrapped(2, dtype=torch.int64).dtype == torch.int64
    uninstall_deepspeed_alias()  # (a real DeepSpeed installed here would still be reported: only ours goes)
    assert not [d for d in importlib.metadata.distributions() if "zeropp" in (d.metadata["Summary"] or "")]
