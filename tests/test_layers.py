"""The packages of sagc_jax import only the layers below them (docs/architecture.md): no import
cycle, no arrow that runs back up. Every import counts, function-level ones included."""

import ast

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
