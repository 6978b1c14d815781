"""SGLang announcing L3 itself: the change of docs/upstream-sglang-l3-events.md,
applied to the installed SGLang inside a server's processes only, so that
the change's test runs on a CPU server before it is proposed.

``CHANGES`` is the change, as (old, new) text per module of SGLang 0.5.23;
``changed_source`` applies it (each old text must occur exactly once, so a
release where it no longer fits fails loudly instead of running unchanged).
``write_site(folder)`` writes a ``sitecustomize.py`` for a server's
``PYTHONPATH`` (``ServerConfig.pythonpath``) that loads those modules from
the changed text as SGLang imports them. It loads this file by its path,
so nothing of SGLang or torch is imported early. The installed files are
never touched.
"""

from __future__ import annotations

import os

__all__ = ["CHANGES", "changed_source", "install", "write_site"]

#: module -> [(old, new)]: the change, against SGLang 0.5.23
CHANGES: dict[str, list[tuple[str, str]]] = {
    # 1. The backup acknowledgement: where SGLang counts a node's pages as in L3.
    "sglang.srt.mem_cache.unified_radix_cache": [(
        """                    entry = self.ongoing_backup.pop(operation.id, None)
                    if entry is not None:
                        node_id, lock_params = entry
                        self.dec_host_lock_ref(node_id, lock_params)
""",
        """                    entry = self.ongoing_backup.pop(operation.id, None)
                    if entry is not None:
                        node_id, lock_params = entry
                        # The node's pages are in L3 now: announce them as the
                        # GPU and host tiers are (every namespace, with tokens).
                        self.tree_core.record_backup_stored(
                            node_id, operation.completed_tokens
                        )
                        self.dec_host_lock_ref(node_id, lock_params)
""",
    )],
    # 2. The tree core's interface: a default that announces nothing.
    "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface": [(
        """    def take_events(self) -> list:
        \"\"\"Hand the queued KV placement events to the Controller.\"\"\"
        return self.kv_events.take()
""",
        """    def take_events(self) -> list:
        \"\"\"Hand the queued KV placement events to the Controller.\"\"\"
        return self.kv_events.take()

    def record_backup_stored(self, node_id: NodeId, completed_tokens: int) -> None:
        \"\"\"Announce a node's pages on the storage tier once its backup to
        it is acknowledged (``BlockStored``, ``medium=EXTERNAL``). A tree core
        that cannot name the node's pages announces nothing.\"\"\"
        return None
""",
    )],
    # 3. The Python tree core: the node's own events, on the storage medium.
    "sglang.srt.mem_cache.unified_cache.unified_tree_core": [(
        """        return self._node_arena[node_id]
""",
        """        return self._node_arena[node_id]

    def record_backup_stored(self, node_id: NodeId, completed_tokens: int) -> None:
        node = self._node_arena.get(node_id)
        # A backup cut short stored a prefix of the node only; SGLang's own
        # L3 lookup still finds that prefix, so nothing is lost by waiting.
        if node is None or completed_tokens < len(node.key):
            return
        self.kv_events.record_store(node, medium=StorageMedium.EXTERNAL)
""",
    )],
}


def changed_source(module: str, source: str) -> str:
    """``source`` of ``module`` with its ``CHANGES`` applied; ValueError
    naming the module when an old text is not there exactly once."""
    for old, new in CHANGES.get(module, ()):
        found = source.count(old)
        if found != 1:
            raise ValueError(f"{module}: the text to change occurs {found} times, not once: "
                             f"this SGLang is not the release the change is written against")
        source = source.replace(old, new)
    return source


_SITECUSTOMIZE = '''\
"""SGLang with the change of docs/upstream-sglang-l3-events.md (written by
sglang_simm_dev.upstream_l3_events.write_site; see that module)."""
import importlib.util as _util
import sys as _sys
_spec = _util.spec_from_file_location("_sglang_simm_upstream_l3_events", {path!r})
_change = _util.module_from_spec(_spec)
_sys.modules[_spec.name] = _change
_spec.loader.exec_module(_change)
_change.install()
'''


def write_site(folder: str | os.PathLike) -> str:
    """Write the ``sitecustomize.py`` into ``folder`` (created); returns the
    folder, for ``ServerConfig.pythonpath``."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(_SITECUSTOMIZE.format(path=os.path.abspath(__file__)))
    return folder


def install() -> None:
    """Load ``CHANGES``' modules from their changed text when imported."""
    import importlib.abc
    import importlib.util
    import sys

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in CHANGES:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
                return spec

            def exec_module(module, origin=spec.origin):
                with open(origin, encoding="utf-8") as fh:
                    code = compile(changed_source(name, fh.read()), origin, "exec")
                exec(code, module.__dict__)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
