"""The package's layering, checked from the source (every import statement, also those inside
functions) and from what importing a module actually pulls in:

- the measurement core (`mlxproxy/core/`) imports only the standard library's pure modules and
  orjson: no I/O library (aiohttp, httpx, asyncio, sockets, ...), no clock, and no other
  `mlxproxy` package;
- the simulator (`mlxproxy/sim/`) imports nothing from the proxy (`mlxproxy.proxy`);
- the proxy and the simulator import nothing from load testing (`mlxproxy/load/`), and of load
  testing only the demo (which wires simulators behind a proxy) imports the proxy or the simulator;
- every import runs down the floors of `FLOORS` (a subpackage or top-level module imports only
  from lower floors, never across or up): the server edge (`mlxproxy/edge/`) sits below the
  proxy and the simulator that both use it, and `vocabulary.py` below load testing;
- the whole package's imports form a tree (no cycle);
- no module of the package takes a private name (`_name`) from another;
- the private internals of uvicorn are used only in its compatibility module (`COMPAT`),
  prometheus_client's nowhere: elsewhere every `x._name` the package reads or writes
  is its own.
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
    return {module_name(p): p for p in sorted((PACKAGE / subpackage).rglob("*.py"))}


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
    # the command module too: it starts servers through the shared server edge (mlxproxy.edge)
    new = newly_imported(sorted(modules_of("sim")) + ["mlxproxy.edge.runner"])
    assert "mlxproxy.sim.app" in new and "mlxproxy.sim.cli" in new and "mlxproxy.edge.limits" in new
    assert sorted(m for m in new if m.startswith("mlxproxy.proxy")) == []


@pytest.mark.parametrize("subpackage", ["core", "sim", "proxy", "load", "edge"])
def test_no_import_cycle(subpackage: str) -> None:
    # Imports inside functions count: a cycle hidden in a function is still a cycle.
    edges = internal_edges(modules_of(subpackage))
    assert any(edges.values())  # the graph was read
    assert find_cycle(edges) is None, find_cycle(edges)


def test_no_import_cycle_in_the_whole_package() -> None:
    edges = internal_edges({module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))})
    assert "mlxproxy.load.commands.bench_cli" in edges["mlxproxy.cli"]  # the graph spans the subpackages
    assert find_cycle(edges) is None, find_cycle(edges)


def test_the_layers_import_only_downwards() -> None:
    """proxy and sim know nothing of load testing; load testing reaches the proxy and the
    simulator only in the demo, which runs them together."""
    modules = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    assert "mlxproxy.load.run.client" in modules and "mlxproxy.proxy.app" in modules

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
            if src == "load" and dst in ("proxy", "sim") and m != "mlxproxy.load.commands.demo":
                bad.append(f"{m}:{line} imports {full}")
    assert bad == []


#: The package's floors, bottom first: each room (a subpackage, or a module at the top) imports
#: only from rooms on lower floors. `mlxproxy` is the package's face (`__version__`).
FLOORS: dict[str, int] = {
    "mlxproxy": 0,
    "core": 0,
    "asgi": 0,
    "headers": 0,
    "errors": 1,
    "vocabulary": 1,
    "edge": 2,
    "config": 2,
    "capture": 2,
    "sim": 3,
    "proxy": 3,
    "load": 4,
    "cli": 5,
    "__main__": 6,
}


def room_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_edges() -> dict[str, set[tuple[str, str]]]:
    """room -> {(room it imports, "module:line imports module")}, across rooms only."""
    modules = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    out: dict[str, set[tuple[str, str]]] = {}
    for m, path in modules.items():
        for target, name, line in imports_of(m, path):
            full = f"{target}.{name}" if name and f"{target}.{name}" in modules else target
            if full not in modules:
                continue
            src, dst = room_of(m), room_of(full)
            if src != dst:
                out.setdefault(src, set()).add((dst, f"{m}:{line} imports {full}"))
    return out


def test_every_room_has_a_floor() -> None:
    rooms = {room_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert {"edge", "proxy", "sim", "load", "core"} <= rooms
    assert sorted(rooms - set(FLOORS)) == [], "give each new subpackage or top-level module its floor in FLOORS"


def test_no_import_runs_up_or_across_the_floors() -> None:
    edges = room_edges()
    assert any(dst == "edge" for dst, _ in edges["sim"]) and any(dst == "edge" for dst, _ in edges["proxy"])
    bad = sorted(why for src, out in edges.items() for dst, why in out if FLOORS[dst] >= FLOORS[src])
    assert bad == []


def test_no_circle_between_rooms() -> None:
    edges = {src: {dst for dst, _ in out} for src, out in room_edges().items()}
    edges = {room: edges.get(room, set()) for room in FLOORS}
    assert find_cycle(edges) is None, find_cycle(edges)


#: load testing's own floors, bottom first (docs/ARCHITECTURE.md, "Load testing"): the result
#: file's types and charts; judging a run; showing and writing results; sending from this
#: process (the shapes and the one runner); the fleet of processes and hosts; the commands.
LOAD_FLOORS: dict[str, int] = {"data": 0, "judge": 1, "output": 2, "run": 3, "fleet": 4, "commands": 5}


def load_room(name: str) -> str:
    return name.split(".")[2] if name.count(".") >= 2 else "__init__"


def test_load_testing_is_subpackages_whose_imports_run_down_their_floors() -> None:
    modules = {module_name(p): p for p in sorted((PACKAGE / "load").rglob("*.py"))}
    rooms = {load_room(m) for m in modules if m != "mlxproxy.load"}
    assert sorted(rooms - set(LOAD_FLOORS)) == [], "give each subpackage of load/ its floor in LOAD_FLOORS"
    at_top = [m for m, p in modules.items() if p.parent == PACKAGE / "load" and p.name != "__init__.py"]
    assert at_top == [], "every module of load/ lives in one of its subpackages"
    bad, edges = [], {room: set() for room in LOAD_FLOORS}
    for m, path in modules.items():
        for target, name, line in imports_of(m, path):
            full = f"{target}.{name}" if name and f"{target}.{name}" in modules else target
            if full not in modules or full == "mlxproxy.load" or m == "mlxproxy.load":
                continue
            src, dst = load_room(m), load_room(full)
            if src != dst:
                edges[src].add(dst)
                if LOAD_FLOORS[dst] >= LOAD_FLOORS[src]:
                    bad.append(f"{m}:{line} imports {full}")
    assert edges["commands"] and edges["run"]  # the graph was read
    assert sorted(bad) == []
    assert find_cycle(edges) is None


def test_no_load_module_is_over_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in sorted((PACKAGE / "load").rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500
    }
    assert long == {}


#: the one module per third-party library whose private internals the package uses
COMPAT = {
    "uvicorn": "mlxproxy/edge/_compat_uvicorn.py",
}
#: libraries the package uses through public API only (prometheus_client: custom collectors)
PUBLIC_ONLY = ("prometheus_client",)
#: private-looking names used outside them on purpose, with why
NOT_THIRD_PARTY_INTERNALS = {
    "_replace": "namedtuple's public API (the underscore only avoids clashing with field names)",
    "_fields": "namedtuple's public API, likewise (core.meter's Measurement checks its field order)",
    "_read_ready_cb": "asyncio's selector transport, not one of the three libraries (edge/limits.py, "
    "python/cpython#100348, before 3.12)",
    "_current_frames": "sys._current_frames, documented in the standard library (load/stalls.py samples the "
    "event loop thread's stack while the loop is late), not one of the three libraries",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def foreign_private_names(files: list[Path]) -> list[str]:
    """Every `x._name` read or written (also through getattr/setattr/hasattr with a literal name)
    in `files` whose name those files never define themselves (as a def, a class, `self._name =`,
    a plain name, an argument, an import alias or a `__slots__` entry): someone else's private
    name."""
    defined: set[str] = set()
    used: list[tuple[str, str]] = []
    for path in files:
        where = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.alias):
                defined.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    defined.add(node.attr)
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                defined |= {
                    c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
            if isinstance(node, ast.Attribute) and _private(node.attr):
                used.append((node.attr, f"{where}:{node.lineno}"))
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
            ):
                used.append((node.args[1].value, f"{where}:{node.lineno}"))
    return sorted(f"{where} uses {name}" for name, where in used if name not in defined)


def test_third_party_internals_are_used_only_in_the_compat_modules() -> None:
    compat = {PACKAGE.parent / f for f in COMPAT.values()}
    assert all(p.is_file() for p in compat)
    others = [p for p in sorted(PACKAGE.rglob("*.py")) if p not in compat]
    found = foreign_private_names(others)
    assert [f for f in found if f.rsplit(" ", 1)[1] not in NOT_THIRD_PARTY_INTERNALS] == []
    # the check sees what the compat modules do: each of them uses internals of its library
    for lib, f in COMPAT.items():
        assert foreign_private_names([PACKAGE.parent / f]) != [], lib


def test_imports_of_the_three_libraries_name_no_private_module_outside_the_compat_modules() -> None:
    modules = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    compat = {module_name(PACKAGE.parent / f) for f in COMPAT.values()}
    bad = [
        f"{m}:{line} imports {target}.{name}"
        for m, path in modules.items()
        if m not in compat
        for target, name, line in imports_of(m, path)
        if target.split(".")[0] in (*COMPAT, *PUBLIC_ONLY)
        and (any(_private(part) for part in target.split(".")) or (name is not None and _private(name)))
    ]
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
    """Each test file sits beside the part it tests: tests/core, edge, proxy, sim, load, e2e (end to
    end through the real CLI or servers) and integration (real third-party peers); only the
    checks of the whole project are at the top."""
    tests = Path(__file__).resolve().parent
    parts = {"core", "edge", "proxy", "sim", "load", "e2e", "integration"}
    assert all((tests / d).is_dir() for d in parts)
    top = {p.name for p in tests.glob("test_*.py")}
    assert top == {"test_architecture.py", "test_docs_links.py", "test_benchmarks_smoke.py"}, top
    elsewhere = [
        str(p.relative_to(tests)) for p in tests.rglob("test_*.py") if p.parent != tests and p.parent.name not in parts
    ]
    assert elsewhere == []
    for d in parts - {"integration"}:
        assert any((tests / d).glob("test_*.py")), d


def test_no_function_in_load_is_over_80_lines() -> None:
    """Load testing stays readable: a function that grows past 80 lines is split by what it does
    (`htmlreport.render_html` is one function per report section)."""
    long = []
    for path in sorted((PACKAGE / "load").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
