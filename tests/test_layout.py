"""The package's floor plan: the wheel holds what an operator runs in
production, the backend core never imports an operator command, the wheel
never imports the instruments (``dev/``, package ``sglang_simm_dev``), the
store (``sglang_simm.local_store``) and the rest meet only at the store's
public modules (the seam: the four tests after ``STORE``), and no module
imports itself back through others.

Every ``import`` counts, module-level or inside a function (a lazy import
still ties two modules together), and so does ``importlib.import_module``
with a literal name. ``from pkg import name`` depends on ``pkg.name`` when
that is a module, else on ``pkg``. The one door from the core into the tools
is ``sglang_simm.__main__`` (``python -m sglang_simm``), like the console
script's entry point.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sglang_simm

PACKAGE = "sglang_simm"
TOOLS = f"{PACKAGE}.tools"
DOORS = {f"{PACKAGE}.__main__"}
ROOT = Path(sglang_simm.__file__).resolve().parent
#: The operator's commands, all the wheel holds besides the backend and the
#: store: every other instrument (demo, bench, CPU stand-ins, CPU servers,
#: tiny models, host pools, null client, compat probe) lives in dev/.
COMMANDS = {TOOLS, f"{TOOLS}.cli", f"{TOOLS}.doctor", f"{TOOLS}.doctor_server", f"{TOOLS}.store"}

#: The instruments: a project of its own in the repository, never in the wheel.
DEV_PACKAGE = "sglang_simm_dev"
REPO = Path(__file__).resolve().parents[1]
DEV_ROOT = REPO / "dev" / DEV_PACKAGE


def _modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(name: str, module: str, level: int) -> str:
    if not level:
        return name
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _ours(name: str) -> str | None:
    """The module of this package that ``name`` loads, or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"), filename=str(MODULES[module]))
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_ours(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node.module or "", module, node.level)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else _ours(target))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(_ours(node.args[0].value))
    found.discard(None)
    found.discard(module)
    return found  # type: ignore[return-value]


GRAPH = {module: imports_of(module) for module in MODULES}


def names_of_dev_package(path: Path) -> set[str]:
    """Where the module at ``path`` names the dev package: imports of it
    (at any level, lazily or by ``importlib.import_module``) and string
    constants naming it (``python -m sglang_simm_dev...``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = node.value.replace("-m ", " ").split()
        found.update(f"line {node.lineno}: {n}" for n in names
                     if n == DEV_PACKAGE or n.startswith(DEV_PACKAGE + "."))
    return found


def _is_tool(module: str) -> bool:
    return module == TOOLS or module.startswith(TOOLS + ".")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_walk_sees_the_package():
    assert {f"{PACKAGE}.backend", f"{PACKAGE}.binding", f"{PACKAGE}.local_store._kv", f"{TOOLS}.cli"} <= set(MODULES)
    assert f"{PACKAGE}.binding" in GRAPH[f"{PACKAGE}.backend"]
    assert f"{PACKAGE}.local_store._handle" in GRAPH[f"{PACKAGE}.local_store._kv"]
    assert f"{PACKAGE}.local_store" in GRAPH[f"{PACKAGE}.client"]  # by importlib, lazily


def test_the_core_imports_no_tool():
    leaks = {
        module: sorted(t for t in targets if _is_tool(t))
        for module, targets in GRAPH.items()
        if not _is_tool(module) and module not in DOORS
    }
    assert {m: t for m, t in leaks.items() if t} == {}


def test_the_wheel_never_imports_the_dev_package():
    leaks = {module: sorted(names_of_dev_package(path)) for module, path in MODULES.items()}
    assert {m: n for m, n in leaks.items() if n} == {}


def test_the_dev_package_scan_finds_every_way_of_naming_it(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sglang_simm_dev\n"
        "def f():\n"
        "    from sglang_simm_dev.bench import run_bench\n"
        "    import importlib; importlib.import_module('sglang_simm_dev.pools')\n"
        "    cmd = ['python', '-m', 'sglang_simm_dev.compat_probe']\n"
        "    ok = 'sglang-simm-dev demo; sglang_simm_devx'\n"
    )
    assert {n.split(": ")[1] for n in names_of_dev_package(probe)} == {
        "sglang_simm_dev", "sglang_simm_dev.bench", "sglang_simm_dev.pools", "sglang_simm_dev.compat_probe"}


def test_the_tools_are_the_operators_commands_only():
    assert {m for m in MODULES if _is_tool(m)} == COMMANDS


def test_the_instruments_are_a_project_of_their_own():
    dev = _modules(DEV_ROOT, DEV_PACKAGE)
    for instrument in ("cli", "bench", "demo", "server_demo", "sglang_server", "cpu_standins", "tiny_model",
                       "pools", "hybrid_pools", "nullkv", "compat_probe", "l3_counts"):
        assert f"{DEV_PACKAGE}.{instrument}" in dev
    assert (REPO / "dev" / "pyproject.toml").is_file()
    graph = {module: _imports_within(path, dev) - {module} for module, path in dev.items()}
    assert graph[f"{DEV_PACKAGE}.server_demo"] >= {f"{DEV_PACKAGE}.sglang_server", f"{DEV_PACKAGE}.tiny_model"}
    assert _cycles(graph) == []


def _imports_within(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that the module at ``path`` imports by
    absolute name (``from pkg import name``: ``pkg.name`` when a module, else ``pkg``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_ours_in(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else _ours_in(node.module, modules))
    found.discard(None)
    return found  # type: ignore[return-value]


def _ours_in(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_the_doors_into_the_tools_lead_to_the_command_line():
    for door in DOORS:
        assert {t for t in GRAPH[door] if _is_tool(t)} == {f"{TOOLS}.cli"}


#: The local store: a package of its own that implements ``simm.kv``.
STORE = f"{PACKAGE}.local_store"
#: Its public modules: the ``simm.kv`` surface (the package), the operator
#: surface and the store contract. Every other module of the store is
#: private (``_``-prefixed).
STORE_ADMIN, STORE_CONTRACT = f"{STORE}.admin", f"{STORE}.contract"
#: SiMM's codes, limits and key rule: the plugin's, which the store follows.
SIMM_RULES = f"{PACKAGE}.simm_rules"
#: What of the store each module of the backend core may import, and nothing
#: else of it (``client``: the package, by ``importlib.import_module`` as it
#: imports ``simm.kv``; ``config``: the store naming rule and its settings'
#: names; ``embedded``: the old name, an alias read until the next minor release).
CORE_REACHES_THE_STORE = {
    f"{PACKAGE}.client": {STORE},
    f"{PACKAGE}.config": {STORE_ADMIN},
    f"{PACKAGE}.events_publisher": {STORE_ADMIN},
    f"{PACKAGE}.embedded": {STORE},
}
#: What of the store the operator's commands may import.
TOOLS_REACH_THE_STORE = {STORE, STORE_ADMIN}


def _in_store(module: str) -> bool:
    return module == STORE or module.startswith(STORE + ".")


def _private_to_store(module: str) -> bool:
    return _in_store(module) and any(part.startswith("_") for part in module[len(STORE) + 1:].split("."))


def test_the_store_imports_nothing_of_the_backend():
    """(a) No module of the store imports a module of this package outside
    the store but SiMM's rules, which both follow."""
    leaks = {module: sorted(t for t in targets if not _in_store(t) and t not in (SIMM_RULES, PACKAGE))
             for module, targets in GRAPH.items() if _in_store(module)}
    assert {m: t for m, t in leaks.items() if t} == {}


def test_nothing_outside_the_store_imports_a_private_module_of_it():
    """(b) Outside the store, only its public modules are imported:
    the package, ``admin`` and ``contract``."""
    leaks = {module: sorted(t for t in targets if _private_to_store(t))
             for module, targets in GRAPH.items() if not _in_store(module)}
    assert {m: t for m, t in leaks.items() if t} == {}
    assert {m for m in MODULES if _in_store(m) and not _private_to_store(m)} == {STORE, STORE_ADMIN, STORE_CONTRACT}


def test_the_core_reaches_the_store_only_where_it_is_allowed_to():
    """(c) The backend core (every module but the store and the tools)
    reaches the store at exactly these places and nothing else of it
    (``CORE_REACHES_THE_STORE``):

    * ``sglang_simm.client`` -> ``sglang_simm.local_store``, by
      ``importlib.import_module`` as it loads ``simm.kv``, never imported
      outright;
    * ``sglang_simm.config`` -> ``sglang_simm.local_store.admin`` (the store
      naming rule, its settings' old and moved names);
    * ``sglang_simm.events_publisher`` -> ``sglang_simm.local_store.admin``
      (whether the store's directory is memory or a disk: the events' medium);
    * ``sglang_simm.embedded``, the old name, -> the package.

    The operator's commands (``sglang_simm.tools.*``) import
    ``sglang_simm.local_store`` and ``sglang_simm.local_store.admin`` only."""
    core = {module: {t for t in targets if _in_store(t)}
            for module, targets in GRAPH.items() if not _in_store(module) and not _is_tool(module)}
    assert {m: sorted(t - CORE_REACHES_THE_STORE.get(m, set())) for m, t in core.items()
            if t - CORE_REACHES_THE_STORE.get(m, set())} == {}
    tree = ast.parse(MODULES[f"{PACKAGE}.client"].read_text(encoding="utf-8"))
    outright = [node.lineno for node in ast.walk(tree)
                if isinstance(node, ast.Import) and any(_in_store(a.name) for a in node.names)
                or isinstance(node, ast.ImportFrom) and _in_store(node.module or "")]
    assert outright == [], "client.py imports the store outright: load it by name (importlib.import_module)"
    tools = {module: sorted(t for t in targets if _in_store(t) and t not in TOOLS_REACH_THE_STORE)
             for module, targets in GRAPH.items() if _is_tool(module)}
    assert {m: t for m, t in tools.items() if t} == {}


#: The instruments that work inside the store, and what of it each may
#: import beside its public modules: the wire protocol's own layers
#: (``server_backup``: a request, the copy, the COMMIT, each timed), the
#: GIL releases of the store's connection and copies (``backup_gil``), the
#: store's copy routine as the demo's memcpy reference (``demo.reference``),
#: and the faulty network in front of the store's handle (``faults``).
INSTRUMENTS_OF_THE_STORES_INSIDES = {
    f"{DEV_PACKAGE}.bench.server_backup": {f"{STORE}._maps", f"{STORE}._protocol"},
    f"{DEV_PACKAGE}.bench.backup_gil": {f"{STORE}._copy", f"{STORE}._handle"},
    f"{DEV_PACKAGE}.demo.reference": {f"{STORE}._copy"},
    f"{DEV_PACKAGE}.faults": {f"{STORE}._copy", f"{STORE}._handle", f"{STORE}._kv"},
}


def test_the_instruments_reach_the_store_through_its_public_modules():
    """(d) The instruments (``dev/``) use the store as the backend and the
    operator do, through its public modules, but where they measure its
    insides (``INSTRUMENTS_OF_THE_STORES_INSIDES``)."""
    dev = _modules(DEV_ROOT, DEV_PACKAGE)
    reach = {module: {t for t in _imports_within(path, MODULES) if _private_to_store(t)}
             for module, path in dev.items()}
    leaks = {m: sorted(t - INSTRUMENTS_OF_THE_STORES_INSIDES.get(m, set())) for m, t in reach.items()}
    assert {m: t for m, t in leaks.items() if t} == {}
    assert {m: sorted(t) for m, t in reach.items() if t} == {
        m: sorted(t) for m, t in INSTRUMENTS_OF_THE_STORES_INSIDES.items()}  # every exception still needed


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


#: The one inventory of the project's modules: one table per folder, each row a module (``x.py``) or a
#: subpackage (``x/``), after a line ``Layout of `FOLDER/` ``.
MODULES_DOC = "docs/architecture.md"


def _inventory() -> dict[str, set[str]]:
    doc = (REPO / MODULES_DOC).read_text(encoding="utf-8")
    tables: dict[str, set[str]] = {}
    for chunk in doc.split("\nLayout of `")[1:]:
        folder = chunk[: chunk.index("`")].rstrip("/")
        rows = []
        for line in chunk.splitlines()[1:]:
            if line.startswith("|"):
                rows.append(line)
            elif rows:
                break
        tables[folder] = {line.split("|")[1].strip().strip("`") for line in rows if line.startswith("| `")}
    return tables


def _folder(path: Path) -> set[str]:
    return ({p.name for p in path.glob("*.py")}
            | {p.name + "/" for p in path.iterdir() if p.is_dir() and (p / "__init__.py").is_file()})


def test_the_architecture_page_names_every_module_and_only_those():
    tables = _inventory()
    folders = [p for root in (REPO / "src" / PACKAGE, DEV_ROOT) for p in [root, *root.rglob("*")]
               if p.is_dir() and (p / "__init__.py").is_file()]
    for path in folders:
        folder = path.relative_to(REPO).as_posix()
        assert folder in tables, f"{MODULES_DOC} has no 'Layout of `{folder}/`' table"
        assert sorted(tables[folder] - _folder(path)) == [], f"{folder}: rows for modules that do not exist"
        assert sorted(_folder(path) - tables[folder]) == [], f"{folder}: modules without a row"
    assert sorted(set(tables) - {p.relative_to(REPO).as_posix() for p in folders}) == []
