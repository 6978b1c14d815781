"""The one adapter between the backend and a SiMM client.

Both clients have the ``simm.kv`` surface: the real one (SiCL over RDMA) and
the local store that ships with this package. ``connect`` picks one from
the configuration, sets its flags, and hands back a ``KVClient`` whose batch
methods are the store's own bound methods (or SiMM's native ones,
``native_layer``), so the adapter adds no work per call. Everything that
differs between the clients lives here.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
import uuid
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Sequence

from sglang_simm.errors import (
    ClientNotInstalledError,
    ClusterUnreachableError,
    code_name,
)
from sglang_simm.keys import WARMUP_KEY_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    from sglang_simm.config import SiMMConfig

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "The SiMM client is not on PyPI (the PyPI package named 'simm' is an "
    "unrelated project: pip uninstall simm). Build and install it from "
    "https://github.com/scitix/SiMM together with the vendor's SiCL package, "
    "or set manager_address to 'local' to run on the local store."
)

#: The names a module must have to be SiMM's client.
_REQUIRED = ("Store", "BlockView", "register_mr", "set_flag")


def load_kv_module(config: SiMMConfig) -> ModuleType:
    """``sglang_simm.local_store`` for ``local``/``local://NAME``, else ``simm.kv``."""
    if config.is_local_store:
        return importlib.import_module("sglang_simm.local_store")
    return import_real_client()


def import_real_client() -> ModuleType:
    try:
        kv = importlib.import_module("simm.kv")
    except ImportError as exc:
        foreign = _foreign_simm()
        detail = f" A module named 'simm' is installed but it is {foreign}." if foreign else ""
        raise ClientNotInstalledError(
            f"cannot import the SiMM client 'simm.kv' ({exc}).{detail} {INSTALL_HINT}"
        ) from exc
    missing = [name for name in _REQUIRED if not hasattr(kv, name)]
    if missing:
        raise ClientNotInstalledError(
            f"'simm.kv' at {getattr(kv, '__file__', '?')} is not SiMM's client "
            f"(missing {', '.join(missing)}). {INSTALL_HINT}"
        )
    return kv


def _foreign_simm() -> str | None:
    """Describe an installed ``simm`` distribution that is not SiMM's."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("simm")
    except PackageNotFoundError:
        return None
    top = (dist.read_text("top_level.txt") or "").split()
    summary = dist.metadata.get("Summary") or ""
    return f"PyPI's unrelated 'simm' {dist.version} (installs {', '.join(top) or '?'}; {summary!r})"


def client_flags(config: SiMMConfig, *, log_file: str) -> dict[str, str]:
    """The flags to set before ``Store()``, operator passthrough last so an
    explicit ``client_flags`` entry always wins."""
    flags: dict[str, str] = {}
    if config.is_local_store:
        flags["cm_primary_node_ip"] = config.local_store_name
        flags["local_store_scope"] = config.local_store_scope
        if config.local_store_capacity_bytes is not None:
            flags["local_store_capacity_bytes"] = str(config.local_store_capacity_bytes)
        if config.local_store_dir:
            flags["local_store_dir"] = config.local_store_dir
    else:
        # The client's port flag is cm_rpc_inter_port; SGLang's in-tree backend
        # sets "cm_primary_node_port", which the client rejects, so its port
        # setting never took effect.
        flags["cm_primary_node_ip"] = config.host
        flags["cm_rpc_inter_port"] = str(config.port)
        # With clnt_use_k8s (the client's default) the manager is looked up in
        # Kubernetes first and the address above is only a fallback; an
        # explicit address means exactly that address.
        flags["clnt_use_k8s"] = "false"
        flags["clnt_log_file"] = log_file
    flags["clnt_thread_pool_size"] = str(config.clnt_threadpool_size)
    flags["clnt_sync_req_timeout_ms"] = str(config.request_timeout_ms)
    flags.update({str(k): str(v) for k, v in config.client_flags.items()})
    return flags


class KVClient:
    """A connected SiMM client. Batch calls are the store's bound methods."""

    def __init__(self, kv: ModuleType, store: Any, *, description: str):
        self.kv = kv
        self.store = store
        self.description = description
        self.mexists: Callable[[Sequence[str]], list[bool]] = store.mexists
        self.mget: Callable[[Sequence[str], Sequence[Any]], list[int]] = store.mget
        self.mput: Callable[[Sequence[str], Sequence[Any]], list[int]] = store.mput
        self.put = store.put
        self.get = store.get
        self.exists = store.exists
        self.delete = store.delete
        self.allocate = store.allocate
        #: what the store removed since a cursor (``Store.removed_since``): the local store only
        self.removed_since: Callable[..., Any] | None = getattr(store, "removed_since", None)
        native = native_layer(kv, store)
        #: whether the batch calls below skip SiMM's Python layer (``native_layer``)
        self.native = native is not None
        if native is not None:
            data_view, impl = native
            #: a view of host memory for the ``*_views`` calls: ``view(ptr, size, mr)``
            self.view: Callable[[int, int, Any], Any] = data_view
            self.mput_views: Callable[[Sequence[str], Sequence[Any]], list[int]] = impl.MPut
            self.mget_views: Callable[[Sequence[str], Sequence[Any]], list[int]] = impl.MGet
            #: per key 0 where the object exists, else a code (mexists's answer before bools)
            self.mexists_codes: Callable[[Sequence[str]], list[int]] = impl.MExists
        else:
            self.view = kv.BlockView.from_buffer
            self.mput_views = store.mput
            self.mget_views = store.mget
            codes = getattr(store, "mexists_codes", None)
            self.mexists_codes = codes if callable(codes) else _codes_of(store.mexists)

    def register(self, tensor: Any) -> Any:
        mr = self.kv.register_mr(tensor)
        if mr is None:
            raise ClusterUnreachableError(
                f"register_mr failed for {tensor.numel() * tensor.element_size()} bytes "
                f"on {self.description}: check the RDMA devices (sglang-simm doctor)"
            )
        return mr

    def deregister(self, mr: Any) -> bool:
        return bool(self.kv.deregister_mr(mr))

    @property
    def supports_delete_prefix(self) -> bool:
        return hasattr(self.store, "delete_prefix")

    def delete_prefix(self, prefix: str) -> int:
        return int(self.store.delete_prefix(prefix))

    def warmup(self, *, attempts: int = 3, size: int = 4096) -> float:
        """Put, check, get and delete a uuid-named object; seconds taken. A
        broken data path then fails at start-up instead of every call missing."""
        key = f"{WARMUP_KEY_PREFIX}{uuid.uuid4().hex}"
        payload = key.encode().ljust(size, b"\0")
        last = "no attempt"
        for attempt in range(1, attempts + 1):
            start = time.perf_counter()
            try:
                src = self.allocate(size)
                src.as_ref().copy_(_bytes_tensor(payload))
                code = self.put(key, src.view())
                if code != 0:
                    last = f"put returned {code_name(code)}"
                elif not self.exists(key):
                    last = "the object was not found right after put"
                else:
                    dst = self.allocate(size)
                    got = self.get(key, dst.view())
                    if got != size:
                        last = f"get returned {code_name(got) if got < 0 else got}"
                    elif bytes(dst.as_ref().numpy().tobytes()) != payload:
                        last = "get returned different bytes"
                    else:
                        self.delete(key)
                        return time.perf_counter() - start
            except Exception as exc:  # the native client raises its own types
                last = f"{type(exc).__name__}: {exc}"
            logger.warning("SiMM warm-up attempt %d/%d failed: %s", attempt, attempts, last)
            time.sleep(0.05 * attempt)
        raise ClusterUnreachableError(
            f"SiMM warm-up round trip to {self.description} failed after {attempts} "
            f"attempts ({last}). Check manager_address and run 'sglang-simm doctor'."
        )

    @property
    def closed(self) -> bool:
        return self.store is None

    def close(self) -> None:
        """Close the store where it can be closed (SiMM's ``Store`` cannot:
        its connections go with the last reference), and drop it either
        way, so a process whose backends are all closed holds no connection
        to a local store. Idempotent; calls after it raise."""
        store, self.store = self.store, None
        if store is None:
            return
        for name in ("mexists", "mget", "mput", "put", "get", "exists", "delete", "allocate",
                     "mput_views", "mget_views", "mexists_codes"):
            setattr(self, name, _closed)
        close = getattr(store, "close", None)
        if callable(close):
            close()


def native_layer(kv: ModuleType, store: Any) -> tuple[Callable[..., Any], Any] | None:
    """SiMM's native view class and native store under ``store``, when the
    client is built in SiMM's layers; else None.

    SiMM's Python ``BlockView`` wraps one native ``_kv.DataView``, and its
    ``Store.mput``/``mget``/``mexists`` unwrap every view (or wrap every
    code) in a Python loop around the native ``_impl`` calls; zero-copy
    batches skip that per-object work. Only a client that has every piece
    is taken this way; any other takes the public calls."""
    native = getattr(kv, "_kv", None)
    data_view = getattr(native, "DataView", None)
    store_type = getattr(native, "KVStore", None)
    impl = getattr(store, "_impl", None)
    if not (isinstance(data_view, type) and isinstance(store_type, type) and isinstance(impl, store_type)):
        return None
    if not all(callable(getattr(impl, name, None)) for name in ("MPut", "MGet", "MExists")):
        return None
    return data_view, impl


def _codes_of(mexists: Callable[[Sequence[str]], list[bool]]) -> Callable[[Sequence[str]], list[int]]:
    def mexists_codes(keys: Sequence[str]) -> list[int]:
        return [0 if found else 1 for found in mexists(keys)]

    return mexists_codes


def _closed(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("the SiMM client is closed")


def _bytes_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _prepare_log_file(path: str) -> str:
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    except OSError as exc:
        from sglang_simm.config import default_log_file

        fallback = default_log_file()
        logger.warning("cannot create the SiMM client log directory for %s (%s); using %s", path, exc, fallback)
        os.makedirs(os.path.dirname(fallback), exist_ok=True)
        return fallback
    return path


def connect(
    config: SiMMConfig,
    *,
    kv_module: ModuleType | None = None,
    gpu: int | None = None,
) -> KVClient:
    """Choose the client, set flags and NICs, create the store, warm it up.
    ``kv_module`` injects a module with the ``simm.kv`` surface (tests and
    benchmarks); ``gpu`` is the CUDA device whose NUMA node may decide the
    NICs (None: the current one, which SGLang sets in each scheduler)."""
    kv = kv_module if kv_module is not None else load_kv_module(config)
    local = config.is_local_store
    if local:
        from sglang_simm.config import local_store_place

        place = local_store_place(config)
        if place is None:
            description = f"in-process local store {config.local_store_name!r}"
        else:
            # said where it lives: doctor, run from another shell, may look elsewhere
            description = f"local store {config.local_store_name!r} in {place[0]}"
            logger.info("SiMM local store %r lives in %s (%s)", config.local_store_name, *place)
        log_file = ""
    else:
        description = f"SiMM cluster manager {config.manager_address}"
        from sglang_simm.config import default_log_file
        from sglang_simm.numa import apply_nic_choice, current_gpu_pci_bus_id, select_nics

        log_file = _prepare_log_file(config.log_file or default_log_file())
        choice = select_nics(config, gpu_pci_bus_id=current_gpu_pci_bus_id(gpu))
        in_effect = apply_nic_choice(choice)
        if in_effect:
            logger.info("SiMM RDMA devices: %s (%s)", in_effect, choice.reason)
        else:
            logger.warning("SiMM found no RDMA device to use: %s", choice.reason)

    for name, value in client_flags(config, log_file=log_file).items():
        if name.startswith(("local_store_", "embedded_")) and not local:
            continue
        if not kv.set_flag(name, value):
            logger.warning("the SiMM client rejected flag %s=%r", name, value)
    try:
        store = kv.Store()
    except Exception as exc:
        raise ClusterUnreachableError(
            f"cannot connect to {description}: {type(exc).__name__}: {exc}. "
            "Check manager_address and run 'sglang-simm doctor'."
        ) from exc
    client = KVClient(kv, store, description=description)
    del store  # the client holds it; a failed warm-up must not keep it alive
    if config.warmup:
        try:
            took = client.warmup()
        except BaseException:
            client.close()
            raise
        logger.info("SiMM warm-up round trip to %s took %.2f ms", description, took * 1e3)
    return client
