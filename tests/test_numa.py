"""NIC selection over fake sysfs trees built under tmp_path."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from sglang_simm.config import SiMMConfig
from sglang_simm.numa import (
    NET_DEVICES_ENV,
    NicChoice,
    RdmaDevice,
    apply_nic_choice,
    choose_nics,
    cpu_to_node,
    current_gpu_pci_bus_id,
    gpu_numa_node,
    list_rdma_devices,
    node_of_cpus,
    normalize_pci_bus_id,
    select_nics,
)

GPU0 = "0000:1a:00.0"
GPU1 = "0000:9b:00.0"


def make_sysfs(
    root: Path,
    *,
    nics: dict[str, tuple[int | None, dict[int, str]]] | None = None,
    cpus: dict[int, int] | None = None,
    pci: dict[str, int] | None = None,
) -> str:
    """Build a fake /sys: ``nics`` name -> (numa_node or None for no file, {port: state}),
    ``cpus`` cpu -> node, ``pci`` bus id -> node. ``nics=None`` leaves out class/infiniband."""
    if nics is not None:
        ib = root / "class" / "infiniband"
        ib.mkdir(parents=True)
        for name, (node, ports) in nics.items():
            dev = ib / name
            (dev / "device").mkdir(parents=True)
            if node is not None:
                (dev / "device" / "numa_node").write_text(f"{node}\n")
            for port, state in ports.items():
                (dev / "ports" / str(port)).mkdir(parents=True)
                code = {"ACTIVE": 4, "DOWN": 1, "INIT": 2}.get(state, 0)
                (dev / "ports" / str(port) / "state").write_text(f"{code}: {state}\n")
    for cpu, node in (cpus or {}).items():
        cpu_dir = root / "devices" / "system" / "cpu" / f"cpu{cpu}"
        cpu_dir.mkdir(parents=True)
        (cpu_dir / f"node{node}").mkdir()  # a symlink on a real system; a dir will do
        (cpu_dir / "topology").mkdir()
    if cpus:
        (root / "devices" / "system" / "cpu" / "cpufreq").mkdir()  # a non-cpu entry
    for bus_id, node in (pci or {}).items():
        dev = root / "bus" / "pci" / "devices" / bus_id
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(f"{node}\n")
    return str(root)


ACTIVE = {1: "ACTIVE"}
DOWN = {1: "DOWN"}
TWO_NODES = {cpu: (0 if cpu < 4 else 1) for cpu in range(8)}


@dataclass
class Cfg:
    rdma_devices: tuple[str, ...] | None = None
    numa_aware: bool = True
    numa_node: int | None = None


# --------------------------------------------------------------------------
# sysfs readers
# --------------------------------------------------------------------------


def test_list_rdma_devices_reads_nodes_and_ports(tmp_path):
    root = make_sysfs(
        tmp_path,
        nics={
            "mlx5_10": (1, {1: "ACTIVE", 2: "DOWN"}),
            "mlx5_2": (0, DOWN),
            "mlx5_3": (None, ACTIVE),
            "mlx5_4": (-1, {}),
        },
    )
    devices = list_rdma_devices(root)
    assert [d.name for d in devices] == ["mlx5_2", "mlx5_3", "mlx5_4", "mlx5_10"]  # natural order
    by = {d.name: d for d in devices}
    assert by["mlx5_10"].port_states == {1: "ACTIVE", 2: "DOWN"} and by["mlx5_10"].active
    assert by["mlx5_10"].numa_node == 1
    assert not by["mlx5_2"].active
    assert by["mlx5_3"].numa_node == -1  # no numa_node file: unknown
    assert by["mlx5_4"].numa_node == -1 and not by["mlx5_4"].active


def test_list_rdma_devices_without_infiniband(tmp_path):
    assert list_rdma_devices(str(tmp_path)) == []
    assert list_rdma_devices(str(tmp_path / "does-not-exist")) == []


def test_cpu_to_node(tmp_path):
    root = make_sysfs(tmp_path, cpus={0: 0, 1: 0, 2: 1, 10: 1})
    assert cpu_to_node(root) == {0: 0, 1: 0, 2: 1, 10: 1}
    assert cpu_to_node(str(tmp_path / "empty")) == {}


@pytest.mark.parametrize(
    ("cpus", "expected"),
    [
        ([0, 1], 0),
        ([4, 5, 6], 1),
        ([0, 4, 5], 1),  # majority
        ([3, 4], 0),  # tie: lowest node
        ([2, 3, 4, 5], 0),  # tie: lowest node
        ([], None),
        ([99], None),  # unknown CPUs
    ],
    ids=["node0", "node1", "majority-node1", "tie-2-cpus", "tie-4-cpus", "empty", "unknown-cpu"],
)
def test_node_of_cpus(cpus, expected):
    assert node_of_cpus(cpus, TWO_NODES) == expected


@pytest.mark.parametrize(
    ("given", "normal"),
    [
        ("00000000:1A:00.0", "0000:1a:00.0"),
        ("0000:1a:00.0", "0000:1a:00.0"),
        ("1A:00.0", "0000:1a:00.0"),
        ("00000001:9B:00.0", "0001:9b:00.0"),
    ],
    ids=["nvml-8-digit-domain", "sysfs-form", "no-domain", "domain-1"],
)
def test_normalize_pci_bus_id(given, normal):
    assert normalize_pci_bus_id(given) == normal


def test_gpu_numa_node(tmp_path):
    root = make_sysfs(tmp_path, pci={GPU0: 0, GPU1: 1, "0000:3b:00.0": -1})
    assert gpu_numa_node("00000000:9B:00.0", root) == 1
    assert gpu_numa_node(GPU0, root) == 0
    assert gpu_numa_node("0000:3b:00.0", root) is None  # -1
    assert gpu_numa_node("0000:ff:00.0", root) is None  # absent
    assert gpu_numa_node(None, root) is None


# --------------------------------------------------------------------------
# NIC choice on whole machines
# --------------------------------------------------------------------------

SCENARIOS = [
    # id, nics, cpus, affinity, gpu pci -> node, config, expected devices, expected node
    (
        "single-node",
        {"mlx5_0": (0, ACTIVE), "mlx5_1": (0, ACTIVE)},
        {0: 0, 1: 0},
        {0, 1},
        None,
        Cfg(),
        ("mlx5_0", "mlx5_1"),
        None,  # the mask spans the whole (one-node) machine and there is no GPU
    ),
    (
        "two-nodes-affinity-node0",
        {"mlx5_0": (0, ACTIVE), "mlx5_1": (1, ACTIVE)},
        TWO_NODES,
        {0, 1, 2, 3},
        None,
        Cfg(),
        ("mlx5_0",),
        0,
    ),
    (
        "two-nodes-affinity-node1",
        {"mlx5_0": (0, ACTIVE), "mlx5_1": (1, ACTIVE)},
        TWO_NODES,
        {4, 5, 6, 7},
        None,
        Cfg(),
        ("mlx5_1",),
        1,
    ),
    (
        "affinity-spans-nodes-majority",
        {"mlx5_0": (0, ACTIVE), "mlx5_1": (1, ACTIVE)},
        TWO_NODES,
        {3, 4, 5},
        None,
        Cfg(),
        ("mlx5_1",),
        1,
    ),
    (
        "affinity-spans-nodes-tie-lowest",
        {"mlx5_0": (0, ACTIVE), "mlx5_1": (1, ACTIVE)},
        TWO_NODES,
        {2, 3, 4, 5},
        {GPU1: 1},
        Cfg(),
        ("mlx5_0",),
        0,
    ),
    (
        "uma-nics-any-node",
        {"mlx5_0": (-1, ACTIVE), "mlx5_1": (-1, ACTIVE)},
        TWO_NODES,
        {4, 5},
        None,
        Cfg(),
        ("mlx5_0", "mlx5_1"),
        1,
    ),
    (
        "down-port-skipped",
        {"mlx5_0": (1, DOWN), "mlx5_1": (1, ACTIVE), "mlx5_2": (0, ACTIVE)},
        TWO_NODES,
        {4, 5},
        None,
        Cfg(),
        ("mlx5_1",),
        1,
    ),
    (
        "node-without-active-nic-falls-back-to-all",
        {"mlx5_0": (0, ACTIVE), "mlx5_1": (1, DOWN), "mlx5_2": (0, ACTIVE)},
        TWO_NODES,
        {4, 5},
        None,
        Cfg(),
        ("mlx5_0", "mlx5_2"),
        1,
    ),
    (
        "gpu-node-when-affinity-is-whole-machine",
        {"mlx5_0": (0, ACTIVE), "mlx5_1": (1, ACTIVE)},
        TWO_NODES,
        set(range(8)),
        {GPU1: 1},
        Cfg(),
        ("mlx5_1",),
        1,
    ),
    (
        "gpu-node-when-cpu-topology-unknown",
        {"mlx5_0": (0, ACTIVE), "mlx5_1": (1, ACTIVE)},
        {},
        {0, 1},
        {GPU0: 0},
        Cfg(),
        ("mlx5_0",),
        0,
    ),
    (
        "explicit-numa-node-beats-affinity",
        {"mlx5_0": (0, ACTIVE), "mlx5_1": (1, ACTIVE)},
        TWO_NODES,
        {0, 1},
        None,
        Cfg(numa_node=1),
        ("mlx5_1",),
        1,
    ),
    (
        "explicit-devices-override",
        {"mlx5_0": (0, ACTIVE), "mlx5_1": (1, ACTIVE)},
        TWO_NODES,
        {0, 1},
        None,
        Cfg(rdma_devices=("mlx5_1", "mlx5_9")),
        ("mlx5_1", "mlx5_9"),
        1,
    ),
    (
        "numa-aware-off-all-active",
        {"mlx5_0": (0, ACTIVE), "mlx5_1": (1, ACTIVE), "mlx5_2": (1, DOWN)},
        TWO_NODES,
        {0, 1},
        None,
        Cfg(numa_aware=False),
        ("mlx5_0", "mlx5_1"),
        None,
    ),
    (
        "all-ports-down",
        {"mlx5_0": (0, DOWN)},
        TWO_NODES,
        {0},
        None,
        Cfg(),
        (),
        None,
    ),
    (
        "no-rdma-at-all",
        None,
        TWO_NODES,
        {0},
        {GPU0: 0},
        Cfg(),
        (),
        None,
    ),
]


@pytest.mark.parametrize(
    ("nics", "cpus", "affinity", "pci", "cfg", "devices", "node"),
    [s[1:] for s in SCENARIOS],
    ids=[s[0] for s in SCENARIOS],
)
def test_select_nics(tmp_path, nics, cpus, affinity, pci, cfg, devices, node):
    root = make_sysfs(tmp_path, nics=nics, cpus=cpus, pci=pci)
    gpu = next(iter(pci)) if pci else None
    choice = select_nics(cfg, sysfs_root=root, affinity=affinity, gpu_pci_bus_id=gpu)
    assert isinstance(choice, NicChoice)
    assert choice.devices == devices
    assert choice.numa_node == node
    assert choice.reason


def test_reasons_are_readable(tmp_path):
    root = make_sysfs(tmp_path, nics={"mlx5_0": (0, ACTIVE), "mlx5_1": (1, ACTIVE)}, cpus=TWO_NODES)
    choice = select_nics(Cfg(), sysfs_root=root, affinity={4, 5, 6})
    assert "3 of 3 allowed CPUs on node 1" in choice.reason and "mlx5_1" in choice.reason
    assert "no RDMA device found" in select_nics(Cfg(), sysfs_root=str(tmp_path / "none"), affinity={0}).reason


def test_explicit_override_warns_on_unknown_device(tmp_path, caplog):
    root = make_sysfs(tmp_path, nics={"mlx5_0": (0, ACTIVE)}, cpus=TWO_NODES)
    with caplog.at_level("WARNING", logger="sglang_simm.numa"):
        choice = select_nics(Cfg(rdma_devices=("mlx5_7",)), sysfs_root=root, affinity={0})
    assert choice.devices == ("mlx5_7",)
    assert "mlx5_7" in choice.reason and "not found" in choice.reason
    assert any("mlx5_7" in r.getMessage() for r in caplog.records)


def test_select_nics_takes_a_real_config(tmp_path):
    root = make_sysfs(tmp_path, nics={"mlx5_0": (0, ACTIVE), "mlx5_1": (1, ACTIVE)}, cpus=TWO_NODES)
    cfg = SiMMConfig(manager_address="local", numa_node=1)
    assert select_nics(cfg, sysfs_root=root).devices == ("mlx5_1",)


def test_select_nics_default_affinity_does_not_crash(tmp_path):
    root = make_sysfs(tmp_path, nics={"mlx5_0": (0, ACTIVE)}, cpus={0: 0})
    assert select_nics(Cfg(), sysfs_root=root).devices == ("mlx5_0",)


def test_choose_nics_is_pure():
    devices = [RdmaDevice("a", 0, {1: "ACTIVE"}), RdmaDevice("b", 1, {1: "ACTIVE"})]
    choice = choose_nics(
        rdma_devices=None,
        numa_aware=True,
        numa_node=None,
        devices=devices,
        affinity_cpus=None,
        cpu_nodes={},
        gpu_node=1,
    )
    assert choice == NicChoice(devices=("b",), numa_node=1, reason=choice.reason)
    assert "GPU is on node 1" in choice.reason


# --------------------------------------------------------------------------
# SICL_NET_DEVICES
# --------------------------------------------------------------------------


def test_apply_sets_env():
    env: dict[str, str] = {}
    assert apply_nic_choice(NicChoice(("mlx5_0", "mlx5_1"), 0, "test"), env) == "mlx5_0,mlx5_1"
    assert env[NET_DEVICES_ENV] == "mlx5_0,mlx5_1"


def test_apply_respects_operator_value(caplog):
    env = {NET_DEVICES_ENV: "mlx5_5"}
    with caplog.at_level("INFO", logger="sglang_simm.numa"):
        assert apply_nic_choice(NicChoice(("mlx5_0",), 0, "test"), env) == "mlx5_5"
    assert env[NET_DEVICES_ENV] == "mlx5_5"
    assert any("kept" in r.getMessage() and "mlx5_0" in r.getMessage() for r in caplog.records)


def test_apply_empty_choice_leaves_env_unset(caplog):
    env: dict[str, str] = {}
    with caplog.at_level("WARNING", logger="sglang_simm.numa"):
        assert apply_nic_choice(NicChoice((), None, "no RDMA device found"), env) is None
    assert NET_DEVICES_ENV not in env
    assert any("no RDMA device found" in r.getMessage() for r in caplog.records)


def test_apply_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv(NET_DEVICES_ENV, "placeholder")  # so the undo restores the original
    monkeypatch.delenv(NET_DEVICES_ENV)
    assert apply_nic_choice(NicChoice(("mlx5_3",), None, "test")) == "mlx5_3"
    assert os.environ[NET_DEVICES_ENV] == "mlx5_3"


def test_current_gpu_pci_bus_id_never_raises():
    assert current_gpu_pci_bus_id(0) is None or isinstance(current_gpu_pci_bus_id(0), str)
    assert current_gpu_pci_bus_id(10_000) is None
