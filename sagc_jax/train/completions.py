"""A run's completions as text, for reading beside its metrics.

Every ``logging.completions_every`` steps (and at the last) each process writes the rollouts of
its share of a sample of the step's groups (``logging.completions_groups``) to
``RUN/completions/step-NNNNNN.pI.jsonl``: one JSON object per completion, with its prompt, its
text, its rewards and advantage (docs/metrics.md, "Completions"); process 0 also puts a
markdown table of one group in TensorBoard's text tab. The files of a step, or of a run, read
as one table (``read_completions``, or one line of pandas).

The texts were decoded for the reward already; making the rows and writing them runs on a
background thread, flushed before each checkpoint and at the end. A step's file is written
whole (a sibling renamed over it): a resumed run that redoes a step replaces its rows, and the
files of steps after the checkpoint it resumes from are removed when it starts. A folder that
cannot be written, or a full disk, costs one warning and the run's later completions, nothing
else. Reading them back does not import jax.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from sagc_jax.config import LoggingConfig
    from sagc_jax.train.hooks import StepLog
    from sagc_jax.train.metrics import StepResult

FOLDER = "completions"  # under the run directory
_STEP_FILE = re.compile(r"step-(\d+)\.p(\d+)\.jsonl")


def step_file(step: int, process: int) -> str:
    """The name of process ``process``'s file of step ``step``."""
    return f"step-{step:06d}.p{process}.jsonl"


def readable(text: str | bytes) -> str:
    """``text`` as valid UTF-8: bytes decoded, and the lone surrogates a tokenizer leaves for
    bytes that are not UTF-8 written as escapes (``\\udcff``)."""
    if isinstance(text, bytes):
        return text.decode("utf-8", "backslashreplace")
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def capped(text: str | bytes, chars: int) -> str:
    """``text`` (made :func:`readable`) when at most ``chars`` characters long; else its first
    and last ``chars // 2`` characters around a marker that says how many were cut."""
    text = readable(text)
    if len(text) <= chars:
        return text
    head = chars // 2
    return f"{text[:head]} [... {len(text) - chars} characters cut ...] {text[head - chars :]}"


def _number(x) -> float | None:
    """A float for JSON; None (null) when not finite."""
    x = float(x)
    return x if math.isfinite(x) else None


def sampled_groups(
    step: int, local_groups: int, process: int, processes: int, groups: int, seed: int
) -> np.ndarray:
    """int64 [k]: this process's groups (indices into its batch) among ``groups`` drawn at
    random (0: every group) from every process's ``local_groups`` each. The draw is the same
    on every process (seeded by ``seed`` and ``step``, apart from the run's own keys), so the
    processes' files of a step hold ``groups`` groups between them."""
    total = local_groups * processes
    if groups == 0 or groups >= total:
        chosen = np.arange(total)
    else:
        chosen = np.sort(np.random.default_rng([seed, step]).choice(total, groups, replace=False))
    first = process * local_groups
    return chosen[(chosen >= first) & (chosen < first + local_groups)] - first


def completion_rows(
    result: StepResult, groups_p: np.ndarray, *, first_group: int, process: int, chars: int
) -> list[dict[str, Any]]:
    """One row per completion of the groups ``groups_p`` (indices into this process's batch)
    of the step ``result``, texts capped at ``chars`` characters (docs/metrics.md,
    "Completions", names the fields). ``first_group``: the index of this process's first group
    among every process's."""
    batch = result.batch
    starts_p = np.cumsum(batch.group_sizes) - batch.group_sizes
    g = result.group_size  # the controller's decision: one G, or per-prompt sizes [P]
    step_g = int(g) if np.ndim(g) == 0 else _number(np.mean(g))
    rows = []
    for p in np.asarray(groups_p, np.int64):
        prompt, start, size = batch.prompts[p], int(starts_p[p]), int(batch.group_sizes[p])
        prompt_text, answer = capped(prompt.text, chars), capped(prompt.answer, chars)
        for sample, r in enumerate(range(start, start + size)):
            rows.append(
                {
                    "step": result.step,
                    "process": process,
                    "group": first_group + int(p),
                    "sample": sample,
                    "G": size,
                    "step_G": step_g,
                    "prompt_id": int(prompt.id),
                    "prompt_text": prompt_text,
                    "prompt_tokens": int(batch.prompt_lens[r]),
                    "completion_text": capped(batch.texts[r], chars),
                    "length": int(batch.lengths[r]),
                    "answer": answer,
                    "reward_raw": _number(batch.rewards[r]),
                    "reward": _number(result.rewards[r]),
                    "advantage": _number(result.advantages[r]),
                    "trained": bool(result.trained[r]),
                    "truncated": bool(batch.truncated[r]),
                }
            )
    return rows


def markdown_table(rows: list[dict[str, Any]], chars: int = 240) -> str:
    """The first group of ``rows`` as markdown for TensorBoard's text tab: its prompt, then a
    table of its completions (texts cut at ``chars`` characters, on one line)."""

    def cell(text: str) -> str:
        return capped(text, chars).replace("|", "\\|").replace("\n", " ⏎ ")

    group = [row for row in rows if row["group"] == rows[0]["group"]]
    first = group[0]
    lines = [
        f"group {first['group']}, prompt {first['prompt_id']}, G = {first['G']}: "
        f"`{cell(first['prompt_text'])}` (answer `{cell(first['answer'])}`)",
        "",
        "| sample | tokens | reward | advantage | trained | completion |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in group:
        reward, advantage = row["reward"], row["advantage"]
        lines.append(
            f"| {row['sample']} | {row['length']}{' (cut)' if row['truncated'] else ''} "
            f"| {reward if reward is None else f'{reward:.3g}'} "
            f"| {advantage if advantage is None else f'{advantage:+.3f}'} "
            f"| {'yes' if row['trained'] else 'no'} | {cell(row['completion_text'])} |"
        )
    return "\n".join(lines)


def _write_file(path: Path, data: bytes) -> None:  # the seam the full-disk test patches
    path.write_bytes(data)


class CompletionLog:
    """The hook that writes a step's completions (``__call__(step, log)``, added with
    ``every=logging.completions_every``) on a background thread; :meth:`flush` waits for them
    (before a checkpoint), :meth:`close` at the end of the run.

    ``process`` of ``processes``: which share of the step's groups this process writes, and
    under which file name; ``seed``: the sample's (``train.seed``); ``resume_step``: the step
    the run continues from (this process's files of later steps are removed; process 0 removes
    every process's); ``text(tag, markdown, step)``: TensorBoard's text tab (None: none);
    ``report``: where the one warning goes. ``enabled`` False (or ``completions_every`` 0): a
    hook that does nothing.
    """

    MAX_PENDING = 2  # steps handed over and not yet written

    def __init__(
        self,
        run_dir: str | Path,
        logging: LoggingConfig,
        *,
        seed: int,
        process: int = 0,
        processes: int = 1,
        resume_step: int = 0,
        enabled: bool = True,
        text: Callable[[str, str, int], None] | None = None,
        report: Callable[[str], None] = print,
    ):
        self.folder = Path(run_dir) / FOLDER
        self.groups, self.chars = logging.completions_groups, logging.completions_chars
        self.seed, self.process, self.processes = seed, process, processes
        self.text, self.report = text, report
        self.enabled = enabled and logging.completions_every > 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []
        if not self.enabled:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._remove_after(resume_step)
        except OSError as err:
            self._fail(err)
            return
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="completions")

    def _remove_after(self, step: int) -> None:
        """Remove the files of steps after ``step`` (about to be redone, or never to be) and
        the partial files a crash left."""
        for path in self.folder.iterdir():
            match = _STEP_FILE.fullmatch(path.name)
            if match is not None:
                mine = self.process == 0 or int(match[2]) == self.process
                if mine and int(match[1]) > step:
                    path.unlink(missing_ok=True)
            elif path.name.endswith(f".p{self.process}.jsonl.tmp"):
                path.unlink(missing_ok=True)

    def __call__(self, step: int, log: StepLog) -> None:
        if not self.enabled or self._pool is None:
            return
        self._check_done()
        if len(self._pending) >= self.MAX_PENDING:  # a slow disk slows the run rather than
            self._pending.pop(0).result()  # holding every step's rollouts in memory
        # the step's result is not changed after the step: the thread reads it as it is
        self._pending.append(self._pool.submit(self._write, step, log.result))

    def _write(self, step: int, result: StepResult) -> None:
        if not self.enabled:  # an earlier write failed
            return
        local = len(result.batch.group_sizes)
        groups_p = sampled_groups(step, local, self.process, self.processes, self.groups, self.seed)
        rows = completion_rows(
            result,
            groups_p,
            first_group=self.process * local,
            process=self.process,
            chars=self.chars,
        )
        if not rows:  # none of the step's sampled groups is this process's
            return
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
        path = self.folder / step_file(step, self.process)
        partial = path.with_name(path.name + ".tmp")
        try:
            _write_file(partial, data)
            os.replace(partial, path)
        except OSError as err:
            self._fail(err)
            try:
                partial.unlink(missing_ok=True)
            except OSError:
                pass
            return
        if self.text is not None:
            self.text(FOLDER, markdown_table(rows), step)

    def _fail(self, err: OSError) -> None:
        """Say once that the completions cannot be written, and write no more."""
        from sagc_jax.train.metrics import no_space_on

        if not self.enabled:
            return
        self.enabled = False
        why = no_space_on(err, self.folder) or f"cannot write {self.folder} ({err.strerror or err})"
        who = f"process {self.process}: " if self.processes > 1 else ""
        self.report(
            f"{who}completions: {why}; the run goes on without them (its metrics and "
            f"checkpoints are unaffected; logging.completions_every=0 turns them off)"
        )

    def _check_done(self) -> None:
        """Forget the finished writes; raise what one of them raised (a bug: OSError is said
        once and ends the writing, not the run)."""
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for future in done:
            future.result()

    def flush(self) -> None:
        """Wait until every step handed over is written (or given up)."""
        for future in self._pending:
            future.result()
        self._pending = []

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None


# ---------------------------------------------------------------------- reading them back


def read_completions(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every row a run wrote (every step, every process), by step then process; [] when it
    wrote none. A torn line is skipped."""
    folder = Path(run_dir) / FOLDER
    files = []
    if folder.is_dir():
        for path in folder.iterdir():
            match = _STEP_FILE.fullmatch(path.name)
            if match is not None:
                files.append((int(match[1]), int(match[2]), path))
    rows = []
    for _, _, path in sorted(files):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
