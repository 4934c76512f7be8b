"""Orbax checkpoints of a training run: arrays through ``StandardSave``, the rest as JSON.

A checkpoint at step s holds named pytrees of arrays (``params``, ``opt_state``) and ``meta``
(JSON: the controller's state dict, data position, RNG key data, step, resolved config). Orbax
writes each step into a temporary directory and renames it when complete, so a crash mid-write
never leaves a checkpoint that ``latest_step`` would pick up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

_ARRAY_TAG = "__ndarray__"


def to_json_tree(value: Any) -> Any:
    """numpy arrays and scalars -> JSON-able data that :func:`from_json_tree` restores exactly."""
    if isinstance(value, np.ndarray):
        return {_ARRAY_TAG: value.tolist(), "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): to_json_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_tree(v) for v in value]
    return value


def from_json_tree(value: Any) -> Any:
    if isinstance(value, dict):
        if _ARRAY_TAG in value:
            arr = np.array(value[_ARRAY_TAG], dtype=value["dtype"])
            return arr.reshape(value["shape"])
        return {k: from_json_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json_tree(v) for v in value]
    return value


class CheckpointStore:
    """Saves and restores run state under ``directory`` (keeps the newest ``keep``)."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, items: dict[str, Any], meta: dict[str, Any]) -> None:
        """Write step ``step``: each of ``items`` (name -> pytree of arrays) and ``meta`` (JSON).

        Asynchronous: :meth:`wait` (or the next save) completes it.
        """
        args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
        args["meta"] = ocp.args.JsonSave(to_json_tree(meta))
        self.manager.save(step, args=ocp.args.Composite(**args), force=True)

    def restore(self, step: int, targets: dict[str, Any]) -> tuple[dict[str, Any], dict]:
        """(items named in ``targets``, each shaped like its target; meta) of step ``step``.

        Items of the checkpoint not named in ``targets`` are not read.
        """
        args = {name: ocp.args.StandardRestore(t) for name, t in targets.items()}
        args["meta"] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**args))
        items = {name: restored[name] for name in targets}
        return items, from_json_tree(restored["meta"])

    def read_meta(self, step: int) -> dict[str, Any]:
        """Only the JSON part of checkpoint ``step`` (cheap: no arrays are read)."""
        path = self.directory / str(step) / "meta" / "metadata"
        return from_json_tree(json.loads(path.read_text()))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
