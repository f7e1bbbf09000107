"""``zeropp plan``: which ZeRO stage and ZeRO++ techniques to run on a given model and cluster, and whether it fits.

A cost model of one optimizer step as the engine runs it (``schedule.py``), with bytes from ``accounting.py``
(``collectives.py``), times from measured or given speeds (``profile.py``, ``hardware.py``) and model-state memory
equal to ``engine.model_state_bytes()`` (``memory.py``). See docs/plan.md.

Importing this package loads nothing heavy (names resolve on first use) and creates no process group;
``calibrate.py`` measures a machine when asked to.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Choice": "choices", "candidates": "choices", "config_json": "choices",
    "GPU_DEFAULTS": "hardware", "Hardware": "hardware", "from_profile": "hardware", "gpu_cluster": "hardware",
    "Memory": "memory", "memory": "memory", "model_states": "memory",
    "ModelSpec": "model", "UnitSpec": "model", "demo_gpt": "model", "from_hf_config": "model",
    "from_module": "model", "gpt_of_size": "model", "transformer": "model",
    "PlanError": "profile", "Profile": "profile", "load_profile": "profile",
    "FABRICS": "presets", "GPUS": "presets", "fabric_preset": "presets", "gpu_preset": "presets",
    "Row": "ranking", "best_config": "ranking", "evaluate": "ranking", "rank": "ranking",
    "StepTime": "schedule", "Workload": "schedule", "step_time": "schedule",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'zeropp.tools.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zeropp.tools.plan.{_WHERE[name]}"), name)
