"""The package root: ``HiCacheSiMM`` and ``SiMMConfig``, resolved lazily (SiMM as SGLang's third HiCache tier).

Importing this package is cheap on purpose: it imports neither SGLang nor
torch, because SGLang calls the plugin entry point in every process it
starts. ``HiCacheSiMM`` resolves lazily, so the dynamic route's
``module_path: "sglang_simm", class_name: "HiCacheSiMM"`` works.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["HiCacheSiMM", "SiMMConfig", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from sglang_simm.backend import HiCacheSiMM
    from sglang_simm.config import SiMMConfig

_LAZY = {
    "HiCacheSiMM": "sglang_simm.backend",
    "SiMMConfig": "sglang_simm.config",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'sglang_simm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
