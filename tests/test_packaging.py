"""Packaging and discovery: cheap import, the wheel's contents, SGLang's own
plugin loader and storage factory resolving ``simm`` to this package."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_py(code: str, python: str = sys.executable) -> str:
    out = subprocess.run([python, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("module", ["sglang_simm", "sglang_simm.plugin", "sglang_simm.config", "sglang_simm.tools.cli"])
def test_import_pulls_in_neither_sglang_nor_torch(module):
    code = (
        f"import sys, json, {module}\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang', 'numpy'))\n"
        "print(json.dumps(heavy))"
    )
    assert json.loads(run_py(code)) == []


def test_backend_class_resolves_lazily_from_the_package_root():
    import sglang_simm
    from sglang_simm.backend import HiCacheSiMM

    assert sglang_simm.HiCacheSiMM is HiCacheSiMM
    assert "HiCacheSiMM" in dir(sglang_simm)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        sglang_simm.nope  # noqa: B018


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    import os

    if os.environ.get("SGLANG_SIMM_WHEEL"):  # scripts/test.sh built and installed it
        return Path(os.environ["SGLANG_SIMM_WHEEL"])
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=600,
    )
    (built,) = out.glob("sglang_simm-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_the_package_typing_marker_and_entry_points(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        eps = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = zf.read(eps).decode()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for required in ("sglang_simm/__init__.py", "sglang_simm/backend.py", "sglang_simm/plugin.py",
                     "sglang_simm/local_store/__init__.py", "sglang_simm/py.typed"):
        assert required in names
    assert "[sglang.srt.plugins]\nsimm = sglang_simm.plugin:register" in entry_points
    assert "sglang-simm = sglang_simm.tools.cli:main" in entry_points
    # SGLang only as an extra, never the unrelated PyPI 'simm'
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any("sglang" in r and "extra == 'sglang'" in r for r in requires)
    assert not any(r.split()[1].lower() == "simm" for r in requires)
    assert not any(r.split()[1].lower() == "sglang" and "extra" not in r for r in requires)


#: What the wheel holds besides the backend and the store: the operator's commands.
OPERATOR_TOOLS = {"__init__.py", "cli.py", "doctor.py", "doctor_server.py", "store.py"}
#: The instruments, which live in the repository's dev/ (package sglang_simm_dev).
INSTRUMENTS = ("bench", "demo", "server_demo", "sglang_server", "cpu_standins", "tiny_model", "compat_probe",
               "nullkv", "pools", "hybrid_pools", "l3_counts", "sitecustomize", "sglang_simm_dev")


@pytest.mark.slow
def test_the_wheel_holds_no_instrument(wheel):
    """The wheel is what an operator runs in production: the backend, the
    store, the sglang-simm command (doctor, store). No demo, bench, CPU
    stand-in or server launcher, no .pth file, nothing of dev/."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if ".dist-info/" not in n]
        entry_points = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert names and all(n.startswith("sglang_simm/") for n in names), names
    tools = {n.split("/", 2)[2] for n in names if n.startswith("sglang_simm/tools/")}
    assert tools == OPERATOR_TOOLS
    stems = {part.removesuffix(".py") for n in names for part in n.split("/")}
    assert stems.isdisjoint(INSTRUMENTS), sorted(stems & set(INSTRUMENTS))
    assert not any(n.endswith(".pth") for n in names)
    assert "sglang-simm-dev" not in entry_points  # the instruments' command is dev/'s


def test_sglang_load_plugins_points_simm_at_this_package():
    pytest.importorskip("sglang.srt.plugins", reason="entry-point plugins exist from SGLang 0.5.11")
    code = (
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins(); load_plugins()\n"
        "from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory as F\n"
        "e = F._registry['simm']\n"
        "cls = e['loader']()\n"
        "print(e['module_path'], e['class_name'], cls.__module__)"
    )
    assert run_py(code) == "sglang_simm HiCacheSiMM sglang_simm.backend"


def test_the_suite_runs_the_installed_wheel_when_scripts_test_sh_built_it():
    import os

    import sglang_simm

    if not os.environ.get("SGLANG_SIMM_WHEEL"):
        pytest.skip("run through scripts/test.sh, which installs the built wheel")
    assert "site-packages" in sglang_simm.__file__


def test_register_is_idempotent_and_quiet_when_sglang_is_missing(monkeypatch):
    from sglang_simm import plugin

    assert plugin.register() is True
    assert plugin.register() is True
    import builtins

    real_import = builtins.__import__

    def no_sglang(name, *a, **k):
        if name.startswith("sglang.") or name == "sglang":
            raise ImportError("no SGLang here")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_sglang)
    assert plugin.register() is False


def test_cli_entry_points_run():
    out = subprocess.run([sys.executable, "-m", "sglang_simm", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("sglang-simm ")


def test_pytest_benchmarks_without_its_plugin_stops_with_the_install_line():
    # -p no:benchmark: as if pytest-benchmark were not installed (it may be)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "-p", "no:benchmark", "-p", "no:cacheprovider", "--co", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout + out.stderr
    assert "pip install -e './dev[bench]'" in out.stderr and "pytest benchmarks" in out.stderr


def test_the_bench_extra_brings_what_pytest_benchmarks_needs():
    import tomllib

    dev = tomllib.loads((ROOT / "dev" / "pyproject.toml").read_text())["project"]
    names = {req.split(">")[0].split("=")[0].split(";")[0].split("[")[0].strip()
             for req in [*dev["dependencies"], *dev["optional-dependencies"]["bench"]]}
    assert {"pytest-benchmark", "pytest", "matplotlib", "sglang-simm"} <= names
    assert "[cli]" in next(r for r in dev["dependencies"] if r.startswith("sglang-simm"))  # rich


def test_the_readme_install_commands_can_work_before_the_package_is_published():
    """Every install command the README shows (wherever it shows them) can
    run today: from a clone or a built wheel of this version, naming only
    extras that exist; never ``sglang-simm`` from the index, where it is not
    published yet. What the prose around them says is the README's own."""
    import re
    import tomllib

    readme = (ROOT / "README.md").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    dev_extras = set(tomllib.loads((ROOT / "dev" / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    # every fenced block, paired fence by fence (a ```text block's closing fence opens none)
    blocks = [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", readme, re.S) if lang in ("", "bash", "sh", "console")]
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    installs = [c for c in commands if c.startswith("pip install")]
    assert installs, "the README shows no install command"
    from sglang_simm import __version__

    for c in installs:
        assert not re.search(r"(?<![\w./-])sglang-simm(\[|\s|$|')", c), f"not on the index yet: {c}"
        for wheel in re.findall(r"dist/(sglang_simm-[^'\s\[]+\.whl)", c):
            assert wheel == f"sglang_simm-{__version__}-py3-none-any.whl", c
        for target, group in re.findall(r"([\w./-]*)\[([a-z,]+)\]", c):  # every extra named exists
            assert set(group.split(",")) <= (dev_extras if target.rstrip("/").endswith("dev") else extras), c
    # CPU torch first: installed after, plain torch is a multi-GB CUDA build
    ours = next(i for i, c in enumerate(installs) if re.search(r"'(\.|dist/)", c))
    torch = [i for i, c in enumerate(installs) if re.match(r"pip install torch\b", c)]
    assert torch and torch[0] < ours and "download.pytorch.org/whl/cpu" in installs[torch[0]]


def test_the_cli_extra_brings_what_the_config_file_forms_need():
    # --extra-config @cfg.yaml needs PyYAML; the cli extra once left it out
    import tomllib

    from sglang_simm.tools.cli import FILE_FORMATS

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {req.split(">")[0].split("=")[0].split(";")[0].strip().lower() for req in extras["cli"]}
    assert ".yaml" in FILE_FORMATS and "pyyaml" in names
    assert "tomli" in names  # .toml on Python 3.10


def test_the_fast_tier_leaves_out_every_marker_that_starts_processes_of_its_own():
    import ast
    import re
    import tomllib

    # tests/suite.py's TIERS, read as a literal (the suite's plugin, loaded by
    # the conftests of tests/ and dev/tests)
    tree = ast.parse((ROOT / "tests" / "suite.py").read_text())
    TIERS = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TIERS")

    declared = {m.split(":")[0] for m in tomllib.loads((ROOT / "pyproject.toml").read_text())
                ["tool"]["pytest"]["ini_options"]["markers"]}
    fast = re.search(r'^FAST_MARKERS="(.*)"$', (ROOT / "scripts" / "test.sh").read_text(), re.M).group(1)
    left_out = set(re.findall(r"not (\w+)", fast))
    assert set(TIERS.values()) <= declared  # every marker given by file is declared
    assert {"e2e", "host", "server", "slow", "real"} == left_out <= declared
    assert "local_store" not in left_out  # the in-process contract tests stay in


def test_the_suite_collects_every_test_file_and_its_tiers_and_order_name_files_that_exist():
    # A test file outside the testpaths (the instruments' own tests are
    # dev/tests) would never run; a file TIERS or FIRST names that has moved
    # would lose its tier or its place without a word.
    import ast
    import tomllib

    testpaths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    files = [p.relative_to(ROOT) for tree in ("tests", "dev") for p in (ROOT / tree).rglob("test_*.py")]
    assert {"tests", "dev/tests"} <= set(testpaths)
    assert [f for f in files if not any(f.is_relative_to(path) for path in testpaths)] == []

    tree = ast.parse((ROOT / "tests" / "suite.py").read_text())
    named = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
             if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in ("TIERS", "FIRST")}
    assert [where for where in [*named["TIERS"], *named["FIRST"]] if not (ROOT / where).exists()] == []
