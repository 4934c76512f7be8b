"""Every controller kind, one entry each in ``CONTROLLERS``: the name ``controller.kind`` and the
specs of ``--controllers`` and ``sim.controllers`` use, its help line, its spec's argument, the
class, how the config builds one, and what the rest of the package asks of it (the seed
``compare`` offsets, whether a study measures it as adaptive). The config's choices, the spec
grammar, docs/config.md and the tests' sets are all read from here.

Adding a controller is a module with its class and an entry here (docs/architecture.md, "Add a
controller"); its metrics reach the run's log through the class's ``logged_metrics``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from sagc_jax.config import HYBRID_MODES, ConfigError, ControllerConfig, Registry
from sagc_jax.controller.base import GroupController
from sagc_jax.controller.fixed import FixedGroupController
from sagc_jax.controller.hybrid import HybridController
from sagc_jax.controller.sagc import SAGCController
from sagc_jax.controller.sagc_plus import SAGCPlusController
from sagc_jax.controller.sagc_value import SAGCValueController, StepSeconds

__all__ = ["CONTROLLERS", "SPECS", "Argument", "ControllerEntry", "parse_controller_spec"]

# (the shared budget and the kind's own sections, the spec's argument or None, the modeled
# seconds of a step or None) -> a fresh controller
Build = Callable[[ControllerConfig, Any, StepSeconds | None], GroupController]


@dataclasses.dataclass(frozen=True)
class Argument:
    """What may follow ``kind:`` in a spec, and the key of ``controller.*`` it sets.

    ``modes``: the words it may be (optional: without one, the kind's config section says);
    None: a group size G >= 1, required, and the kind's G every step (``key`` is then where
    the config holds its size).
    """

    key: str
    modes: tuple[str, ...] | None = None

    @property
    def sized(self) -> bool:
        return self.modes is None

    def parse(self, sep: str, arg: str) -> tuple[bool, int | str | None]:
        """(whether ``kind{sep}{arg}`` is allowed, the argument or None)."""
        if self.sized:
            return arg.isdigit() and int(arg) >= 1, int(arg) if arg.isdigit() else None
        return not sep or arg in self.modes, arg if sep else None

    def forms(self, kind: str) -> list[str]:
        if self.sized:
            return [f"{kind}:<G>"]
        return [kind, *(f"{kind}:{mode}" for mode in self.modes)]


@dataclasses.dataclass(frozen=True)
class ControllerEntry:
    """One controller kind.

    ``cls``: its class; ``build``: a fresh one from the config; ``help``: its line in
    ``controller.kind``'s help; ``seeded``: the name of its config section whose ``seed``
    drives a random generator (``compare`` offsets it per seed), None for a deterministic
    controller; ``argument``: what its spec may carry after ``kind:`` (None: nothing). A kind
    whose argument is a size runs one G every step: a study measures the adaptive kinds
    against it, and its G (and the key that sets it) is that size rather than the ladder.
    ``row_budget``: the rollout rows of its steps when they are fixed whatever the sizes (0:
    P x G), and ``row_budget_key`` the key that sets them; ``check_run(config, processes)``:
    what it needs of the run beyond its config (a ConfigError otherwise).
    """

    cls: type[GroupController]
    build: Build
    help: str
    seeded: str | None = None
    argument: Argument | None = None
    row_budget: Callable[[ControllerConfig], int] = lambda config: 0
    row_budget_key: str = ""
    check_run: Callable[[ControllerConfig, int], None] = lambda config, processes: None

    @property
    def adaptive(self) -> bool:
        """Whether it chooses G (a size argument fixes it)."""
        return self.argument is None or not self.argument.sized

    def spec_of(self, kind: str, config: ControllerConfig) -> str:
        """The spec that builds this kind as ``config`` says (``fixed:8``)."""
        if self.adaptive:
            return kind
        return f"{kind}:{_get(config, self.argument.key)}"

    def configure(self, controller: dict, arg) -> None:
        """Set ``controller`` (a ``to_dict`` of the section) from the spec's argument."""
        if arg is not None:
            *sections, key = self.argument.key.split(".")
            for name in sections:
                controller = controller[name]
            controller[key] = arg

    def sizes_key(self) -> str:
        """The key that holds the group sizes a run of this kind can take."""
        return "controller.candidates" if self.adaptive else f"controller.{self.argument.key}"

    def g_range(self, arg, candidates: tuple[int, ...]) -> tuple[int, int]:
        """The values G can take: the spec's size, or the ladder's range."""
        return (min(candidates), max(candidates)) if self.adaptive else (arg, arg)


def _get(section, dotted: str):
    for name in dotted.split("."):
        section = getattr(section, name)
    return section


def _hybrid(config: ControllerConfig, mode, _step_seconds) -> HybridController:
    hybrid = config.hybrid if mode is None else dataclasses.replace(config.hybrid, mode=mode)
    return HybridController(config, hybrid)


def _hybrid_rows(config: ControllerConfig) -> int:
    """A ``per_prompt`` step's fixed rollout rows (0: none, the rows are P x G)."""
    return config.hybrid.rows_per_step if config.hybrid.mode == "per_prompt" else 0


def _check_hybrid_run(config: ControllerConfig, processes: int) -> None:
    """Per-prompt group sizes train in one process only (``Config.check`` has the rest)."""
    if config.hybrid.mode == "per_prompt" and processes > 1:
        raise ConfigError(
            f"controller.hybrid.mode = per_prompt trains in one process only ({processes} "
            f"running): the processes' prompts would need unequal rows; use mode = step"
        )


CONTROLLERS = Registry(
    "controller.kind",
    {
        "sagc": ControllerEntry(
            SAGCController,
            lambda config, _, __: SAGCController(config, config.sagc),
            "the paper's SAGC",
            seeded="sagc",
        ),
        "sagc_plus": ControllerEntry(
            SAGCPlusController,
            lambda config, _, __: SAGCPlusController(config, config.sagc_plus),
            "SAGC+ (docs/controller.md)",
        ),
        "sagc_value": ControllerEntry(
            SAGCValueController,
            lambda config, _, step_seconds: SAGCValueController(
                config, config.sagc_plus, config.sagc_value, step_seconds
            ),
            "SAGC+'s budget, G chosen for learning signal per modeled second",
        ),
        "hybrid": ControllerEntry(
            HybridController,
            _hybrid,
            "prompt-aware",
            seeded="hybrid",
            argument=Argument("hybrid.mode", HYBRID_MODES),
            row_budget=_hybrid_rows,
            row_budget_key="controller.hybrid.rows_per_step",
            check_run=_check_hybrid_run,
        ),
        "fixed": ControllerEntry(
            FixedGroupController,
            lambda config, size, _: FixedGroupController(size, tau=config.tau, scope=config.scope),
            "controller.group_size every step",
            argument=Argument("group_size"),
        ),
    }.items(),
)


def parse_controller_spec(spec: str) -> tuple[str, int | str | None]:
    """A controller spec string as ``(kind, argument)``; anything else is a ConfigError naming
    the forms allowed.

    ``'sagc'`` -> ("sagc", None); ``'fixed:8'`` -> ("fixed", 8); ``'hybrid'`` -> ("hybrid",
    None) (the mode of ``controller.hybrid.mode``); ``'hybrid:per_prompt'`` -> ("hybrid",
    "per_prompt").
    """
    kind, sep, arg = spec.partition(":")
    entry = CONTROLLERS.get(kind)
    if entry is not None and entry.argument is None and not sep:
        return kind, None
    if entry is not None and entry.argument is not None:
        allowed, value = entry.argument.parse(sep, arg)
        if allowed:
            return kind, value
    raise ConfigError(f"controller spec {spec!r} is not allowed; use {_allowed()}")


def spec_forms() -> list[str]:
    """The spec forms, those without an argument first, then a size, then modes."""
    entries = CONTROLLERS.items()
    plain = [k for k, e in entries if e.argument is None]
    sized = [f for k, e in entries if e.argument and e.argument.sized for f in e.argument.forms(k)]
    modes = [
        f for k, e in entries if e.argument and not e.argument.sized for f in e.argument.forms(k)
    ]
    return plain + sized + modes


def _allowed() -> str:
    forms = [f"'{f}' with G >= 1" if f.endswith(":<G>") else f"'{f}'" for f in spec_forms()]
    return ", ".join(forms[:-1]) + " or " + forms[-1]


@dataclasses.dataclass(frozen=True)
class _Specs:
    """The specs of ``sim.controllers`` as a table: each item checked by
    :func:`parse_controller_spec`, the forms listed from ``CONTROLLERS``."""

    key: str = "sim.controllers"

    def check(self, spec: str) -> None:
        parse_controller_spec(spec)

    def names(self) -> list[str]:
        return spec_forms()

    def help(self) -> str:
        return ""


SPECS = _Specs()
