"""Architecture rules checked statically (by reading source with ``ast``, importing nothing).

* Plugins speak to the core through one module: every ``reef_core`` import in ``plugins/*`` and the
  third-party fixture names ``reef_core.api``; their tests and examples may also use
  ``reef_core.testing``.
* ``reef_core`` has no import cycles. Every import counts, function-local ones included: a
  function-local import is still a dependency of the module that contains it, and hiding a cycle
  inside a function only moves the failure to run time. Imports under ``if TYPE_CHECKING:`` do not
  count (they never run).
* ``reef_core``'s rooms stand on floors (:data:`FLOORS`, ground first) and every import runs down or
  stays in its room: engines below grow, the loop below serve, with no exceptions. Here imports under
  ``if TYPE_CHECKING:`` count too: a type named from a higher floor is still an arrow back up.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "reef_core"


def _parse(path: Path) -> ast.Module:
    """``ast.parse`` with the garbage collector held off: late in a full run, a finalizer (a release store closing
    its git process) running during the AST's construction tripped CPython 3.11's recursion-depth check
    ("AST constructor recursion depth mismatch")."""
    source = path.read_text()
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, str(path))
    finally:
        if enabled:
            gc.enable()


def _imports(path: Path, package: str, submodules: bool = True,
             type_checking: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in ``path``, skipping ``if TYPE_CHECKING:`` blocks unless
    ``type_checking``.

    With ``submodules``, ``from pkg import name`` also yields ``pkg.name`` (it may be a submodule)."""
    tree = _parse(path)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import sub` may name a submodule: record it when it is one.
            found.append((node.lineno, module))
            if submodules:
                found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return found


def _module_name(path: Path, root: Path) -> tuple[str, str]:
    """(module, package) of a file under ``root``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _plugin_sources():
    for top in [*sorted((ROOT / "plugins").glob("reef-*")), ROOT / "tests" / "fixtures" / "reef-example-thirdparty"]:
        for path in sorted(top.rglob("*.py")):
            if "build" in path.relative_to(top).parts:
                continue
            yield top, path


def test_plugins_import_only_the_public_api():
    offences = []
    scanned = 0
    for top, path in _plugin_sources():
        rel = path.relative_to(top).parts
        may_use_testing = "tests" in rel or ("examples" in rel and not _ships_in_wheel(top, path))
        allowed = ("reef_core.api", "reef_core.testing") if may_use_testing else ("reef_core.api",)
        scanned += 1
        for line, module in _imports(path, "", submodules=False):
            if module.partition(".")[0] != "reef_core":
                continue
            if module == "reef_core" or not any(module == a or module.startswith(a + ".") for a in allowed):
                offences.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert scanned > 20, "the scan found no plugin sources"
    assert not offences, "plugins must import reef_core.api only:\n" + "\n".join(sorted(set(offences)))


def _ships_in_wheel(top: Path, path: Path) -> bool:
    """Examples inside the importable package ship in the wheel (and so may not need test-only modules)."""
    return path.relative_to(top).parts[0].startswith("reef_")


def _core_graph() -> dict[str, set[str]]:
    modules = {}
    for path in CORE.rglob("*.py"):
        name, package = _module_name(path, ROOT)
        modules[name] = (path, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, package) in modules.items():
        for _, target in _imports(path, package):
            # `import a.b.c` also runs a and a.b: an edge to the deepest reef_core module named.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_reef_core_has_no_import_cycles():
    graph = _core_graph()
    assert len(graph) > 50
    cycles = _cycles(graph)
    detail = []
    for component in cycles:
        members = set(component)
        detail.append(" , ".join(f"{m} -> {sorted(graph[m] & members)}" for m in component))
    assert not cycles, "import cycles in reef_core:\n" + "\n".join(detail)


#: The floors of ``reef_core``, ground first: each room (a top-level module or package, by its name under
#: ``reef_core``; ``__init__`` is the package's own module) may import its own modules and those of rooms on
#: lower floors, never a room on its floor or above. A new room must be given a floor here.
FLOORS: list[set[str]] = [
    {"errors", "progress", "hookspecs", "versions", "background", "wire", "conf"},
    {"content", "extras", "models", "plugins", "names", "topk"},
    {"__init__", "config", "commit", "observe"},
    {"engines", "client", "sweep"},
    {"grow", "surfaces", "chat"},
    {"loop"},
    {"serve", "builtins"},
    {"api", "testing", "cli"},
]


def _room(module: str) -> str:
    """The room of a ``reef_core`` module: its first name under ``reef_core`` (``__init__`` for the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_room_has_a_floor():
    placed = set().union(*FLOORS)
    rooms = {_room(_module_name(path, ROOT)[0]) for path in CORE.rglob("*.py")}
    assert "engines" in rooms and "grow" in rooms, "the scan found no rooms"
    assert not rooms - placed, f"rooms without a floor in FLOORS: {sorted(rooms - placed)}"
    assert len(placed) == sum(len(floor) for floor in FLOORS), "a room stands on two floors"


def test_every_import_runs_down_the_floors():
    floor_of = {room: n for n, floor in enumerate(FLOORS, 1) for room in floor}
    modules = {_module_name(path, ROOT)[0]: path for path in CORE.rglob("*.py")}
    offences: set[str] = set()
    for name, path in sorted(modules.items()):
        package = _module_name(path, ROOT)[1]
        room = _room(name)
        for line, target in _imports(path, package, type_checking=True):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if not target or target == name or name.startswith(target + "."):
                continue  # not reef_core, itself, or a package above it (its __init__ runs first anyway)
            other = _room(target)
            if other != room and floor_of.get(other, 0) >= floor_of.get(room, 0):
                offences.add(f"{path.relative_to(ROOT)}:{line}: {room} (floor {floor_of.get(room)}) imports "
                                f"{target} ({other}, floor {floor_of.get(other)})")
    assert not offences, "imports that run back up (or across) the floors:\n" + "\n".join(sorted(offences))


#: What ``serve/`` may not reach through the deployment: it asks ``ServePorts`` (``reef_core/loop/ports.py``) instead.
_BEHIND_THE_PORT = {"store", "artifacts", "pm"}


def test_serve_asks_its_port_and_reaches_nothing_behind_it():
    offences = []
    for path in sorted((CORE / "serve").rglob("*.py")):
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Attribute) and node.attr in _BEHIND_THE_PORT:
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not offences, "serve/ reaches behind ServePorts:\n" + "\n".join(offences)


def test_serve_ports_names_what_the_deployment_implements():
    from reef_core.loop.deployment import Deployment
    from reef_core.loop.ports import ServePorts

    wanted = {name for name in vars(ServePorts) if not name.startswith("_")} | set(ServePorts.__annotations__)
    instance_attributes = ("engine", "on_records", "tell_workers")  # set in Deployment.__init__
    missing = sorted(name for name in wanted if not hasattr(Deployment, name) and name not in instance_attributes)
    assert not missing, f"Deployment does not implement ServePorts: {missing}"


def _is_the_deployment(node: ast.expr) -> bool:
    """``dep``, ``deployment``, ``self.dep`` or ``request.app.state.reef``: how serve/ names its ServePorts."""
    if isinstance(node, ast.Name):
        return node.id in ("dep", "deployment")
    if isinstance(node, ast.Attribute):
        return node.attr in ("dep", "deployment") or (
            node.attr == "reef" and isinstance(node.value, ast.Attribute) and node.value.attr == "state")
    return False


def test_serve_calls_only_what_serve_ports_names():
    from reef_core.loop.ports import ServePorts

    members = {name for name in vars(ServePorts) if not name.startswith("_")} | set(ServePorts.__annotations__)
    outside = sorted(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}"
                     for path in (CORE / "serve").rglob("*.py") for node in ast.walk(_parse(path))
                     if isinstance(node, ast.Attribute) and _is_the_deployment(node.value)
                     and node.attr not in members)
    assert not outside, "serve/ asks its deployment for what ServePorts does not name:\n" + "\n".join(outside)


#: The longest a function of reef_core may be: a longer one does several things (split it by what they are).
MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_it_can_be_read():
    long = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
