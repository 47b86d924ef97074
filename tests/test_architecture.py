"""The package's layering, checked from the source (every import statement, also those inside
functions) and from what importing a module actually pulls in:

- the measurement core (`mlxproxy/core/`) imports only the standard library's pure modules and
  orjson: no I/O library (aiohttp, httpx, asyncio, sockets, ...), no clock, and no other
  `mlxproxy` package;
- the simulator (`mlxproxy/sim/`) imports nothing from the proxy (`mlxproxy.proxy`);
- the proxy and the simulator import nothing from load testing (`mlxproxy/load/`), and of load
  testing only the demo (which wires simulators behind a proxy) imports the proxy or the simulator;
- the whole package's imports form a tree (no cycle);
- no module of the package takes a private name (`_name`) from another.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mlxproxy

PACKAGE = Path(mlxproxy.__file__).parent

# What the core may import: pure standard-library modules and orjson (bytes <-> values).
CORE_ALLOWED = {
    "__future__",
    "array",
    "collections",
    "copy",
    "dataclasses",
    "enum",
    "functools",
    "hashlib",
    "heapq",
    "itertools",
    "json",
    "math",
    "operator",
    "orjson",
    "re",
    "statistics",
    "typing",
    "bisect",
}
# What importing the core must never pull in, directly or through another module.
IO_MODULES = {
    "aiohttp",
    "asyncio",
    "h11",
    "httptools",
    "httpx",
    "prometheus_client",
    "selectors",
    "socket",
    "ssl",
    "starlette",
    "subprocess",
    "threading",
    "time",
    "urllib3",
    "uvicorn",
    "uvloop",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(subpackage: str) -> dict[str, Path]:
    return {module_name(p): p for p in sorted((PACKAGE / subpackage).glob("*.py"))}


def imports_of(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every import statement in the file."""
    out: list[tuple[str, str | None, int]] = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(target, a.name, node.lineno) for a in node.names]
    return out


def internal_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which of `modules` each one imports (`from pkg import mod` counts as importing `pkg.mod`)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for target, name, _ in imports_of(m, path):
            full = f"{target}.{name}" if name and f"{target}.{name}" in modules else target
            if full in modules and full != m:
                edges[m].add(full)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    trail: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        trail.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return trail[trail.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        trail.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def newly_imported(modules: list[str]) -> set[str]:
    """Every module that importing `modules` in a fresh interpreter adds to `sys.modules`."""
    code = (
        "import sys, json, importlib; before = set(sys.modules)\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out))


def test_core_imports_only_pure_modules_and_no_other_mlxproxy_package() -> None:
    core = modules_of("core")
    assert "mlxproxy.core.meter" in core and "mlxproxy.core.sse" in core  # the walk sees the core
    bad = []
    for m, path in core.items():
        for target, _, line in imports_of(m, path):
            top = target.split(".")[0]
            if top == "mlxproxy":
                if not (target == "mlxproxy.core" or target.startswith("mlxproxy.core.")):
                    bad.append(f"{path.name}:{line} imports {target}")
            elif top not in CORE_ALLOWED:
                bad.append(f"{path.name}:{line} imports {target}")
    assert bad == []


def test_importing_the_core_pulls_in_no_io_library() -> None:
    new = newly_imported(sorted(modules_of("core")))
    assert "mlxproxy.core.analyze" in new  # the check ran on the whole core
    tops = {m.split(".")[0] for m in new}
    assert sorted(tops & IO_MODULES) == []
    others = sorted(m for m in new if m.startswith("mlxproxy.") and not m.startswith("mlxproxy.core"))
    assert others == []


def test_sim_imports_nothing_from_the_proxy() -> None:
    sim = modules_of("sim")
    assert "mlxproxy.sim.app" in sim and "mlxproxy.sim.cli" in sim
    bad = [
        f"{path.name}:{line} imports {target}"
        for m, path in sim.items()
        for target, _, line in imports_of(m, path)
        if target == "mlxproxy.proxy" or target.startswith("mlxproxy.proxy.")
    ]
    assert bad == []


def test_importing_the_simulator_pulls_in_no_proxy_module() -> None:
    # The command module is left out: it starts servers through mlxproxy.runner, whose server edge
    # (the bounded HTTP protocols) lives in mlxproxy/proxy/limits.py for now.
    pure = sorted(m for m in modules_of("sim") if m != "mlxproxy.sim.cli")
    new = newly_imported(pure)
    assert "mlxproxy.sim.app" in new and "mlxproxy.sim.styles" in new
    assert sorted(m for m in new if m.startswith("mlxproxy.proxy")) == []


@pytest.mark.parametrize("subpackage", ["core", "sim", "proxy", "load"])
def test_no_import_cycle(subpackage: str) -> None:
    # Imports inside functions count: a cycle hidden in a function is still a cycle.
    edges = internal_edges(modules_of(subpackage))
    assert any(edges.values())  # the graph was read
    assert find_cycle(edges) is None, find_cycle(edges)


def test_no_import_cycle_in_the_whole_package() -> None:
    edges = internal_edges({module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))})
    assert "mlxproxy.load.bench_cli" in edges["mlxproxy.cli"]  # the graph spans the subpackages
    assert find_cycle(edges) is None, find_cycle(edges)


def test_the_layers_import_only_downwards() -> None:
    """proxy and sim know nothing of load testing; load testing reaches the proxy and the
    simulator only in the demo, which runs them together."""
    modules = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    assert "mlxproxy.load.client" in modules and "mlxproxy.proxy.app" in modules

    def layer(name: str) -> str:
        parts = name.split(".")
        return parts[1] if len(parts) > 2 or name.endswith((".core", ".sim", ".proxy", ".load")) else "top"

    bad = []
    for m, path in modules.items():
        for target, name, line in imports_of(m, path):
            full = f"{target}.{name}" if name and f"{target}.{name}" in modules else target
            if full not in modules and target not in modules:
                continue
            src, dst = layer(m), layer(full)
            if src in ("proxy", "sim") and dst == "load":
                bad.append(f"{m}:{line} imports {full}")
            if src == "load" and dst in ("proxy", "sim") and m != "mlxproxy.load.demo":
                bad.append(f"{m}:{line} imports {full}")
    assert bad == []


def test_no_module_of_the_package_imports_a_private_name_of_another() -> None:
    modules = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    assert len(modules) > 40
    private = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} from {target}"
        for m, path in modules.items()
        for target, name, line in imports_of(m, path)
        if name and name.startswith("_") and not name.startswith("__") and target.startswith("mlxproxy")
    ]
    assert private == []


def test_tests_import_their_helpers_from_support_not_conftest() -> None:
    tests = Path(__file__).resolve().parent
    files = sorted(tests.rglob("*.py"))
    assert any(p.name == "support.py" for p in files)
    bad = [
        f"{p.relative_to(tests)}:{line}"
        for p in files
        if p.name != "conftest.py"
        for target, _, line in imports_of("tests", p)
        if target == "conftest" or target.startswith("test_")
    ]
    assert bad == [], "import shared helpers with `from support import ...` (not from conftest.py or a test file)"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_tests_mirror_the_package() -> None:
    """Each test file sits beside the part it tests: tests/core, proxy, sim, load, e2e (end to
    end through the real CLI or servers) and integration (real third-party peers); only the
    checks of the whole project are at the top."""
    tests = Path(__file__).resolve().parent
    parts = {"core", "proxy", "sim", "load", "e2e", "integration"}
    assert all((tests / d).is_dir() for d in parts)
    top = {p.name for p in tests.glob("test_*.py")}
    assert top == {"test_architecture.py", "test_docs_links.py", "test_benchmarks_smoke.py"}, top
    elsewhere = [
        str(p.relative_to(tests)) for p in tests.rglob("test_*.py") if p.parent != tests and p.parent.name not in parts
    ]
    assert elsewhere == []
    for d in parts - {"integration"}:
        assert any((tests / d).glob("test_*.py")), d
