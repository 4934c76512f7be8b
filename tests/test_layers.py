"""The packages of sagc_jax import only the layers below them (docs/architecture.md): no import
cycle, no arrow that runs back up; and within a package no two files import each other, however
far round. Every import counts, function-level ones included."""

import ast

import pytest
from helpers import ROOT

# Bottom to top. A unit is a package under sagc_jax/ or a top-level module; a unit imports only
# itself and the units of lower layers (units of one layer do not import each other).
LAYERS = (
    ("config", "lazy", "decode_schedule"),
    ("rl", "models", "controller"),
    ("tasks", "parallel", "sim"),
    ("sampling",),
    ("programs",),
    ("planning",),
    ("train",),
    ("export", "analysis"),
    ("commands",),
    ("cli",),
    ("__main__",),
)
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str | None:
    """The unit of a dotted module name inside sagc_jax (None: the package's own __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imports():
    """(importing unit, imported unit, file:line) for every import of sagc_jax inside it."""
    package = ROOT / "sagc_jax"
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("")
        source = _unit(".".join(relative.parts)) or "__init__"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                names = [".".join(relative.parts[: -node.level] + (node.module or "",))]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                target = _unit(name) if name.startswith("sagc_jax.") else None
                if target is not None and target != source:
                    yield source, target, f"{relative}.py:{node.lineno}"


def test_every_unit_has_a_layer():
    units = {path.stem if path.is_file() else path.name for path in (ROOT / "sagc_jax").iterdir()}
    units -= {"__init__", "__pycache__"}
    assert units == set(LEVEL), "add the new unit to LAYERS (and to docs/architecture.md)"


def test_imports_only_run_down_the_layers():
    upward = [
        f"{where}: {source} imports {target}"
        for source, target, where in _imports()
        if source != "__init__" and LEVEL[target] >= LEVEL[source]
    ]
    assert not upward, "\n".join(upward)


def _module_imports():
    """{module: the sagc_jax modules it imports}, over every file (function-level imports
    included). ``from package import name`` counts the package's ``__init__`` only when the
    name is not a submodule; importing a submodule runs its parents' ``__init__``s anyway, which
    is not counted (a package's ``__init__`` gathers its modules' names)."""
    package = ROOT / "sagc_jax"

    def name_of(path):
        parts = path.relative_to(ROOT).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name_of(path): path for path in package.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                targets.update(subs + ([base] if len(subs) < len(node.names) else []))
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def test_no_import_cycle_between_files():
    graph = _module_imports()
    cycles = []
    for start in graph:  # a depth-first walk from each module back to itself
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    assert not cycles, "\n".join(sorted(set(cycles)))


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    """The walk above finds a cycle when there is one: two files that import each other."""
    import test_layers

    package = tmp_path / "sagc_jax"
    (package / "tasks").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tasks" / "__init__.py").write_text("")
    (package / "tasks" / "a.py").write_text("from sagc_jax.tasks.b import x\n")
    (package / "tasks" / "b.py").write_text("def x():\n    from sagc_jax.tasks import a\n")
    monkeypatch.setattr(test_layers, "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"sagc_jax.tasks.a -> sagc_jax.tasks.b"):
        test_no_import_cycle_between_files()
