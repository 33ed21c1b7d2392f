"""The rooms go one way down (docs/ARCHITECTURE.md): each product module imports only its own room and the
rooms below it, no module imports itself round a circle, and an import inside a function is there only to
defer a heavy or optional package, saying so with a `# deferred: REASON` comment on its first line or the
line above it. Every import counts, at module level and in functions, under `if TYPE_CHECKING:` too (an
annotation naming a room above is an arrow up, a type-only import round a circle is a circle)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each room and the rooms it may import, lowest first (docs/ARCHITECTURE.md draws the same picture).
MAY_IMPORT = {
    "kvcore": set(),
    "cache_impl": {"kvcore"},
    "workloads": {"kvcore", "cache_impl"},
    "sizing": {"kvcore", "cache_impl", "workloads"},
    "engines": {"kvcore", "cache_impl", "workloads"},
    "reports": {"kvcore"},
    "gates": {"kvcore", "cache_impl", "workloads", "sizing", "engines", "reports"},
}
# Inside a room, its wings (sub-packages) go one way down too: each wing and the wings it may import. A
# module at the room's top level (its front door: `__init__`, a compatibility path) may import any wing;
# no wing imports the front door.
WINGS = {
    "cache_impl": {
        "platform": set(),
        "cache": {"platform"},
        "weights": {"platform"},
        "engine": {"platform", "cache", "weights"},
        "server": {"platform", "cache", "weights", "engine"},
        "vllm": {"platform", "cache", "weights", "engine", "server"},
    },
    "workloads": {
        "traffic": set(),
        "probes": {"traffic"},
        "loadgen": {"traffic", "probes"},
        "storage": {"traffic"},
        "servers": {"traffic"},
    },
}
DEFERRED = "# deferred:"


@dataclass(frozen=True)
class Import:
    """One import statement of a product module, each module it names resolved to an absolute name."""

    path: Path
    line: int
    module: str                # the importing module
    targets: tuple[str, ...]   # the modules (or packages) it imports
    in_function: bool
    type_checking: bool
    deferred: bool             # a "# deferred: REASON" comment on its first line or the line above


def product_modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} for every module of every room under `root`."""
    found = {}
    for room in MAY_IMPORT:
        for path in sorted((root / room).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]) -> tuple[str, ...]:
    if isinstance(node, ast.Import):
        return tuple(alias.name for alias in node.names)
    base = node.module or ""
    if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    # `from package import module` imports that module; `from module import name`, the module
    return tuple(dict.fromkeys(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                               for alias in node.names))


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def imports_of(root: Path) -> list[Import]:
    """Every import statement of every product module under `root`."""
    modules = product_modules(root)
    found = []
    for module, path in modules.items():
        text = path.read_text()
        lines = text.splitlines()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]

        def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    above = lines[child.lineno - 2] if child.lineno > 1 else ""
                    deferred = DEFERRED in lines[child.lineno - 1] or above.strip().startswith(DEFERRED)
                    found.append(Import(path, child.lineno, module, _targets(child, package, modules), in_function,
                                        type_checking, deferred))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                      type_checking or _is_type_checking(child))

        visit(ast.parse(text, str(path)), False, False)
    return found


def room_of(module: str) -> str | None:
    """The room a module is in, or None for a module outside the product (the standard library, a package)."""
    top = module.partition(".")[0]
    return top if top in MAY_IMPORT else None


def arrows_up(root: Path) -> list[str]:
    """"FILE:LINE: ROOM -> ROOM (MODULE)" for each import of a room its room may not import."""
    found = []
    for imp in imports_of(root):
        mine = room_of(imp.module)
        for target in imp.targets:
            theirs = room_of(target)
            if theirs is not None and theirs != mine and theirs not in MAY_IMPORT[mine]:
                found.append(f"{imp.path.relative_to(root)}:{imp.line}: {mine} -> {theirs} ({target})")
    return found


def wing_of(module: str) -> tuple[str | None, str | None]:
    """(room, wing) of a module in a room with wings; wing None for a module at the room's top level."""
    parts = module.split(".")
    room = parts[0] if parts[0] in WINGS else None
    return room, (parts[1] if room and len(parts) > 2 else None)


def wing_arrows_up(root: Path) -> list[str]:
    """"FILE:LINE: ROOM: WING -> WING (MODULE)" for each import of a wing its wing may not import, inside a room
    (a wing importing the room's front door is one: it is above every wing)."""
    found = []
    for imp in imports_of(root):
        room, mine = wing_of(imp.module)
        if room is None or mine is None:
            continue
        for target in imp.targets:
            their_room, theirs = wing_of(target)
            if their_room == room and theirs != mine and theirs not in WINGS[room][mine]:
                found.append(f"{imp.path.relative_to(root)}:{imp.line}: {room}: {mine} -> {theirs or 'its front door'} "
                             f"({target})")
    return found


def suite_of(module: str) -> str | None:
    """The gate suite a module of gates/ is in (gates/g1_arrival/ ... gates/g4_soak/), None outside one."""
    parts = module.split(".")
    return parts[1] if parts[0] == "gates" and len(parts) > 1 and re.fullmatch(r"g\d_\w+", parts[1]) else None


def suite_arrows_in(root: Path) -> list[str]:
    """"FILE:LINE: MODULE -> SUITE" for each import of a gate suite from outside it: a suite is the top of gates/,
    what it shares with the rest of gates/ lives beside the harness (gates/side_by_side.py), its statistics below
    gates/ (kvcore/sequential.py, kvcore/block_pairs.py)."""
    return [f"{imp.path.relative_to(root)}:{imp.line}: {imp.module} -> {suite_of(target)} ({target})"
            for imp in imports_of(root) for target in imp.targets
            if suite_of(target) is not None and suite_of(target) != suite_of(imp.module)]


def undeferred_function_imports(root: Path) -> list[str]:
    """"FILE:LINE: import of MODULE in a function without '# deferred: REASON'" for each."""
    return [f"{imp.path.relative_to(root)}:{imp.line}: import of {', '.join(imp.targets)} in a function without "
            f"'{DEFERRED} REASON'" for imp in imports_of(root) if imp.in_function and not imp.deferred]


def circles(root: Path) -> list[list[str]]:
    """The groups of product modules that import each other round a circle, a type-only import (under
    TYPE_CHECKING) counted too: a module that needs another's type only names a Protocol of its own."""
    modules = product_modules(root)
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for imp in imports_of(root):
        for target in imp.targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != imp.module:
                graph[imp.module].add(target)
    return _strongly_connected(graph)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_each_room_imports_only_the_rooms_below_it():
    assert arrows_up(ROOT) == []


def test_each_wing_imports_only_the_wings_below_it():
    assert wing_arrows_up(ROOT) == []


def test_every_wing_of_a_room_is_a_package_the_order_names():
    for room, wings in WINGS.items():
        assert {path.parent.name for path in (ROOT / room).glob("*/__init__.py")} == set(wings), room


def test_the_wing_check_finds_an_arrow_up_inside_a_room_and_one_to_its_front_door(tmp_path):
    _write(tmp_path, {})
    for wing in ("platform", "cache", "engine"):
        (tmp_path / "cache_impl" / wing).mkdir()
        (tmp_path / "cache_impl" / wing / "__init__.py").write_text("")
    for name, text in {
        "cache_impl/platform/buffers.py": "from cache_impl.cache import keys\n",      # up a wing
        "cache_impl/cache/keys.py": "from cache_impl.platform import buffers\n",     # down: fine
        "cache_impl/cache/manager.py": "from cache_impl import shim\n",             # the front door
        "cache_impl/engine/loop.py": "from cache_impl.cache.keys import Key\n",     # down: fine
        "cache_impl/shim.py": "from cache_impl.engine.loop import x\n",             # the door looks in: fine
    }.items():
        (tmp_path / name).write_text(text)
    assert wing_arrows_up(tmp_path) == [
        "cache_impl/cache/manager.py:1: cache_impl: cache -> its front door (cache_impl.shim)",
        "cache_impl/platform/buffers.py:1: cache_impl: platform -> cache (cache_impl.cache.keys)"]


def test_no_module_outside_a_gate_suite_imports_the_suite():
    assert suite_arrows_in(ROOT) == []


def test_the_suite_check_finds_the_harness_importing_a_suite(tmp_path):
    _write(tmp_path, {})
    for suite in ("g2_baseline", "g3_main"):
        (tmp_path / "gates" / suite).mkdir()
        (tmp_path / "gates" / suite / "__init__.py").write_text("")
    for name, text in {
        "gates/g2_baseline/pairs.py": "x = 1\n",
        "gates/g2_baseline/test_g2.py": "from gates.g2_baseline.pairs import x\n",   # inside its suite: fine
        "gates/config.py": "from gates.g2_baseline.pairs import x\n",                 # the harness reaching up
        "gates/g3_main/blocks.py": "from gates.g2_baseline import pairs\n",            # one suite from another
    }.items():
        (tmp_path / name).write_text(text)
    assert suite_arrows_in(tmp_path) == [
        "gates/config.py:1: gates.config -> g2_baseline (gates.g2_baseline.pairs)",
        "gates/g3_main/blocks.py:1: gates.g3_main.blocks -> g2_baseline (gates.g2_baseline.pairs)"]


def test_an_import_inside_a_function_says_why_it_is_deferred():
    assert undeferred_function_imports(ROOT) == []


def test_no_product_modules_import_each_other_round_a_circle():
    assert circles(ROOT) == []


def test_every_room_is_a_package_the_order_names():
    assert {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests", "examples", "tools"} == \
        set(MAY_IMPORT)


def _write(root: Path, files: dict[str, str]) -> None:
    for room in MAY_IMPORT:
        (root / room).mkdir()
        (root / room / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).write_text(text)


def test_the_checks_find_an_arrow_up_an_undeferred_import_and_a_circle(tmp_path):
    _write(tmp_path, {
        "kvcore/low.py": "from gates import config\n",                      # up two floors
        "reports/page.py": "from workloads.traffic.client import x\n",              # reports reads only kvcore
        "cache_impl/lazy.py": "def f():\n    from kvcore import low\n",    # no reason given
        "cache_impl/heavy.py": "def f():\n    import torch  # deferred: torch takes seconds\n",
        "cache_impl/heavy2.py": "def f():\n    # deferred: an optional package\n    import redis\n",
        "kvcore/a.py": "from . import b\n",
        "kvcore/b.py": "from .a import name\n",
        "kvcore/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvcore.d import D\n",
        "kvcore/d.py": "from kvcore.c import C\n",                           # a circle through a type
        "workloads/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gates.run import X\n",
        "gates/config.py": "from cache_impl.heavy import f\nfrom reports import page\n",
    })
    assert arrows_up(tmp_path) == ["kvcore/low.py:1: kvcore -> gates (gates.config)",
                                   "workloads/typed.py:3: workloads -> gates (gates.run)",
                                   "reports/page.py:1: reports -> workloads (workloads.traffic.client)"]
    assert undeferred_function_imports(tmp_path) == [
        "cache_impl/lazy.py:2: import of kvcore.low in a function without '# deferred: REASON'"]
    assert circles(tmp_path) == [["kvcore.a", "kvcore.b"], ["kvcore.c", "kvcore.d"]]
