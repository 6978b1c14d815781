"""The package's floor plan: the backend core never imports an operator tool,
and no module imports itself back through others.

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


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([PACKAGE, *parts])] = path
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
    assert {f"{PACKAGE}.backend", f"{PACKAGE}.binding", f"{PACKAGE}.embedded._client", f"{TOOLS}.cli"} <= set(MODULES)
    assert f"{PACKAGE}.binding" in GRAPH[f"{PACKAGE}.backend"]
    assert f"{PACKAGE}.embedded._server" in GRAPH[f"{PACKAGE}.embedded._client"]
    assert f"{PACKAGE}.embedded" in GRAPH[f"{PACKAGE}.client"]  # by importlib, lazily


def test_the_core_imports_no_tool():
    leaks = {
        module: sorted(t for t in targets if _is_tool(t))
        for module, targets in GRAPH.items()
        if not _is_tool(module) and module not in DOORS
    }
    assert {m: t for m, t in leaks.items() if t} == {}


def test_the_doors_into_the_tools_lead_to_the_command_line():
    for door in DOORS:
        assert {t for t in GRAPH[door] if _is_tool(t)} == {f"{TOOLS}.cli"}


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


#: The backend's parts are tabled in their own page, which the README links.
BACKEND_MODULES_DOC = "docs/backend-core.md"


def test_the_readme_layout_names_every_module():
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("Layout of `src/sglang_simm/`"):]
    section = section[: section.index("\n## ")]
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| `")}
    backend_doc = (root / BACKEND_MODULES_DOC).read_text(encoding="utf-8")
    for line in backend_doc.splitlines():
        if line.startswith("| `") and line.split("|")[1].strip() not in rows:
            rows[line.split("|")[1].strip()] = line
    missing = []
    for module, path in MODULES.items():
        rel = path.relative_to(ROOT).as_posix()
        parts = rel.split("/")
        if len(parts) == 1 or (parts[0] == "tools" and len(parts) == 2):
            if rel != "tools/__init__.py" and f"`{rel}`" not in rows:
                missing.append(rel)
        else:  # a subpackage: its row names it, and a tool package's row names its modules
            folder = "/".join(parts[:-1]) + "/"
            row = rows.get(f"`{folder}`")
            if row is None:
                missing.append(folder)
            elif folder.startswith("tools/") and parts[-1] != "__init__.py" and f"`{parts[-1]}`" not in row:
                missing.append(rel)
    assert sorted(set(missing)) == []
