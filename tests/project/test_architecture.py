"""The layering of docs/architecture.md, checked on the source: imports run one way, no cycles, no
private name crosses a module, and the light entry points stay light."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

from tests.support.helpers import ROOT

# Lower numbers are lower layers; a module may import its own layer and the layers below it.
LAYERS = {
    "certckpt.errors": 0,
    "certckpt.version": 0,
    "certckpt.log": 0,
    "certckpt.storage": 1,
    "certckpt.format": 2,
    "certckpt.trust": 3,
    "certckpt.vault": 4,
    "certckpt.ops": 4,
    "certckpt.detect": 4,
    "certckpt.integrations": 5,
    "certckpt.dcp": 5,
    "certckpt.tools": 6,
    "certckpt_cli": 7,
}
# Siblings on one layer stay independent of each other.
SIBLINGS = {"certckpt.vault", "certckpt.ops", "certckpt.detect"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for base in ("certckpt", "certckpt_cli"):
        for path in (ROOT / base).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, list[str], bool]]:
    """(imported module, names, at module level) for every certckpt import of one module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = set()
    for node in tree.body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` blocks count as module level
            top.update(id(n) for n in ast.walk(node))
        top.add(id(node))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.append((mod, [a.name for a in node.names], id(node) in top))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], id(node) in top) for a in node.names)
    return [(m, n, t) for m, n, t in out if m.split(".")[0] in ("certckpt", "certckpt_cli")]


def _layer(module: str) -> tuple[str, int]:
    for prefix, level in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, level
    return "certckpt", 8  # the front door: only the package itself may import everything


def test_every_module_belongs_to_a_layer():
    loose = [m for m in MODULES if _layer(m)[1] == 8 and m != "certckpt"]
    assert not loose, f"modules outside every layer (put them in a subpackage): {loose}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_run_one_way(name):
    here, level = _layer(name)
    for mod, _, _ in _imports(name, MODULES[name]):
        there, other = _layer(mod)
        if here == "certckpt":
            continue
        assert other <= level, f"{name} (layer {here}) imports {mod} from the higher layer {there}"
        assert not (here in SIBLINGS and there in SIBLINGS and here != there), f"{name} imports its sibling layer {mod}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_name_crosses_a_module(name):
    for mod, names, _ in _imports(name, MODULES[name]):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{name} imports private {private} from {mod}: give them a public name"


def test_module_level_imports_have_no_cycle():
    graph = {}
    for name, path in MODULES.items():
        deps = set()
        for mod, names, top in _imports(name, path):
            if not top:
                continue
            deps.add(mod)
            deps.update(f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES)
        graph[name] = {d for d in deps if d in MODULES and d != name}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*trail[trail.index(dep) :], dep]))
            if dep not in state:
                visit(dep, [*trail, dep])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def _static_value(tree: ast.Module, name: str) -> ast.expr | None:
    """The expression last assigned to ``name`` at module level (annotated or not), or None."""
    value = None
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            value = node.value
    return value


def _static_all(path: pathlib.Path) -> list[str] | None:
    """A module's ``__all__`` read from its source without importing it (None when it defines none).

    Reads a list or tuple literal, or ``sorted(TABLE)`` / ``list(TABLE)`` of a dict or list literal
    defined in the module; anything else fails the test rather than passing unread."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    value = _static_value(tree, "__all__")
    if value is None:
        return None
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id in ("sorted", "list")
        and len(value.args) == 1
        and isinstance(value.args[0], ast.Name)
    ):
        value = _static_value(tree, value.args[0].id)
        if isinstance(value, ast.Dict):
            return [ast.literal_eval(k) for k in value.keys if k is not None]
    assert isinstance(value, (ast.List, ast.Tuple)), f"{path}: __all__ is not a literal list this test can read"
    return [ast.literal_eval(e) for e in value.elts]


def _lazy_table(path: pathlib.Path) -> dict[str, str] | None:
    """A package ``__init__``'s ``_LAZY`` table (name -> module, relative to the package or absolute)."""
    value = _static_value(ast.parse(path.read_text(encoding="utf-8")), "_LAZY")
    return None if value is None else ast.literal_eval(value)


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _reexports(package: str) -> dict[str, str]:
    """name -> module that defines it, for the names a package's ``__init__`` re-exports: its own
    ``from .x import name`` (module level, ``if TYPE_CHECKING`` included) and its ``_LAZY`` table."""
    path = MODULES[package]
    out = {}
    for mod, names, top in _imports(package, path):
        if top and mod != package:
            out.update((n, mod) for n in names)
    for n, mod in (_lazy_table(path) or {}).items():
        out[n] = mod if mod.startswith(("certckpt.", "certckpt_cli.")) else f"{package}.{mod}"
    return out


def _targets(mod: str, names: list[str], seen: frozenset[str] = frozenset()) -> set[str]:
    """The modules an import depends on: each name that is a module; a name a package re-exports,
    followed to the module that defines it; the imported module itself for anything else."""
    if mod not in MODULES:
        return set()
    if not names:
        return {mod}
    out = set()
    table = _reexports(mod) if MODULES[mod].name == "__init__.py" else {}
    for n in names:
        if f"{mod}.{n}" in MODULES:
            out.add(f"{mod}.{n}")
        elif n in table and table[n] != mod and table[n] not in seen:
            out |= _targets(table[n], [n], seen | {mod})
        else:
            out.add(mod)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that ends where it starts, or None."""
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*trail[trail.index(dep) :], dep]
            if dep not in state:
                found = visit(dep, [*trail, dep])
                if found:
                    return found
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def test_no_import_cycle_even_through_imports_inside_functions():
    """Every certckpt import counts: module level, inside functions, and under ``if TYPE_CHECKING``.

    An import inside a function only postpones a cycle to the first call; docs/architecture.md allows
    it to keep torch, matplotlib or fsspec off a light path, never to break a cycle. Type-only imports
    count too: a signature that names a type is a dependency of the design, and ``if TYPE_CHECKING``
    is the same escape hatch as a function body.

    What is a real cycle: the graph has one node per module, and an edge from a module to each module
    whose code it uses. ``from certckpt.vault import promote`` uses ``vault.promotion``, the module
    that defines ``promote``: a package ``__init__`` that re-exports names (eagerly or through a lazy
    ``_LAZY`` table) is followed to the defining module, so a door that lists its rooms is not a cycle
    with each room, and a room that imports a sibling's name through the door depends on the sibling.
    Importing ``certckpt.a.b`` also runs ``certckpt/a/__init__.py`` first, but Python initialises the
    package before the module, so that implicit edge is not counted (it would make every package that
    re-exports its modules a cycle by construction)."""
    graph = {}
    for name, path in MODULES.items():
        deps: set[str] = set()
        for mod, names, _ in _imports(name, path):
            deps |= _targets(mod, names)
        graph[name] = deps - {name}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle (imports inside functions included): " + " -> ".join(cycle or [])


def test_no_module_imports_a_name_its_target_does_not_export():
    """``from certckpt.x.y import name`` names a module's interface: when ``certckpt.x.y`` lists
    ``__all__``, ``name`` is in it.

    The rule: a module may import any public name of a module in its own package (``certckpt.vault.
    drill`` may use ``certckpt.vault.transfer``'s helpers; an ``__init__`` belongs to the package it
    opens); a module of any other package, a nested subpackage included, imports only what the target
    exports in ``__all__``. Importing a submodule (``from certckpt.format import fused``) names a
    module, not an exported name, and is always allowed. Fix a violation by adding the name to the
    target's ``__all__`` when it is part of its interface, or by importing it from where it is
    exported."""
    problems = []
    for name, path in sorted(MODULES.items()):
        for mod, names, _ in _imports(name, path):
            if mod not in MODULES or _package_of(name) == _package_of(mod):
                continue
            exported = _static_all(MODULES[mod])
            if exported is None:
                continue
            hidden = [n for n in names if n not in exported and f"{mod}.{n}" not in MODULES]
            problems += [f"{name} imports {n} from {mod}, whose __all__ does not list it" for n in hidden]
    assert not problems, f"{len(problems)} imports of names outside __all__:\n" + "\n".join(problems)


LAZY_DOORS = sorted(n for n, p in MODULES.items() if p.name == "__init__.py" and _lazy_table(p) is not None)


def test_the_lazy_doors_are_found():
    assert {"certckpt", "certckpt.dcp", "certckpt.detect"} <= set(LAZY_DOORS)


@pytest.mark.parametrize("package", LAZY_DOORS)
def test_a_lazy_door_lists_what_it_resolves(package):
    """A package ``__init__`` with a lazy ``_LAZY`` table and ``__getattr__``: ``__all__`` is exactly
    the lazy names plus the names the ``__init__`` binds itself (its eager imports); the
    ``if TYPE_CHECKING`` block (what type checkers and readers see) imports each lazy name from the
    module the table names; and every name in ``__all__`` resolves to an object."""
    path = MODULES[package]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lazy = _lazy_table(path) or {}
    exported = _static_all(path) or []
    assert len(exported) == len(set(exported)), f"{package}.__all__ lists a name twice"
    eager = set()
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module not in ("__future__", "typing"):
            eager.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            block = ast.Module(body=node.body, type_ignores=[])
            for imp in (n for n in ast.walk(block) if isinstance(n, ast.ImportFrom)):
                mod = f"{package}.{imp.module}" if imp.level else imp.module
                typed.update((a.asname or a.name, mod) for a in imp.names)
    eager = {n for n in eager if not (n.startswith("_") and not n.startswith("__"))}
    missing = sorted(set(lazy) - set(exported))
    unknown = sorted(set(exported) - set(lazy) - eager)
    assert not missing, f"{package}: lazy names missing from __all__: {missing}"
    assert not unknown, f"{package}: __all__ lists names neither lazy nor imported: {unknown}"
    assert not (eager - set(exported)), f"{package}: eager names missing from __all__: {sorted(eager - set(exported))}"
    if typed:
        wrong = sorted(
            n for n, mod in lazy.items() if typed.get(n) != (mod if mod.startswith("certckpt.") else f"{package}.{mod}")
        )
        assert not wrong, f"{package}: the TYPE_CHECKING imports disagree with the lazy table for {wrong}"
    door = importlib.import_module(package)
    unresolved = []
    for n in exported:
        try:
            getattr(door, n)
        except (AttributeError, ImportError) as e:
            unresolved.append(f"{n} ({type(e).__name__}: {e})")
    assert not unresolved, f"{package}: names in __all__ that do not resolve: {unresolved}"
    for n, mod in lazy.items():
        target = importlib.import_module(mod if mod.startswith("certckpt.") else f"{package}.{mod}")
        assert hasattr(target, n), f"{package}: {n} is not in {target.__name__}"


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_certckpt_loads_no_layer():
    loaded = _run("import sys, certckpt; print(sorted(m for m in sys.modules if m.startswith('certckpt')))")
    assert loaded.strip() == "['certckpt', 'certckpt.errors', 'certckpt.version']"


def test_help_imports_no_command_module_and_lists_every_command():
    code = (
        "import sys\n"
        "from certckpt_cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print(sorted(m for m in sys.modules if m.startswith('certckpt')))"
    )
    out = _run(code)
    assert out.splitlines()[-1] == "['certckpt_cli', 'certckpt_cli.main']"
    from certckpt_cli.main import COMMANDS

    for name in COMMANDS:
        assert f"  {name} " in out, f"{name} missing from --help"


def test_registry_summaries_match_the_commands():
    from certckpt_cli.main import COMMANDS

    for name, entry in COMMANDS.items():
        command = getattr(importlib.import_module(f"certckpt_cli.{entry.module}"), entry.attr)
        assert command.get_short_help_str(limit=10_000) == entry.summary, name


def test_verify_imports_the_format_and_storage_layers_only():
    code = (
        "import sys\n"
        "from certckpt_cli.main import main\n"
        "try:\n    main(['verify', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "layers = sorted({m.split('.')[1] for m in sys.modules if m.startswith('certckpt.')})\n"
        "print(layers, 'torch' in sys.modules, 'fsspec' in sys.modules)"
    )
    assert _run(code).splitlines()[-1] == "['errors', 'format', 'log', 'storage', 'version'] False False"


@pytest.mark.parametrize(
    ("package", "hidden", "extra"),
    [
        ("certckpt.integrations.lightning", ["lightning", "pytorch_lightning"], "lightning"),
        ("certckpt.integrations.transformers", ["transformers"], "transformers"),
    ],
)
def test_a_missing_extra_is_one_error_in_one_frame_of_certckpt(package, hidden, extra):
    """What a user sees importing an integration without its framework: the import line, certckpt's
    line that raises, and the error naming the pip command; no chained traceback."""
    hide = "; ".join(f"sys.modules[{name!r}] = None" for name in hidden)
    r = subprocess.run(
        [sys.executable, "-c", f"import sys; {hide}; import {package}"], capture_output=True, text=True, timeout=60
    )
    frames = [ln for ln in r.stderr.splitlines() if ln.startswith('  File "')]
    assert r.returncode == 1 and len(frames) == 2, r.stderr  # <string>, then the package's __init__
    assert "During handling" not in r.stderr and "direct cause" not in r.stderr
    assert r.stderr.splitlines()[-1].endswith(f"pip install 'certckpt[{extra}]'"), r.stderr
