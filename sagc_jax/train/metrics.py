"""Per-step metrics: one JSONL line (the simulator's replay format) and TensorBoard scalars."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _lines_up_to(path: Path, step: int, report) -> list[str]:
    """The lines of ``path`` that log steps up to ``step`` (none when ``step`` is 0)."""
    keep = []
    for number, line in enumerate(path.read_text().splitlines(keepends=True), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            report(f"{path}:{number}: dropped a torn line ({len(line)} bytes, a cut write)")
            continue
        if 0 < step and record.get("step", 0) <= step:
            keep.append(line if line.endswith("\n") else line + "\n")
    return keep


class MetricsWriter:
    """Appends ``metrics.jsonl`` and writes TensorBoard event files into ``run_dir``.

    Only the process that should log (process 0) creates one with ``enabled=True``; the others
    get a writer that does nothing, so call sites need no checks.
    """

    def __init__(
        self,
        run_dir: str | Path,
        enabled: bool = True,
        tensorboard: bool = True,
        resume_step: int = 0,
        report=print,
    ):
        """``resume_step``: the step the run continues from; logged steps after it (written
        before a crash, and about to be redone) are dropped from both logs, and so is a line
        torn by a crash or a full disk (said through ``report``)."""
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        if path.exists():
            path.write_text("".join(_lines_up_to(path, resume_step, report)))
        self._jsonl = path.open("a")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def write(self, step: int, record: dict[str, Any], candidates: tuple[int, ...] = ()) -> None:
        """Log one step. Lists (lengths, ratios) go to JSONL only; numbers also to TensorBoard."""
        if not self.enabled:
            return
        line = {"step": step, **{k: _plain(v) for k, v in record.items()}}
        self._jsonl.write(json.dumps(line) + "\n")
        self._jsonl.flush()
        if self._tb is None:
            return
        for key, value in record.items():
            if isinstance(value, bool):
                value = float(value)
            if isinstance(value, int | float | np.generic) and math.isfinite(float(value)):
                self._tb.add_scalar(key, float(value), step)
        posterior = record.get("controller/posterior_mean")
        if posterior is not None:
            for g, p in zip(candidates, np.asarray(posterior).tolist(), strict=False):
                self._tb.add_scalar(f"controller/posterior_mean_G{g}", p, step)
        self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
