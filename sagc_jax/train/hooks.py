"""When periodic work runs: a schedule of hooks called after every training step.

The loop trains; evaluation, logging, progress and checkpoints are hooks with their own period,
in the manner of levanter's ``trainer.add_hook(fn, every=N)`` and big_vision's ``itstime``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def itstime(step: int, every: int, total: int, *, at_end: bool = True) -> bool:
    """True after step ``step`` (1-based) when ``every`` > 0 divides it, or at the last step."""
    return (every > 0 and step % every == 0) or (at_end and step == total)


@dataclasses.dataclass(frozen=True)
class Hook:
    fn: Callable[[int, dict[str, Any]], None]  # (step, the step's record: hooks may add to it)
    every: int
    at_end: bool


class Hooks:
    """Hooks run in the order added, after each step of a run of ``total`` steps."""

    def __init__(self, total: int):
        self.total = total
        self._hooks: list[Hook] = []

    def add(self, fn: Callable[[int, dict], None], every: int = 1, at_end: bool = True) -> None:
        """Call ``fn(step, record)`` every ``every`` steps (0: never by period) and, with
        ``at_end``, after the last step."""
        self._hooks.append(Hook(fn, every, at_end))

    def __call__(self, step: int, record: dict[str, Any]) -> None:
        for hook in self._hooks:
            if itstime(step, hook.every, self.total, at_end=hook.at_end):
                hook.fn(step, record)
