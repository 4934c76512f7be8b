"""Package names that load their module on first use (PEP 562), so that importing a light
submodule (``parallel.supervisor``) does not import jax through its package's ``__init__``."""

from __future__ import annotations

import importlib


def lazy_names(package: str, homes: dict[str, str], namespace: dict):
    """``(__getattr__, __dir__)`` for ``package`` whose public names live in the submodules
    ``homes`` maps them to; a name is looked up once, then kept in ``namespace`` (the
    package's globals)."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
