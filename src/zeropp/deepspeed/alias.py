"""The compatibility layer: DeepSpeed's module tree over zeropp, for code that imports ``deepspeed`` itself.

``import zeropp as deepspeed`` serves scripts that take DeepSpeed's module-level names from one object. Code that
writes ``from deepspeed.utils import safe_get_full_fp32_param`` or ``import deepspeed`` inside a library
(transformers, PEFT, TRL and accelerate do) needs a ``deepspeed`` package; :func:`install_deepspeed_alias`
registers ``zeropp.deepspeed`` and its submodules under DeepSpeed's names, on request only:

    import zeropp.deepspeed.alias
    zeropp.deepspeed.alias.install_deepspeed_alias()
    import deepspeed                            # zeropp's DeepSpeed API
    from deepspeed.utils import safe_get_full_fp32_param

While the alias is installed, parameters partitioned from then on carry DeepSpeed's ``ds_*`` attributes as
read-only views (``deepspeed/params.py``), and ``importlib.metadata`` reports a ``deepspeed`` distribution
of the version the layer follows: libraries check it before they use DeepSpeed (transformers'
``HfDeepSpeedConfig`` requires ``deepspeed>=0.9.3``).

Coexistence with a real DeepSpeed: if it is already imported, the alias refuses (two engines in one process
would each partition the other's parameters); if it is installed but not imported, the alias takes its place in
this process and says so with a warning. :func:`uninstall_deepspeed_alias` takes the names away again.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import pathlib
import pkgutil
import sys
import warnings
from typing import Any, Iterator, Optional

_PACKAGE = "zeropp.deepspeed"


class DeepSpeedAliasError(RuntimeError):
    """The ``deepspeed`` alias cannot be installed (the real DeepSpeed is already imported)."""


def _ours() -> list[str]:
    """Every module of the compatibility tree, by its zeropp name, parents first."""
    root = importlib.import_module(_PACKAGE)
    names = [_PACKAGE]
    for info in pkgutil.walk_packages(root.__path__, _PACKAGE + "."):
        names.append(info.name)
    return names


class _AliasDistribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution as ``importlib.metadata`` reports it while the alias is installed."""

    def read_text(self, filename: str) -> Optional[str]:
        if filename == "METADATA":
            version = importlib.import_module(_PACKAGE).__version__
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n"
                    "Summary: zeropp's DeepSpeed API (zeropp.deepspeed.alias.install_deepspeed_alias)\n")
        return None

    def locate_file(self, path: Any) -> pathlib.Path:
        return pathlib.Path(importlib.import_module(_PACKAGE).__file__).parent / str(path)


class _AliasMetadata(importlib.abc.MetaPathFinder):
    """Finds no modules (``sys.modules`` holds the alias's); reports the ``deepspeed`` distribution."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("-", "_").lower() == "deepspeed":
            yield _AliasDistribution()


_METADATA = _AliasMetadata()


def alias_installed() -> bool:
    """Whether ``deepspeed`` in this process is zeropp's DeepSpeed API."""
    return getattr(sys.modules.get("deepspeed"), "__name__", "") == _PACKAGE


def install_deepspeed_alias() -> None:
    """Register zeropp's DeepSpeed API as ``deepspeed`` (and ``deepspeed.utils``, ``deepspeed.runtime.zero``, ...)."""
    current = sys.modules.get("deepspeed")
    if current is not None:
        if alias_installed():
            return  # installed already
        raise DeepSpeedAliasError(
            f"DeepSpeed itself is already imported in this process (from {getattr(current, '__file__', '?')}); "
            "zeropp will not stand in for it. Install the alias before anything imports deepspeed, or use "
            "DeepSpeed's own engine")
    if importlib.util.find_spec("deepspeed") is not None:
        warnings.warn("the installed DeepSpeed package is shadowed in this process by zeropp's DeepSpeed API "
                      "(zeropp.deepspeed.alias.install_deepspeed_alias)", stacklevel=2)
    for name in _ours():
        module = importlib.import_module(name)
        sys.modules["deepspeed" + name[len(_PACKAGE):]] = module
    importlib.import_module(f"{_PACKAGE}.params").install()  # ds_* views on parameters partitioned from now on
    if _METADATA not in sys.meta_path:
        sys.meta_path.insert(0, _METADATA)  # ahead of an installed DeepSpeed's, which the alias stands in for


def uninstall_deepspeed_alias() -> None:
    """Take away what :func:`install_deepspeed_alias` registered."""
    for key in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
        if getattr(sys.modules[key], "__name__", "").startswith(_PACKAGE):
            del sys.modules[key]
    importlib.import_module(f"{_PACKAGE}.params").uninstall()
    if _METADATA in sys.meta_path:
        sys.meta_path.remove(_METADATA)


__all__ = ["alias_installed", "install_deepspeed_alias", "uninstall_deepspeed_alias", "DeepSpeedAliasError"]
