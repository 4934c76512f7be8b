"""The step loop of a run and what runs after every step: a schedule of hooks.

The loop trains; evaluation, logging, progress and checkpoints are hooks with their own period,
in the manner of levanter's ``trainer.add_hook(fn, every=N)`` and big_vision's ``itstime``. The
GRPO trainer (``loop.Trainer.run``) and the SFT warm start (``sft.run_sft``) both run on it: a
hook that sees a stop request saves a checkpoint and calls :meth:`Hooks.stop`, and the loop ends
after that step. The GRPO trainer's own hooks are named here, each with its state in the open:
``Evaluation``, ``SpikeGuard`` (a gradient-norm spike holds checkpoints back),
``DivergenceCheck`` (too many non-finite updates in a row end the run), ``RewardStallNotice``
and ``Checkpointing``. They see each step as a :class:`StepLog`: what the step produced, typed
(the safety hooks read its fields, not its log keys), and its log line.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from sagc_jax.parallel import any_process

if TYPE_CHECKING:
    from sagc_jax.config import TrainConfig
    from sagc_jax.train.metrics import StepCounts, StepResult
    from sagc_jax.train.safety.faults import StopRequest
    from sagc_jax.train.safety.run_state import RunState


def itstime(step: int, every: int, total: int, *, at_end: bool = True) -> bool:
    """True after step ``step`` (1-based) when ``every`` > 0 divides it, or at the last step."""
    return (every > 0 and step % every == 0) or (at_end and step == total)


@dataclasses.dataclass(frozen=True)
class Hook:
    fn: Callable[[int, Any], None]  # (step, what the step returned: a StepLog, SFT's dict)
    every: int
    at_end: bool


class Hooks:
    """Hooks run in the order added, after each step of a run of ``total`` steps."""

    def __init__(self, total: int):
        self.total = total
        self.stopped = ""  # why a hook ended the run early (a signal's name), "" while it runs
        self._hooks: list[Hook] = []

    def add(self, fn: Callable[[int, Any], None], every: int = 1, at_end: bool = True) -> None:
        """Call ``fn(step, log)`` every ``every`` steps (0: never by period) and, with
        ``at_end``, after the last step."""
        self._hooks.append(Hook(fn, every, at_end))

    def stop(self, why: str) -> None:
        """End the run after the hooks of the current step."""
        self.stopped = why

    def __call__(self, step: int, log: Any) -> None:
        for hook in self._hooks:
            if itstime(step, hook.every, self.total, at_end=hook.at_end):
                hook.fn(step, log)

    def run(self, step: int, train_step: Callable[[int], Any]) -> int:
        """From ``step`` (the number of steps done), call ``train_step(step)`` (it runs that
        step and returns its log), then the hooks, until ``total`` steps are done or a hook
        stops the run. Returns the number of steps done."""
        while step < self.total and not self.stopped:
            log = train_step(step)
            step += 1
            self(step, log)
        return step


class ProgressBar:
    """A tqdm progress bar as a hook: one tick per step, with the postfix ``postfix(step,
    log)`` returns (None: keep the last one). Close it when the run ends."""

    def __init__(
        self,
        desc: str,
        total: int,
        initial: int,
        postfix: Callable[[int, Any], dict[str, Any] | None],
    ):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
        self.postfix = postfix

    def __call__(self, step: int, log: Any) -> None:
        shown = self.postfix(step, log)
        if shown is not None:
            self.bar.set_postfix(**shown)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


# ---------------------------------------------------------------------- the GRPO trainer's hooks


@dataclasses.dataclass(frozen=True)
class StepLog:
    """A GRPO step as its hooks see it: what it produced (``result``, this process's) and its
    counts over every process (``counts``): the safety hooks read these typed fields, so
    renaming a metric cannot silently turn one off; and its log line (``metrics``, one JSONL
    line; the evaluation adds to it)."""

    result: StepResult
    counts: StepCounts
    metrics: dict[str, Any]


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite updates (message is one line)."""


class Evaluation:
    """Evaluates the policy (``evaluate()`` returns the ``eval/*`` values) into the step's
    record and into ``state.last_eval``, which the checkpoints keep."""

    def __init__(self, evaluate: Callable[[], dict[str, float]], state: RunState):
        self.evaluate = evaluate
        self.state = state

    def __call__(self, step: int, log: StepLog) -> None:
        self.state.last_eval = self.evaluate()
        log.metrics.update(self.state.last_eval)


class SpikeGuard:
    """Watches the update's gradient norm: a step whose norm exceeds ``factor`` x the median of the
    last ``window`` steps' (``train.spike_factor``, ``train.spike_window``; factor 0: off)
    holds checkpoints back for ``window`` steps, and each further spike extends the hold."""

    def __init__(self, factor: float, window: int, report: Callable[[str], None]):
        self.factor = factor
        self.window = window
        self.report = report
        self.norms: collections.deque = collections.deque(maxlen=window)
        self.spike_step: int | None = None  # the first spike of the latest stretch
        self.quiet_until = -1  # no checkpoint is written up to this step

    def __call__(self, step: int, log: StepLog) -> None:
        norm = log.result.grad_norm
        # a step without learning signal ran no update (norm 0): nothing to compare
        if not self.factor or not math.isfinite(norm) or norm == 0:
            return
        warm = len(self.norms) >= max(2, self.window // 2)
        baseline = float(np.median(self.norms)) if warm else 0
        self.norms.append(norm)
        if baseline > 0 and norm > self.factor * baseline:
            if self.spike_step is None or step > self.quiet_until:
                self.spike_step = step  # the first spike of this stretch
                self.report(
                    f"step {step}: gradient norm {norm:.3g} is {norm / baseline:.0f}x the "
                    f"median of the last {len(self.norms) - 1} steps (train.spike_factor "
                    f"{self.factor:g}); no checkpoint until {self.window} steps pass "
                    f"without a spike"
                )
            self.quiet_until = step + self.window

    def holds_back(self, step: int) -> bool:
        """True while the checkpoint of ``step`` would hold the weights of a spike."""
        return step <= self.quiet_until


class RewardStallNotice:
    """Says once per run, at the first step that counts one, that a call of the reward function
    ``reward`` on a whole batch ran past ``data.reward_timeout_s`` (``timeout_s``) and its rows
    were then scored one by one: their scores count, but the function stalls on batches."""

    def __init__(self, reward: str, timeout_s: float, report: Callable[[str], None]):
        self.reward = reward
        self.timeout_s = timeout_s
        self.report = report
        self.said = False

    def __call__(self, step: int, log: StepLog) -> None:
        if self.said or not log.counts.reward_batch_timeouts:
            return
        self.said = True
        self.report(
            f"step {step}: reward {self.reward} ran past data.reward_timeout_s = "
            f"{self.timeout_s:g} s on a whole batch, then scored its rows one by one; each such "
            f"batch costs up to twice the limit; counted in reward_batch_timeouts (said once)"
        )


class DivergenceCheck:
    """Raises :class:`TrainingDiverged` when ``limit`` steps in a row skipped their update (loss
    or gradient not finite; ``train.max_nonfinite_steps``), naming the checkpoint to restart
    from: the last saved, from before the spike ``spikes`` saw if there was one."""

    def __init__(self, limit: int, state: RunState, spikes: SpikeGuard):
        self.limit = limit
        self.state = state
        self.spikes = spikes
        self.bad_updates = 0  # consecutive skipped updates

    def __call__(self, step: int, log: StepLog) -> None:
        self.bad_updates = self.bad_updates + 1 if log.result.update_skipped else 0
        if self.bad_updates >= self.limit:
            raise TrainingDiverged(
                f"step {step}: the loss or gradient was not finite in {self.bad_updates} steps "
                f"in a row (train.max_nonfinite_steps); {self._restart_point()}"
            )

    def _restart_point(self) -> str:
        """Where to restart the diverged run from, for its message."""
        last, spike = self.state.last_saved_step, self.spikes.spike_step
        if last is None:
            return "no checkpoint was saved; lower train.learning_rate or check the rewards"
        before = ""
        if spike is not None and spike > last:
            before = f", from before the gradient-norm spike of step {spike},"
        return (
            f"checkpoint step {last}{before} is the last saved: start a new run from it with "
            f"a lower learning rate (--set train.init_checkpoint={self.state.run_dir} --set "
            f"train.learning_rate=... and a new logging.run_dir), or check the rewards"
        )


class Checkpointing:
    """Seals the checkpoints whose write finished, then calls ``save()`` when one is due: every
    ``train.checkpoint_every`` steps, every ``train.checkpoint_minutes`` (all processes save
    when any is due), at the last step, and at a stop request, which then ends the run. A due
    checkpoint (but the last) is skipped, and said, while ``spikes`` holds them back."""

    def __init__(
        self,
        train: TrainConfig,
        state: RunState,
        save: Callable[[], None],
        spikes: SpikeGuard,
        stop: StopRequest,
        hooks: Hooks,
    ):
        self.train = train
        self.state = state
        self.save = save
        self.spikes = spikes
        self.stop = stop
        self.hooks = hooks
        self.last_save = time.perf_counter()

    def __call__(self, step: int, log: StepLog) -> None:
        self.state.store.seal_finished()
        stopping = self.stop.should_stop(step)
        if self._due(step, stopping):
            if self.spikes.holds_back(step) and step < self.train.steps:  # the last is kept
                self.state.report(
                    f"step {step}: checkpoint held back after the gradient-norm spike of step "
                    f"{self.spikes.spike_step} (train.spike_factor); the last one is step "
                    f"{self.state.last_saved_step}"
                )
            else:
                self.save()
                self.last_save = time.perf_counter()
        if stopping:
            self.hooks.stop(self.stop.name)

    def _due(self, step: int, stopping: bool) -> bool:
        t, minutes = self.train, self.train.checkpoint_minutes
        return (
            itstime(step, t.checkpoint_every, t.steps)
            or stopping
            # clocks differ between processes: all save when any is due
            or any_process(minutes and time.perf_counter() - self.last_save >= 60 * minutes)
        )
