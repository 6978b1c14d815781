"""SGLang general-plugin entry point (group ``sglang.srt.plugins``, name ``simm``).

SGLang (0.5.11+) calls ``register()`` early in every process it starts, and
may call it more than once. It points the storage backend name ``simm`` at
this package's ``HiCacheSiMM`` instead of SGLang's in-tree one. It must never
break SGLang's start-up: anything unexpected is logged and ignored.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND_NAME = "simm"
MODULE_PATH = "sglang_simm"
CLASS_NAME = "HiCacheSiMM"


def register() -> bool:
    """Register ``simm`` with SGLang's StorageBackendFactory; True if it now
    resolves to this package. Idempotent."""
    try:
        # Importing the factory registers SGLang's built-ins first, so our
        # entry, written after, is the one that stays.
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except Exception as exc:  # SGLang absent or too old: nothing to plug into
        logger.debug("sglang-simm: SGLang's storage factory is not importable (%s)", exc)
        return False
    try:
        registry = StorageBackendFactory._registry
        entry = registry.get(BACKEND_NAME)
        if entry and entry.get("module_path") == MODULE_PATH and entry.get("class_name") == CLASS_NAME:
            return True
        # Drop the in-tree entry first so SGLang does not log a misleading
        # "already registered, overwriting" warning in every process.
        registry.pop(BACKEND_NAME, None)
        StorageBackendFactory.register_backend(BACKEND_NAME, MODULE_PATH, CLASS_NAME)
        logger.info("sglang-simm: storage backend %r now resolves to %s.%s", BACKEND_NAME, MODULE_PATH, CLASS_NAME)
        return True
    except Exception:
        logger.exception("sglang-simm: could not register the %r storage backend", BACKEND_NAME)
        return False
