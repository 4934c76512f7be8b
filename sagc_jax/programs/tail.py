"""On-policy tail batching (``tail_batching``; docs/controller.md, "Tail batching"): which prompts
a step starts, which of its groups it trains, and the queue of the prompts it cut.

A tail step starts groups for ``P + extra`` prompts at the controller's G (each process its
share, every process the same number) and the sampler stops as soon as every process has ``P``
groups whose rollouts have all finished (``Sampler(keep_groups=)``). Each process trains its
first ``P`` whole groups, in data order; its other prompts, cut or surplus, join the back of its
deferred queue. A long round trains the ``P`` oldest deferred prompts (fresh ones fill it when
fewer wait) and waits for all of its groups: it runs when a whole step's prompts wait, or every
``long_round_every`` steps when any wait. Fresh prompts come from a data cursor (the global
position of the next one), so every prompt of the data order is started once and trained once:
in its tail step, or later in a long round. Every process defers as many prompts per step as
the others, so the queues stay the same length and the processes agree on which kind of step
comes next. The queue and the cursor are part of the checkpoint (:meth:`TailBatcher.state_dict`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from sagc_jax.config import TailBatchingConfig
from sagc_jax.tasks.prompt_source import Prompt, PromptSource


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A prompt waiting for a long round: its shard position, the step it was drawn for (its
    prompt is a function of both) and the step that cut it."""

    position: int
    drawn: int
    since: int


@dataclasses.dataclass(frozen=True)
class TailRound:
    """What a step samples: this process's prompts, their entries, and the sampler's exit test
    (``keep_groups`` whole groups per process; 0: wait for every group, a long round)."""

    prompts: list[Prompt]
    entries: list[Deferred]  # one per prompt (``since`` = the step for a fresh prompt)
    keep_groups: int

    @property
    def long(self) -> bool:
        return self.keep_groups == 0


class TailBatcher:
    """The deferred queue and data cursor of one process (see the module docstring)."""

    def __init__(self, cfg: TailBatchingConfig, processes: int):
        self.cfg = cfg
        self.processes = processes
        self.cursor = 0  # global data position of the next fresh prompt
        self.queue: list[Deferred] = []  # this process's, oldest first
        self.long_rounds = 0
        self.last: dict[str, int] = {}  # the last settled round, this process's (for its log)

    def _fresh(self, source: PromptSource, count: int, step: int) -> list[Deferred]:
        """``count`` fresh prompts per process from the cursor (advanced)."""
        positions = source.positions(self.cursor, count * self.processes)
        self.cursor += count * self.processes
        return [Deferred(p, step, step) for p in positions]

    def shape(self, prompts: int) -> tuple[int, int]:
        """``(trained, extra)``: the groups a step of ``prompts`` prompts (every process's)
        trains on each process, and the prompts a tail step starts beyond them."""
        local = prompts // self.processes
        return local, math.ceil(self.cfg.extra * local)

    def next_round(self, source: PromptSource, step: int, prompts: int) -> TailRound:
        """The round step ``step`` samples for ``prompts`` prompts trained (every process's;
        ``train.batch_mode: budget`` makes it depend on G): advances the cursor, takes from the
        queue."""
        local, extra = self.shape(prompts)
        every = self.cfg.long_round_every
        long = len(self.queue) >= local or (every and self.queue and step % every == 0)
        if long:
            entries, self.queue = self.queue[:local], self.queue[local:]
            entries += self._fresh(source, local - len(entries), step)
            keep = 0
        else:
            entries, keep = self._fresh(source, local + extra, step), local
        prompts = [source.prompt_at(e.position, e.drawn) for e in entries]
        return TailRound(prompts, entries, keep)

    def settle(self, round_: TailRound, cut_p: np.ndarray, step: int) -> np.ndarray:
        """The groups (int64 indices into the round's prompts) the step trains, given which
        groups were cut (bool [prompts], this process's); the others join the queue."""
        waited = max((step - e.since for e in round_.entries), default=0)
        self.last = {"long": int(round_.long), "started": len(round_.entries), "waited": waited}
        if round_.long:
            self.long_rounds += 1
            if cut_p.any():
                raise RuntimeError(f"step {step}: a long round came back with cut groups")
            self.last["deferred"] = 0
            return np.arange(len(round_.entries), dtype=np.int64)
        whole = np.flatnonzero(~np.asarray(cut_p, bool))
        if whole.size < round_.keep_groups:
            raise RuntimeError(
                f"step {step}: {whole.size} whole groups on this process, the sampler's exit "
                f"test promised {round_.keep_groups}"
            )
        kept = whole[: round_.keep_groups]
        deferred = np.setdiff1d(np.arange(len(round_.entries)), kept)
        self.last["deferred"] = len(deferred)
        self.queue += [dataclasses.replace(round_.entries[i], since=step) for i in deferred]
        return kept

    def oldest(self, step: int) -> int:
        """Steps the oldest queued prompt has waited (0: the queue is empty)."""
        return step - self.queue[0].since if self.queue else 0

    # ------------------------------------------------------------------ state

    def queue_array(self) -> np.ndarray:
        """This process's queue as int64 [Q, 3] (position, drawn, since)."""
        return np.array([dataclasses.astuple(e) for e in self.queue], np.int64).reshape(-1, 3)

    def state_dict(self, queues: np.ndarray) -> dict[str, Any]:
        """JSON-able state, given every process's queue (int64 [processes x Q, 3], process by
        process: ``gather_rows`` of :meth:`queue_array`)."""
        return {
            "cursor": self.cursor,
            "long_rounds": self.long_rounds,
            "queues": np.asarray(queues, np.int64).reshape(self.processes, -1, 3).tolist(),
        }

    def load_state_dict(self, state: dict[str, Any], process: int) -> None:
        queues = state["queues"]
        if len(queues) != self.processes:
            raise ValueError(
                f"the checkpoint's deferred queues are of {len(queues)} processes; this run has "
                f"{self.processes}: resume it with {len(queues)}"
            )
        self.cursor = int(state["cursor"])
        self.long_rounds = int(state["long_rounds"])
        self.queue = [Deferred(*map(int, e)) for e in queues[process]]
