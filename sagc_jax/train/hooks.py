"""The step loop of a run and what runs after every step: a schedule of hooks.

The loop trains; evaluation, logging, progress and checkpoints are hooks with their own period,
in the manner of levanter's ``trainer.add_hook(fn, every=N)`` and big_vision's ``itstime``. The
GRPO trainer (``loop.Trainer.run``) and the SFT warm start (``sft.run_sft``) both run on it: a
hook that sees a stop request saves a checkpoint and calls :meth:`Hooks.stop`, and the loop ends
after that step.
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
        self.stopped = ""  # why a hook ended the run early (a signal's name), "" while it runs
        self._hooks: list[Hook] = []

    def add(self, fn: Callable[[int, dict], None], every: int = 1, at_end: bool = True) -> None:
        """Call ``fn(step, record)`` every ``every`` steps (0: never by period) and, with
        ``at_end``, after the last step."""
        self._hooks.append(Hook(fn, every, at_end))

    def stop(self, why: str) -> None:
        """End the run after the hooks of the current step."""
        self.stopped = why

    def __call__(self, step: int, record: dict[str, Any]) -> None:
        for hook in self._hooks:
            if itstime(step, hook.every, self.total, at_end=hook.at_end):
                hook.fn(step, record)

    def run(self, step: int, train_step: Callable[[int], dict[str, Any]]) -> int:
        """From ``step`` (the number of steps done), call ``train_step(step)`` (it runs that
        step and returns its record), then the hooks, until ``total`` steps are done or a hook
        stops the run. Returns the number of steps done."""
        while step < self.total and not self.stopped:
            record = train_step(step)
            step += 1
            self(step, record)
        return step


class ProgressBar:
    """A tqdm progress bar as a hook: one tick per step, with the postfix ``postfix(step,
    record)`` returns (None: keep the last one). Close it when the run ends."""

    def __init__(
        self,
        desc: str,
        total: int,
        initial: int,
        postfix: Callable[[int, dict[str, Any]], dict[str, Any] | None],
    ):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
        self.postfix = postfix

    def __call__(self, step: int, record: dict[str, Any]) -> None:
        shown = self.postfix(step, record)
        if shown is not None:
            self.bar.set_postfix(**shown)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
