"""Per-step metrics: one JSONL line (the simulator's replay format) and TensorBoard scalars,
written; and read back (``read_metrics``) into the run's summary (``summarize``)."""

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


# ---------------------------------------------------------------------- reading it back


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(step records, evaluation records) of a run; a torn last line (crash) is ignored."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is it a sagc-jax train run?)")
    steps, evals = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "group_size" in record:
            steps.append(record)
        if "eval/accuracy" in record:
            evals.append(record)
    return steps, evals


def summarize(steps: list[dict], evals: list[dict]) -> dict:
    """One row over every step logged (all segments of a resumed run): wall-clock, rollout
    share, straggler rate, mean G, lengths, and the last evaluation's ``eval/*`` values."""
    if not steps:
        return {"steps": 0}
    step_s = np.array([r["time/step_s"] for r in steps])
    rollout_s = np.array([r["time/rollout_s"] for r in steps])
    last = evals[-1] if evals else {}
    return {
        "steps": int(steps[-1]["step"]),
        "wall_clock_s": float(step_s.sum()),
        "rollout_share": float(rollout_s.sum() / max(step_s.sum(), 1e-9)),
        "straggler_rate": float(np.mean([r["controller/s_t"] for r in steps])),
        "mean_G": float(np.mean([r["group_size"] for r in steps])),
        "mean_length": float(np.mean([r["length/mean"] for r in steps])),
        "reward": float(np.mean([r["reward"] for r in steps[-10:]])),
        **{k: float(v) for k, v in last.items() if k.startswith("eval/") and v is not None},
    }
