"""What a run's checkpoints hold, and the rules for continuing one.

A checkpoint of step s holds the params and optimizer state, the hybrid controller's per-prompt
table (an Orbax item), and JSON meta: the step, the controller's state, the resolved config, the
last evaluation, the process count, the data files' identities, the LoRA base's identity and the
tail batcher's queue. A resume takes the newest checkpoint that verifies (see
``CheckpointStore``) and refuses, in one line, a config that differs on a key that shapes the
run, another process count on a sharded dataset, another LoRA base, or data files changed since.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from sagc_jax.config import Config, ConfigError, changed_keys, to_dict
from sagc_jax.controller import GroupController
from sagc_jax.parallel import gather_rows
from sagc_jax.programs.tail import TailBatcher
from sagc_jax.tasks.source import SOURCES
from sagc_jax.train.lora_base import check_same_base
from sagc_jax.train.safety.checkpoint import CheckpointStore
from sagc_jax.train.safety.faults import crash_point, resume_hint

# The hybrid controller's per-prompt table: its state keys whose arrays (one row per prompt) are
# saved as an Orbax item padded to controller.hybrid.capacity rows, not in the JSON meta.
PROMPT_TABLE = "predictor_table_"


class RunState:
    """The checkpoints of one RL run in ``run_dir/checkpoints``: saving one, resuming from the
    newest, and the checks a resume makes. The controller's and the tail batcher's state are
    saved from and restored into the objects given; the last evaluation and the last step
    saved are kept here. ``data_id``: the data files' identities (``data_identity``) and
    ``base_id``: the LoRA base's (``base_identity``; None without LoRA), taken when they were
    read: the checkpoints record them and a resume compares them."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        controller: GroupController,
        tail: TailBatcher | None,
        *,
        data_id: dict[str, dict],
        base_id: dict | None,
        report: Callable[[str], None],
    ):
        t = cfg.train
        self.cfg = cfg
        self.run_dir = run_dir
        self.controller = controller
        self.tail = tail
        self.report = report
        self.store = CheckpointStore(
            run_dir / "checkpoints", keep=t.keep_checkpoints, async_save=t.async_checkpoint
        )
        self.data_id = data_id
        self.base_id = base_id  # LoRA: the weights under the adapters are named, not saved
        self.last_eval: dict[str, float] = {}
        self.last_saved_step: int | None = None

    def resume(self, params: Any, opt_state: Any) -> tuple[int, Any, Any] | None:
        """(step, params, opt_state) of the newest checkpoint that verifies (older ones are
        tried when the newest is damaged), the controller and tail batcher restored to it; None
        when the run has none. ``params`` and ``opt_state`` give the shapes and shardings."""
        targets = {"params": params, "opt_state": opt_state}
        _, table = self._controller_state()
        if table:
            targets["prompt_table"] = table  # a fresh table: the saved one's shapes and dtypes
        restored = self.store.restore_newest(
            targets, check_meta=self.check_resumable, report=self.report
        )
        if restored is None:
            return None
        self.last_saved_step, items, meta = restored
        state = dict(meta["controller"])
        rows = int(state.get(f"{PROMPT_TABLE}size", 0))
        state.update({k: np.asarray(v)[:rows] for k, v in items.get("prompt_table", {}).items()})
        self.controller.load_state_dict(state)
        if self.tail is not None:
            self.tail.load_state_dict(meta["tail_batching"], jax.process_index())
        self.last_eval = meta.get("last_eval", {})
        return int(meta["step"]), items["params"], items["opt_state"]

    def check_resumable(self, meta: dict) -> None:
        """Raise ConfigError when the run in ``meta`` cannot continue under this config."""
        changed = changed_keys(_as_resolved(meta["config"], self.cfg), self.cfg, "unresumable")
        processes = meta.get("processes", 1)
        if SOURCES[self.cfg.data.task].sharded and processes != jax.process_count():
            raise ConfigError(
                f"{self.run_dir}: cannot resume with {jax.process_count()} processes a run of "
                f"{processes}: each process reads its own shard of the dataset, so the prompt "
                f"order would change; use {processes} processes or a new logging.run_dir"
            )
        if changed:
            raise ConfigError(
                f"{self.run_dir}: cannot resume, the config differs from the run's in "
                f"{', '.join(changed[:8])}{'...' if len(changed) > 8 else ''}; use a new "
                f"logging.run_dir or the run's own config"
            )
        if self.base_id is not None:
            check_same_base(meta.get("base"), self.base_id, meta["step"])
        self._check_same_data(meta)

    def _check_same_data(self, meta: dict) -> None:
        """Refuse (ConfigError) a resume whose data files changed since the checkpoint, unless
        ``train.resume_changed_data``; checkpoints from before data identities were recorded
        are not checked."""
        for key, saved in meta.get("data", {}).items():
            now = self.data_id.get(key)
            if now is None or now["sha256"] == saved["sha256"]:
                continue  # the key itself changing is a config difference, refused above
            step = meta["step"]
            what = (
                f"{now['path']}: changed since the checkpoint of step {step} ({key}: "
                f"{saved['size']:,} -> {now['size']:,} bytes, sha256 {saved['sha256'][:12]} -> "
                f"{now['sha256'][:12]})"
            )
            if not self.cfg.train.resume_changed_data:
                raise ConfigError(
                    f"{what}; resuming would continue at the same position on other rows: "
                    f"restore the file, use a new logging.run_dir, or set "
                    f"train.resume_changed_data=true to continue at step {step} on the new "
                    f"contents"
                )
            self.report(
                f"{what}; continuing at step {step} on the new contents "
                f"(train.resume_changed_data): the prompts of the next steps are the new file's "
                f"rows at the saved position"
            )

    def _controller_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The controller's state split in two: for the JSON meta, and the hybrid's per-prompt
        table (``PROMPT_TABLE`` arrays padded to ``controller.hybrid.capacity`` rows; empty for
        the other controllers) for an Orbax item."""
        state = self.controller.state_dict()
        table = {k: v for k, v in state.items() if k.startswith(PROMPT_TABLE) and np.ndim(v) == 1}
        capacity = self.cfg.controller.hybrid.capacity
        padded = {k: np.pad(v, (0, capacity - len(v))) for k, v in table.items()}
        return {k: v for k, v in state.items() if k not in table}, padded

    def save(self, step: int, params: Any, opt_state: Any) -> None:
        """Checkpoint the run after ``step`` steps (a collective: every process calls it); said
        in one line and skipped when the params or optimizer state are not finite."""
        controller, table = self._controller_state()
        meta = {
            "step": step,
            "controller": controller,
            "config": to_dict(self.cfg),
            "last_eval": self.last_eval,
            "processes": jax.process_count(),
            "data": self.data_id,
        }
        if self.base_id is not None:
            meta["base"] = self.base_id
        if self.tail is not None:  # every process's queue (a collective)
            queue = self.tail.queue_array()  # as long on every process
            queues = gather_rows(queue) if len(queue) else queue
            meta["tail_batching"] = self.tail.state_dict(queues)
        items = {"params": params, "opt_state": opt_state}
        if table:
            items["prompt_table"] = table
        hint = resume_hint(self.cfg, self.run_dir)
        if not self.store.save(step, items, meta, report=self.report, resume_hint=hint):
            self.report(
                f"step {step}: parameters or optimizer state not finite, checkpoint not "
                f"written (the last one is step {self.last_saved_step})"
            )
            return
        self.last_saved_step = step
        crash_point("checkpoint", step)  # the write is in flight (asynchronous)


def _as_resolved(saved: dict, cfg: Config) -> dict:
    """A saved config with ``cfg``'s (resolved) prompt buckets where it says "auto": runs save
    their config resolved, but checkpoints from before 2026-12-06 hold the buckets as given,
    and "auto" resolves from the same data (whose identity is checked apart)."""
    sampling = saved.get("sampling", {})
    if sampling.get("prompt_buckets") != "auto":
        return saved
    buckets = list(cfg.sampling.prompt_buckets)
    return {**saved, "sampling": {**sampling, "prompt_buckets": buckets}}
