"""Per-step metrics: made from what a step produced (``step_record``), written as one JSONL line
(the simulator's replay format) and TensorBoard scalars, and read back (``read_metrics``) into
the run's summary (``summarize``). Reading them back does not import jax."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from sagc_jax.controller import GroupController, StepObservation
    from sagc_jax.programs.tail import TailBatcher
    from sagc_jax.train.rollout import Rollouts


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one train step produced, this process's rows (``step_record`` makes the log line of
    it)."""

    step: int  # steps done, this one included
    group_size: int | np.ndarray  # G, or int64 [P] per-prompt sizes (hybrid per_prompt)
    batch: Rollouts  # the rows trained on (informative groups of every round)
    rounds: list[Rollouts]  # every sampling round, as sampled
    update_rows: int  # packed rows (or one per trained rollout, unpacked)
    trained: np.ndarray  # bool [N] rollouts of ``batch`` the update trained
    advantages: np.ndarray  # float32 [N] of ``batch``
    rewards: np.ndarray  # float32 [N] shaped rewards of ``batch``
    zero_variance_p: np.ndarray  # bool [P] groups whose rewards were all equal
    update: dict[str, float]  # the update program's metrics
    controller: dict[str, Any]  # what the controller's observe() returned
    observation: StepObservation  # every process's rollouts of every round, as it observed them
    clock: dict[str, float]  # when the stages ended: start, sampled, packed, updated, end

    @property
    def grad_norm(self) -> float:
        """The update's global gradient norm (0.0: no update ran, the step had no signal)."""
        return float(self.update["grad_norm"])

    @property
    def update_skipped(self) -> bool:
        """Whether the update ran but was not applied: its loss or gradient was not finite."""
        return self.update["skipped"] > 0


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """A step's counts over every process (``step_counts``): reward faults and tokens."""

    reward_failed_rows: int  # rows whose reward raised or returned no number
    reward_timeouts: int  # rows whose reward ran past data.reward_timeout_s
    reward_batch_timeouts: int  # calls on a whole batch past the limit, then scored row by row
    prompt_tokens: int  # real prompt tokens of the step's rollouts
    trained_tokens: int  # real completion tokens of the step's rollouts
    rollouts_trained: int  # rollouts the update ran on
    rollouts_without_signal: int  # rollouts of advantage 0


def step_counts(result: StepResult) -> StepCounts:
    """``result``'s counts summed over every process (a collective: every process calls it)."""
    from sagc_jax.parallel import gather_rows  # here: reading metrics back stays free of jax

    local = [
        sum(len(r.failed_rows) for r in result.rounds),
        sum(len(r.timed_out_rows) for r in result.rounds),
        sum(r.batch_timeouts for r in result.rounds),
        int(result.batch.prompt_lens.sum()),
        int(result.batch.lengths.sum()),
        int(result.trained.sum()),
        int(np.sum(result.advantages == 0)),
    ]
    return StepCounts(*(int(n) for n in gather_rows(np.array([local])).sum(axis=0)))


def step_record(
    result: StepResult,
    counts: StepCounts,
    controller: GroupController,
    tail: TailBatcher | None,
    *,
    epochs: int,
    compiles: dict[str, int],
) -> dict[str, Any]:
    """The step's metrics (one JSONL line, docs/metrics.md), over every process's rows (a
    collective: every process calls it). ``controller`` and ``tail`` (None: tail batching off)
    add their own keys; ``epochs``: passes over the update batch; ``compiles``: programs
    compiled so far (``sampler``, ``update``)."""
    from sagc_jax.controller import varied_groups
    from sagc_jax.parallel import gather_rows  # here: reading metrics back stays free of jax
    from sagc_jax.train.rollout import Rollouts

    batch, ctrl, obs, clock = result.batch, result.controller, result.observation, result.clock
    lengths = obs.lengths_b  # every process's, every round
    all_rounds = Rollouts.concat(result.rounds)
    rewards = gather_rows(result.rewards)
    t_rollout = clock["sampled"] - clock["start"]
    t_update = clock["updated"] - clock["packed"]
    total = clock["end"] - clock["start"]
    generated = int(lengths.sum())
    sizes_p = gather_rows(batch.group_sizes)
    g = result.group_size
    record = {
        "reward": float(rewards.mean()),
        "reward_raw": float(gather_rows(batch.rewards).mean()),
        "accuracy": float(np.mean(obs.rewards_b >= 1.0)),
        "length/mean": float(lengths.mean()),
        "length/max": int(lengths.max()),
        "length/min": int(lengths.min()),
        "length/median": float(np.median(lengths)),
        "length/trained_mean": counts.trained_tokens / len(rewards),
        "truncated_frac": float(gather_rows(all_rounds.truncated).mean()),
        "group_size": g if np.ndim(g) == 0 else float(sizes_p.mean()),
        "prompts": len(sizes_p),
        "rounds": len(result.rounds),
        "zero_variance_frac": float(np.mean(gather_rows(result.zero_variance_p))),
        "reward_failed_rows": counts.reward_failed_rows,
        "reward_timeouts": counts.reward_timeouts,
        "reward_batch_timeouts": counts.reward_batch_timeouts,
        "controller/lambda": ctrl.get("lambda", 0.0),
        "controller/s_t": ctrl["s_t"],
        "controller/straggler_rate": ctrl["straggler_rate"],
        "controller/max_ratio": ctrl["max_ratio"],
        "padding_waste": ctrl["padding_waste"],
        "decode_steps": all_rounds.decode_steps,
        "decode/rows_per_step": all_rounds.rows_decoded / max(all_rounds.decode_steps, 1),
        "decode/padding_share": 1.0
        - all_rounds.live_rows_decoded / max(all_rounds.rows_decoded, 1),
        "time/rollout_s": t_rollout,
        "time/update_s": t_update,
        "time/step_s": total,
        "throughput/rollout_tokens_per_s": generated / max(t_rollout, 1e-9),
        "throughput/tokens_per_s": generated / max(total, 1e-9),
        # real prompt + completion tokens of the update batch, per second of update
        "throughput/update_tokens_per_s": (counts.prompt_tokens + counts.trained_tokens)
        * epochs
        / max(t_update, 1e-9),
        **{f"compiles/{kind}": count for kind, count in compiles.items()},
        "update_rows": result.update_rows,  # packed rows (or one per trained rollout, unpacked)
        "update/rollouts_trained": counts.rollouts_trained,
        "update/rollouts_without_signal": counts.rollouts_without_signal,
        **{f"update/{k}": v for k, v in result.update.items()},
        "group_ratios": ctrl["group_ratios"],
        "lengths": [  # group by group, every round
            group.tolist() for group in np.split(lengths, np.cumsum(obs.sizes_p)[:-1])
        ],
        # the same groups: 1 where the shaped rewards differ (advantages not all 0)
        "group_signal": varied_groups(gather_rows(_shaped(all_rounds)), obs.sizes_p)
        .astype(int)
        .tolist(),
        "prompt_tokens": counts.prompt_tokens // len(rewards),
    }
    if obs.rewards_b is not None:  # the reward function's scores, grouped as ``lengths``
        record["rewards"] = [
            group.tolist() for group in np.split(obs.rewards_b, np.cumsum(obs.sizes_p)[:-1])
        ]
    if obs.prompt_ids_p is not None:  # the groups' prompts, as the data source numbers them
        record["prompt_ids"] = obs.prompt_ids_p.tolist()
    if np.ndim(g):
        record["group_sizes"] = sizes_p
    record.update(controller_metrics(ctrl, controller))
    if tail is not None:
        record.update(_tail_metrics(tail, ctrl, result.step))
    if result.update.get("skipped", 0) > 0:
        record["warning"] = "non-finite loss or gradient: update skipped"
    return record


def _shaped(rollouts: Rollouts) -> np.ndarray:
    """float [N]: the rewards advantages are computed from (after shaping, where shaped)."""
    return rollouts.rewards if rollouts.shaped is None else rollouts.shaped


def controller_metrics(ctrl: dict[str, Any], controller: GroupController) -> dict[str, Any]:
    """The keys only some controllers have, those their class names (``logged_metrics``): ``ctrl``
    is what the step's observation returned."""
    record = {
        f"controller/{key}": ctrl[key]
        for key in controller.logged_metrics
        if ctrl.get(key) is not None
    }
    calibration = controller.calibration()  # None: the controller predicts no straggle
    if calibration is not None:
        # the step's mean predicted straggle (made before sampling) beside the observed s_t,
        # and the running calibration of every group so far
        record["controller/predicted_s_t"] = ctrl.get("predicted_s_t", math.nan)
        record["controller/calibration_ece"] = calibration["ece"]
        record["controller/calibration_brier"] = calibration["brier"]
    return record


def _tail_metrics(tail: TailBatcher, ctrl: dict[str, Any], step: int) -> dict[str, Any]:
    """Tail batching's keys after ``step`` steps (a collective); every process starts and
    defers as many prompts."""
    import jax

    from sagc_jax.parallel import gather_rows

    last, processes = tail.last, jax.process_count()
    return {
        "tail/long_round": last["long"],
        "tail/prompts_started": last["started"] * processes,
        "tail/deferred": last["deferred"] * processes,
        "tail/waited_max": int(gather_rows(np.array([last["waited"]])).max()),
        "tail/queue": len(tail.queue) * processes,
        "tail/queue_oldest": tail.oldest(step),
        "tail/long_rounds": tail.long_rounds,
        "tail/censored_groups": ctrl.get("censored_groups", 0),
        "tail/censored_stragglers": ctrl.get("censored_stragglers", 0),
    }


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


_write = os.write  # the seam the full-disk tests patch


def no_space_on(err: BaseException, directory: Path) -> str | None:
    """ "no space left on DIR (the disk mounted at MOUNT)" (or "disk quota exceeded on ...")
    when ``err`` is a lack of space; None for any other error."""
    from sagc_jax.train.safety.disk import mount_point, space_errno

    code = space_errno(err)
    if code is None:
        return None
    why = "disk quota exceeded" if code == errno.EDQUOT else "no space left"
    return f"{why} on {directory} (the disk mounted at {mount_point(directory)})"


def full_disk_error(err: OSError, path: Path, what: str) -> Exception | None:
    """A write of ``path`` that failed for lack of space as one line for the command line
    (``what``: when, and what became of the log); None for any other error."""
    from sagc_jax.train.safety.runlock import RunDirError

    if (where := no_space_on(err, path.parent)) is None:
        return None
    return RunDirError(
        f"{where} {what}; free space, then run the same command to resume from the last checkpoint"
    )


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
        self._fd: int | None = None
        self._tb = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            self._rewrite("".join(_lines_up_to(self.path, resume_step, report)), resume_step)
        # unbuffered: a line is written whole or (cut short by a full disk) taken back
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def _rewrite(self, text: str, resume_step: int) -> None:
        """Replace the log with ``text`` (a resume drops the steps to redo): into a sibling,
        renamed over it, so a full disk leaves the old log whole."""
        partial = self.path.with_name(self.path.name + ".tmp")
        try:
            partial.write_text(text)
            os.replace(partial, self.path)
        except OSError as err:
            partial.unlink(missing_ok=True)
            what = (
                f"while trimming {self.path.name} to step {resume_step} to resume: it is unchanged"
            )
            if (line := full_disk_error(err, self.path, what)) is None:
                raise
            raise line from None

    def _append(self, data: bytes, step: int) -> None:
        start = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[_write(self._fd, view) :]
        except OSError as err:
            os.ftruncate(self._fd, start)  # nothing torn: the log ends with its last whole line
            what = f"while logging step {step} to {self.path.name}: the line was not kept"
            if (line := full_disk_error(err, self.path, what)) is None:
                raise
            raise line from None

    def write(self, step: int, record: dict[str, Any], candidates: tuple[int, ...] = ()) -> None:
        """Log one step. Lists (lengths, ratios) go to JSONL only; numbers also to TensorBoard."""
        if not self.enabled:
            return
        line = {"step": step, **{k: _plain(v) for k, v in record.items()}}
        self._append((json.dumps(line) + "\n").encode(), step)
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

    def text(self, tag: str, markdown: str, step: int) -> None:
        """``markdown`` in TensorBoard's text tab under ``tag`` at ``step`` (when it is on).
        Other threads may call it: tensorboardX queues its events."""
        if self._tb is not None:
            self._tb.add_text(tag, markdown, step)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
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
        "no_signal_steps": int(sum(r.get("update/no_signal", 0) for r in steps)),
        **{k: float(v) for k, v in last.items() if k.startswith("eval/") and v is not None},
    }
