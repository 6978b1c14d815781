"""Which RDMA NICs this process should use, from sysfs and the CPU affinity.

Pure functions over a ``sysfs_root`` (``/sys`` by default; tests build a fake
tree), none raising over a missing or odd sysfs: no RDMA drivers, no NICs.

Files read (relative to ``sysfs_root``)::

    class/infiniband/<dev>/device/numa_node      NIC's node, -1 on UMA
    class/infiniband/<dev>/ports/<n>/state       "4: ACTIVE"
    devices/system/cpu/cpu<k>/node<N>            CPU k is on node N
    bus/pci/devices/<domain:bus:dev.fn>/numa_node  a GPU's node

SiCL (SiMM's transport) takes the NICs from ``SICL_NET_DEVICES``, read when
the client's ``Store()`` is built; :func:`apply_nic_choice` sets it.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "NET_DEVICES_ENV",
    "NicChoice",
    "RdmaDevice",
    "apply_nic_choice",
    "choose_nics",
    "cpu_to_node",
    "current_gpu_pci_bus_id",
    "gpu_numa_node",
    "list_rdma_devices",
    "node_of_cpus",
    "normalize_pci_bus_id",
    "select_nics",
]

logger = logging.getLogger("sglang_simm.numa")

#: The env var SiCL reads its NIC list from.
NET_DEVICES_ENV = "SICL_NET_DEVICES"

_UNKNOWN_NODE = -1
_CPU_DIR_RE = re.compile(r"cpu(\d+)")
_NODE_RE = re.compile(r"node(\d+)")
_DIGITS_RE = re.compile(r"(\d+)")


@dataclass(frozen=True)
class RdmaDevice:
    """One RDMA device under ``class/infiniband``."""

    name: str
    """Device name, e.g. ``mlx5_0``."""

    numa_node: int = _UNKNOWN_NODE
    """Its NUMA node; -1 on UMA machines or when unknown (counts as any node)."""

    port_states: dict[int, str] = field(default_factory=dict)
    """Port number -> state word (``ACTIVE``, ``DOWN``, ``INIT``, ...)."""

    @property
    def active(self) -> bool:
        """True when any port is ACTIVE."""
        return any(state == "ACTIVE" for state in self.port_states.values())


@dataclass(frozen=True)
class NicChoice:
    """The NICs picked for this process, and why (for logs and ``doctor``)."""

    devices: tuple[str, ...]
    """Device names for ``SICL_NET_DEVICES``; empty when none was found."""

    numa_node: int | None
    """The NUMA node the choice was made for; None when not node-based."""

    reason: str
    """Human text: which rule decided, and on what evidence."""


def _natural_key(name: str) -> list[Any]:
    """``mlx5_2`` before ``mlx5_10``."""
    return [int(part) if part.isdigit() else part for part in _DIGITS_RE.split(name)]


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fin:
            return fin.read().strip()
    except OSError:
        return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read_int(path: str) -> int | None:
    try:
        return int(_read_text(path))  # type: ignore[arg-type]
    except (TypeError, ValueError):  # unreadable (None), or not a number
        return None


def list_rdma_devices(sysfs_root: str = "/sys") -> list[RdmaDevice]:
    """Every device under ``class/infiniband``, sorted by name; [] when there is none."""
    ib_root = os.path.join(sysfs_root, "class", "infiniband")
    devices = []
    for name in sorted(_listdir(ib_root), key=_natural_key):
        dev_dir = os.path.join(ib_root, name)
        node = _read_int(os.path.join(dev_dir, "device", "numa_node"))
        if node is None or node < 0:
            node = _UNKNOWN_NODE
        ports: dict[int, str] = {}
        ports_dir = os.path.join(dev_dir, "ports")
        for port in _listdir(ports_dir):
            if not port.isdigit():
                continue
            text = _read_text(os.path.join(ports_dir, port, "state"))
            if text is None:
                continue
            # "4: ACTIVE" -> "ACTIVE"; a bare word is taken as is
            ports[int(port)] = text.split(":", 1)[-1].strip().upper()
        devices.append(RdmaDevice(name=name, numa_node=node, port_states=dict(sorted(ports.items()))))
    return devices


def cpu_to_node(sysfs_root: str = "/sys") -> dict[int, int]:
    """CPU id -> NUMA node, from the ``node<N>`` entries under ``devices/system/cpu/cpu<k>/``."""
    cpu_root = os.path.join(sysfs_root, "devices", "system", "cpu")
    mapping: dict[int, int] = {}
    for entry in _listdir(cpu_root):
        match = _CPU_DIR_RE.fullmatch(entry)
        if not match:
            continue
        inner = _listdir(os.path.join(cpu_root, entry))
        nodes = sorted(int(m.group(1)) for m in map(_NODE_RE.fullmatch, inner) if m)
        if nodes:
            mapping[int(match.group(1))] = nodes[0]
    return dict(sorted(mapping.items()))


def node_of_cpus(cpus: Iterable[int], cpu_nodes: Mapping[int, int]) -> int | None:
    """The node holding most of ``cpus`` (ties: the lowest node id); None when unknown."""
    counts = Counter(cpu_nodes[cpu] for cpu in cpus if cpu in cpu_nodes)
    if not counts:
        return None
    return min(counts, key=lambda node: (-counts[node], node))


def normalize_pci_bus_id(pci_bus_id: str) -> str:
    """``"00000000:1A:00.0"`` -> ``"0000:1a:00.0"``; ``"1a:00.0"`` -> ``"0000:1a:00.0"``."""
    text = pci_bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 2:
        parts = ["0000"] + parts
    if len(parts) != 3:
        return text
    domain, bus, devfn = parts
    try:
        domain = f"{int(domain, 16):04x}"
    except ValueError:
        return text
    return f"{domain}:{bus}:{devfn}"


def gpu_numa_node(pci_bus_id: str | None, sysfs_root: str = "/sys") -> int | None:
    """A PCI device's (GPU's) NUMA node from ``bus/pci/devices/<id>/numa_node``; None when unknown."""
    if not pci_bus_id:
        return None
    node = _read_int(os.path.join(sysfs_root, "bus", "pci", "devices", normalize_pci_bus_id(pci_bus_id), "numa_node"))
    return node if node is not None and node >= 0 else None


def _names(devices: Iterable[RdmaDevice]) -> str:
    return ",".join(d.name for d in devices) or "none"


def choose_nics(
    *,
    rdma_devices: Sequence[str] | None,
    numa_aware: bool,
    numa_node: int | None,
    devices: Sequence[RdmaDevice],
    affinity_cpus: Iterable[int] | None,
    cpu_nodes: Mapping[int, int],
    gpu_node: int | None,
) -> NicChoice:
    """Pick the NICs. Pure: every input is given.

    1. ``rdma_devices`` set: used as given (a warning names any not found).
    2. No ACTIVE NIC: an empty choice (the caller warns; nothing crashes).
    3. ``numa_aware`` off: every ACTIVE NIC.
    4. The node: ``numa_node`` if set; else the node holding most of the
       allowed CPUs, when the affinity mask is narrower than the machine (an
       unpinned process says nothing about where it runs); else the GPU's node.
    5. That node's ACTIVE NICs (UMA NICs, node -1, count as any node); if it
       has none, or the node is unknown, every ACTIVE NIC.
    """
    by_name = {d.name: d for d in devices}
    if rdma_devices:
        chosen = tuple(rdma_devices)
        missing = [name for name in chosen if name not in by_name]
        inactive = [name for name in chosen if name in by_name and not by_name[name].active]
        reason = f"rdma_devices set explicitly: {','.join(chosen)}"
        if missing:
            reason += f" (not found under class/infiniband: {','.join(missing)})"
            logger.warning("SiMM: rdma_devices names %s, not found under class/infiniband; used as given", missing)
        if inactive:
            reason += f" (no ACTIVE port: {','.join(inactive)})"
            logger.warning("SiMM: rdma_devices names %s, which have no ACTIVE port; used as given", inactive)
        nodes = {by_name[n].numa_node for n in chosen if n in by_name} - {_UNKNOWN_NODE}
        node = numa_node if numa_node is not None else (nodes.pop() if len(nodes) == 1 else None)
        return NicChoice(devices=chosen, numa_node=node, reason=reason)

    active = [d for d in devices if d.active]
    every = tuple(d.name for d in active)
    if not active:
        if devices:
            states = "; ".join(
                f"{d.name}: {','.join(sorted(set(d.port_states.values()))) or 'no ports'}" for d in devices
            )
            reason = f"no RDMA device with an ACTIVE port ({states})"
        else:
            reason = "no RDMA device found (class/infiniband is missing or empty: are the RDMA drivers loaded?)"
        return NicChoice(devices=(), numa_node=None, reason=reason)

    if not numa_aware:
        return NicChoice(every, None, f"numa_aware is off: every ACTIVE NIC ({_names(active)})")

    node: int | None = None
    evidence = ""
    if numa_node is not None:
        node, evidence = numa_node, f"numa_node={numa_node} set explicitly"
    else:
        allowed = sorted(set(affinity_cpus)) if affinity_cpus is not None else []
        known = [cpu for cpu in allowed if cpu in cpu_nodes]
        if known and set(known) != set(cpu_nodes):
            node = node_of_cpus(known, cpu_nodes)
            on_node = sum(1 for cpu in known if cpu_nodes[cpu] == node)
            evidence = f"CPU affinity: {on_node} of {len(known)} allowed CPUs on node {node}"
        elif gpu_node is not None:
            node, evidence = gpu_node, f"this rank's GPU is on node {gpu_node}"
            if known:
                evidence += " (the CPU affinity spans the whole machine)"

    if node is None:
        return NicChoice(every, None, "NUMA node unknown (no narrow CPU affinity, no GPU node): every ACTIVE NIC "
                         f"({_names(active)})")
    local = [d for d in active if d.numa_node in (node, _UNKNOWN_NODE)]
    if local:
        uma = " (UMA NICs count as any node)" if any(d.numa_node == _UNKNOWN_NODE for d in local) else ""
        return NicChoice(tuple(d.name for d in local), node,
                         f"{evidence}: ACTIVE NICs on node {node}: {_names(local)}{uma}")
    return NicChoice(every, node, f"{evidence}, but no ACTIVE NIC on node {node}: every ACTIVE NIC ({_names(active)})")


def select_nics(
    config: Any,
    *,
    sysfs_root: str = "/sys",
    affinity: Iterable[int] | None = None,
    gpu_pci_bus_id: str | None = None,
) -> NicChoice:
    """:func:`choose_nics` over what this machine says, for ``config``'s
    ``rdma_devices``, ``numa_aware`` and ``numa_node``; ``affinity`` defaults
    to ``os.sched_getaffinity(0)``."""
    if affinity is None:
        try:
            affinity = os.sched_getaffinity(0)
        except (AttributeError, OSError):  # not Linux
            affinity = None
    return choose_nics(
        rdma_devices=config.rdma_devices,
        numa_aware=config.numa_aware,
        numa_node=config.numa_node,
        devices=list_rdma_devices(sysfs_root),
        affinity_cpus=affinity,
        cpu_nodes=cpu_to_node(sysfs_root),
        gpu_node=gpu_numa_node(gpu_pci_bus_id, sysfs_root),
    )


def apply_nic_choice(choice: NicChoice, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``SICL_NET_DEVICES`` from ``choice``, unless the operator already
    set it (then a log note says where ours differs); the value in effect
    afterwards (None: unset, SiCL picks)."""
    env = os.environ if environ is None else environ
    existing = env.get(NET_DEVICES_ENV, "").strip()
    wanted = ",".join(choice.devices)
    if existing:
        if existing != wanted:
            logger.info(
                "SiMM: %s=%s set by the operator is kept (the NUMA-aware choice would be %r: %s)",
                NET_DEVICES_ENV,
                existing,
                wanted or "none",
                choice.reason,
            )
        return existing
    if not wanted:
        logger.warning("SiMM: %s; %s left unset", choice.reason, NET_DEVICES_ENV)
        return None
    env[NET_DEVICES_ENV] = wanted
    logger.info("SiMM: %s=%s (%s)", NET_DEVICES_ENV, wanted, choice.reason)
    return wanted


def current_gpu_pci_bus_id(local_rank: int | None = None) -> str | None:
    """PCI bus id (``0000:1a:00.0``) of CUDA device ``local_rank`` (None: the
    current device); None when torch or CUDA is missing. Never raises."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device() if local_rank is None else int(local_rank)
        if not 0 <= index < torch.cuda.device_count():
            return None
        props = torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)
        if isinstance(bus, str):
            return normalize_pci_bus_id(bus)
        if isinstance(bus, int):
            domain = int(getattr(props, "pci_domain_id", 0) or 0)
            device = int(getattr(props, "pci_device_id", 0) or 0)
            return f"{domain:04x}:{bus:02x}:{device:02x}.0"
        return None
    except Exception:  # a best-effort hint, never fatal
        logger.debug("SiMM: cannot read the GPU's PCI bus id", exc_info=True)
        return None
