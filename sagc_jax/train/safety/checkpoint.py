"""Orbax checkpoints of a training run: arrays through ``StandardSave``, the rest as JSON, each
step sealed with an integrity record and verified before it is restored.

A checkpoint at step s holds named pytrees of arrays (``params``, ``opt_state``) and ``meta``
(JSON: the controller's state dict, data position, RNG key data, step, resolved config). Orbax
writes each step into a temporary directory and renames it when complete, so a crash mid-write
never leaves a checkpoint that ``latest_step`` would pick up.

Once a step is complete, process 0 *seals* it: ``integrity.json`` in the step directory lists the
size and SHA-256 of every file. Restoring picks the newest step whose files still match their
record; a step that does not (truncated, flipped bytes, a file deleted, no record because the
run died before sealing it) or that cannot be read is reported in one line and moved aside into
``<checkpoints>-rejected/`` (never deleted), and the next older one is tried; a step that another
process deletes while it is read (a trainer rotating out old steps, under ``eval`` or ``export``)
is said in one line and the newest that still verifies read instead. Parameters that
are not finite are never written, and rotation deletes a step only once ``keep`` newer ones are
sealed, so the last good checkpoint always survives.

A full disk (or an exceeded quota) stops the run with one line instead of Orbax's tracebacks:
before each save the free space is compared with the size of the newest checkpoint (a warning
once when less than two fit, a refusal when not even one does), and a write that fails anyway
(``ENOSPC``, raised in Orbax's write threads) has its partial step removed; sealed steps are
kept, and the same command resumes from the newest once there is space.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from sagc_jax.parallel import from_leader, gather_rows, is_leader
from sagc_jax.train.safety import disk
from sagc_jax.train.safety.disk import (
    SPACE_ERRNOS,
    SPACE_TEXT,
    human_bytes,
    mount_point,
    space_errno,
    tree_bytes,
)

_ARRAY_TAG = "__ndarray__"
INTEGRITY_FILE = "integrity.json"


class CheckpointError(RuntimeError):
    """No checkpoint of a run can be restored, or one cannot be written (message is one line)."""


# ------------------------------------------------------------------ Orbax's space errors


class _QuietSpaceErrors(logging.Filter):
    """Drops Orbax's log records (one traceback per write task) of a write that failed for lack
    of space: the store reports that failure itself, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and space_errno(record.exc_info[1]):
            return False
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 (a malformed record is not ours to judge)
            return True
        return not any(mark in message for marks in SPACE_TEXT.values() for mark in marks)


def _quiet_orbax_space_errors() -> None:
    # Orbax logs through absl; a write task whose error nobody awaited any more is logged by
    # asyncio at exit ("Task exception was never retrieved", with its traceback)
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietSpaceErrors) for f in logger.filters):
            logger.addFilter(_QuietSpaceErrors())
    if not getattr(sys.unraisablehook, "drops_closed_loops", False):
        sys.unraisablehook = _drop_closed_loops(sys.unraisablehook)


def _drop_closed_loops(hook):
    """``hook`` without the "Event loop is closed" errors of Orbax's write tasks: when one write
    fails, Orbax closes the event loop that awaited it while TensorStore's threads still deliver
    the results of the others (one traceback each, up to 40 for a tiny run, printed by Python
    as unraisable); nothing awaits those any more, and the failure itself is reported."""

    def drop(info) -> None:
        value = info.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            hook(info)

    drop.drops_closed_loops = True
    return drop


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


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [
        jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def all_finite(tree) -> bool:
    """True when every floating-point array of ``tree`` is finite (one device reduction)."""
    return bool(_all_finite(tree))


def _file_record(step_dir: Path) -> dict[str, list]:
    """relative path -> [size in bytes, sha256 hex] of every file under ``step_dir``."""
    record = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != INTEGRITY_FILE:
            with path.open("rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            record[str(path.relative_to(step_dir))] = [path.stat().st_size, digest]
    return record


class CheckpointStore:
    """Saves, seals, verifies and restores run state under ``directory``.

    A writer (``keep``: a number) keeps the newest ``keep`` sealed steps; a reader (``keep``
    None: restoring another run's parameters, its meta, a report) never deletes a step. Every
    process of a run makes the same calls in the same order (saving, waiting and rotating are
    collective); process 0 alone seals, verifies and moves rejected steps aside, and broadcasts
    which step to restore.
    """

    def __init__(self, directory: str | Path, keep: int | None = None, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.rejected_dir = self.directory.with_name(self.directory.name + "-rejected")
        self.keep = keep
        # Rotation is ours (after sealing), not Orbax's (which deletes before the new step lands).
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, create=True, enable_async_checkpointing=async_save
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._unsealed: list[int] = []
        self._skipped: set[int] = set()  # a reader's steps that failed (never moved)
        # (step, bytes it needs, whether that is measured) of the write in flight
        self._in_flight: tuple[int, int, bool] | None = None
        self._warned_space = False
        self.resume_hint = "run the same command to resume"
        _quiet_orbax_space_errors()

    # ------------------------------------------------------------------ writing

    def save(
        self,
        step: int,
        items: dict[str, Any],
        meta: dict[str, Any],
        *,
        report: Callable[[str], None] = print,
        resume_hint: str | None = None,
    ) -> bool:
        """Write step ``step``: each of ``items`` (name -> pytree of arrays) and ``meta`` (JSON).

        Returns False, writing nothing, when an item holds a non-finite value. Asynchronous:
        :meth:`seal_finished`, :meth:`wait` or the next save completes and seals it.

        Raises :class:`CheckpointError` when the disk has no room for it: refused before
        writing when the newest checkpoint is larger than the free space, or a write that failed
        for lack of space (here or later, where it completes), its partial step removed.
        ``report`` gets one warning when less than two checkpoints fit; ``resume_hint`` ends
        the error (how to continue the run).
        """
        if not all(all_finite(tree) for tree in items.values()):
            return False
        if resume_hint:
            self.resume_hint = resume_hint
        self.wait()  # the previous step lands, is sealed and rotation runs first
        json_meta = to_json_tree(meta)
        self._in_flight = (step, *self._check_space(step, items, json_meta, report))
        args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
        args["meta"] = ocp.args.JsonSave(json_meta)
        try:
            self.manager.save(step, args=ocp.args.Composite(**args), force=True)
        except Exception as err:
            if space_errno(err) is None:
                raise
            self._no_space(space_errno(err), step)
        self._unsealed.append(step)
        return True

    def seal_finished(self) -> None:
        """Seal the steps whose write has finished, without waiting for one in flight (a write
        that failed for lack of space raises :class:`CheckpointError` here)."""
        if self._unsealed and not self.manager.is_saving_in_progress():
            self._finish_write()
            self._seal()

    def wait(self) -> None:
        """Finish every write in flight, seal it, and rotate old steps out."""
        self._finish_write()
        self._seal()
        if self.keep is None:
            return  # a reader: another run's steps are not ours to rotate
        complete = self.manager.all_steps()
        for step in sorted(complete)[: max(len(complete) - self.keep, 0)]:
            self.manager.delete(step)  # collective: every process rotates the same steps

    def _finish_write(self) -> None:
        """Wait for the write in flight; Orbax re-raises here what failed in its threads."""
        try:
            self.manager.wait_until_finished()
        except Exception as err:
            code = space_errno(err)
            if code is None or self._in_flight is None:
                raise
            self._no_space(code, self._in_flight[0])

    def _seal(self) -> None:
        for step in self._unsealed:
            step_dir = self.directory / str(step)
            if is_leader() and step_dir.is_dir():
                record = {"step": step, "files": _file_record(step_dir)}
                tmp = step_dir / (INTEGRITY_FILE + ".tmp")
                try:
                    tmp.write_text(json.dumps(record, indent=1))
                    tmp.rename(step_dir / INTEGRITY_FILE)
                except OSError as err:
                    if space_errno(err) is None:
                        raise
                    self._no_space(space_errno(err), step)
        self._unsealed = []
        self._in_flight = None

    # ------------------------------------------------------------------ disk space

    def _newest_sealed(self) -> int | None:
        steps = [
            int(p.name)
            for p in self.directory.iterdir()
            if p.name.isdigit() and (p / INTEGRITY_FILE).is_file()
        ]
        return max(steps, default=None)

    def _where(self) -> str:
        return f"{self.directory} (the disk mounted at {mount_point(self.directory)})"

    def _check_space(self, step: int, items: dict[str, Any], meta: Any, report) -> tuple[int, bool]:
        """(bytes step ``step`` needs, whether measured): the newest sealed checkpoint's size,
        else an estimate (array bytes + meta). Raises :class:`CheckpointError` when a measured
        size does not fit the free space (the least of every process's); warns once when two
        do not fit."""
        newest = self._newest_sealed() if is_leader() else None
        measured = newest is not None
        if measured:
            needed = sum(p.stat().st_size for p in (self.directory / str(newest)).rglob("*"))
        else:  # an estimate can overstate (Orbax compresses): it only warns, a write decides
            needed = tree_bytes(items) + len(json.dumps(meta))
        # as float32: JAX's collectives carry 32-bit values (x64 off), which int byte counts
        # over 2 GiB would overflow; float32 keeps them to 1e-7 of their size
        needed = int(from_leader(np.float32(needed)))
        measured = bool(from_leader(np.bool_(measured)))
        free = int(gather_rows(np.array([disk.free_bytes(self.directory)], np.float32)).min())
        if measured and free < needed:
            raise CheckpointError(self._space_message("no space left", step, needed, free, True))
        if free < 2 * needed and not self._warned_space:
            self._warned_space = True
            if is_leader():
                size = f"~{human_bytes(needed)}" + ("" if measured else " (estimated)")
                report(
                    f"low disk space on {self._where()}: {human_bytes(free)} free, a "
                    f"checkpoint takes {size}; when one no longer fits the run stops, keeping "
                    f"its sealed checkpoints"
                )
        return needed, measured

    def _no_space(self, code: int, step: int):
        """A write of ``step`` failed for lack of space: remove what it left, raise one line."""
        flight = self._in_flight if self._in_flight and self._in_flight[0] == step else None
        needed, measured = flight[1:] if flight else (0, True)
        self._in_flight = None
        self._unsealed = [s for s in self._unsealed if s != step]
        if is_leader():
            self._remove_partial(step)
        self.manager.reload()
        free = disk.free_bytes(self.directory)
        raise CheckpointError(self._space_message(SPACE_ERRNOS[code], step, needed, free, measured))

    def _remove_partial(self, step: int, attempts: int = 5) -> None:
        """Delete what the failed write of ``step`` left: Orbax's temporary directory, or the
        step itself when it landed but was never sealed (a resume would reject it)."""
        # Orbax raises the first failure while its other write tasks still run: let them end,
        # or they recreate the directories removed under them.
        deadline = time.monotonic() + 60
        for thread in threading.enumerate():
            if type(thread).__module__.startswith("orbax.") and thread.is_alive():
                # Orbax's threads re-raise their task's error from join(): the same lack of
                # space, reported by the caller
                with contextlib.suppress(Exception):
                    thread.join(max(deadline - time.monotonic(), 0))
        step_dir = self.directory / str(step)
        for _ in range(attempts):
            partial = list(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
            if step_dir.is_dir() and not (step_dir / INTEGRITY_FILE).is_file():
                partial.append(step_dir)
            if not partial:
                return
            for path in partial:
                shutil.rmtree(path, ignore_errors=True)
            time.sleep(0.2)  # a write still in flight would show up again

    def _space_message(self, what: str, step: int, needed: int, free: int, measured: bool) -> str:
        newest = self._newest_sealed()
        kept = (
            f"sealed checkpoints kept (newest: step {newest})"
            if newest is not None
            else "no checkpoint was sealed yet (a rerun starts from step 0)"
        )
        need = f"needed ~{human_bytes(needed)}{'' if measured else ' (estimated)'}, "
        need = need if needed else ""
        return (
            f"{what} on {self._where()} while saving step {step}: {need}{human_bytes(free)} "
            f"free; {kept}; free space, then {self.resume_hint}"
        )

    # ------------------------------------------------------------------ reading

    def latest_step(self) -> int | None:
        """The newest complete step on disk (sealed or not, not verified)."""
        return self.manager.latest_step()

    def verify(self, step: int) -> str | None:
        """None if every file of ``step`` matches its integrity record, else what is wrong."""
        step_dir = self.directory / str(step)
        try:
            expected = json.loads((step_dir / INTEGRITY_FILE).read_text())["files"]
        except FileNotFoundError:
            return "no integrity record (the run stopped before sealing it)"
        except (OSError, ValueError, KeyError, TypeError):
            return f"its {INTEGRITY_FILE} is unreadable"
        try:
            actual = _file_record(step_dir)
        except FileNotFoundError as err:  # deleted while it was read
            return f"{Path(err.filename or step_dir).name} is missing"
        for name, (size, digest) in expected.items():
            if name not in actual:
                return f"{name} is missing"
            if actual[name][0] != size:
                return f"{name} has {actual[name][0]} bytes, {size} were written"
            if actual[name][1] != digest:
                return f"{name} does not match its checksum"
        return None

    def set_aside(self, step: int, reason: str) -> Path:
        """Move step ``step`` out of the run's checkpoints (kept, named by its reason)."""
        self.rejected_dir.mkdir(parents=True, exist_ok=True)
        target = self.rejected_dir / str(step)
        n = 1
        while target.exists():
            n += 1
            target = self.rejected_dir / f"{step}-{n}"
        shutil.move(str(self.directory / str(step)), target)
        (target / "REJECTED.txt").write_text(reason + "\n")
        return target

    def _reject(self, step: int, reason: str, report: Callable[[str], None]) -> None:
        """Move a step that fails aside; a reader (``keep`` None: eval, export, a report of
        another run) only skips it: the step may be a live trainer's, written and not yet
        sealed, or being rotated out, and is not the reader's to move."""
        if self.keep is None:
            self._skipped.add(step)
            if is_leader():
                report(
                    f"checkpoint step {step}: {reason}; skipped (left in place), trying older ones"
                )
        elif is_leader():
            target = self.set_aside(step, reason)
            report(f"checkpoint step {step}: {reason}; moved aside to {target}, trying older ones")

    def newest_verified_step(self, report: Callable[[str], None] = print) -> int | None:
        """The newest step that passes :meth:`verify` (process 0 decides for all); failures
        are reported and moved aside. Raises :class:`CheckpointError` when steps existed and
        none passed (starting over would overwrite the run's logs)."""
        best, rejected = -1, 0
        if is_leader():
            steps = sorted(set(self.manager.all_steps()) - self._skipped, reverse=True)
            # a run written before checkpoints were sealed: nothing to verify against
            legacy = not any((self.directory / str(s) / INTEGRITY_FILE).exists() for s in steps)
            for step in steps:
                if legacy:
                    report(
                        f"checkpoint step {step}: no integrity record (the run stopped before "
                        f"sealing its first checkpoint, or an older sagc-jax wrote it); restoring "
                        f"it unverified"
                    )
                    best = step
                    break
                problem = self.verify(step)
                if problem is None:
                    best = step
                    break
                if not (self.directory / str(step)).is_dir():
                    self._deleted_while_read(step, report)
                    continue
                self._reject(step, problem, report)
                rejected += 1
        best = int(from_leader(np.int64(best)))
        self.manager.reload()
        if best < 0 and int(from_leader(np.int64(rejected))):
            raise CheckpointError(
                f"{self.directory}: no checkpoint passes verification ("
                + (
                    "left in place"
                    if self.keep is None
                    else f"all moved aside to {self.rejected_dir}"
                )
                + "); start a new run directory or restore one by hand"
            )
        return None if best < 0 else best

    def restore_newest(
        self,
        targets: dict[str, Any],
        check_meta: Callable[[dict], None] = lambda meta: None,
        report: Callable[[str], None] = print,
    ) -> tuple[int, dict[str, Any], dict] | None:
        """(step, items, meta) of the newest verified step that can be read, or None if the
        run has no checkpoint. ``check_meta`` sees the meta first and may raise (a config that
        does not match the run). A verified step that does not fit ``targets`` raises
        :class:`CheckpointError` (it is intact: the model asked for differs)."""
        while (step := self.newest_verified_step(report)) is not None:
            try:
                meta = self.read_meta(step)
            except (OSError, ValueError) as err:
                if self._changed_while_read(step, report):
                    continue
                self._reject(step, f"its meta cannot be read ({_one_line(err)})", report)
                continue
            check_meta(meta)
            try:
                items, meta = self.restore(step, targets)
            except Exception as err:  # noqa: BLE001
                if self._changed_while_read(step, report):
                    continue
                # Its files are the ones written, so the model asked for is not the one saved.
                raise CheckpointError(
                    f"{self.directory / str(step)}: cannot be restored into this model "
                    f"({_one_line(err)}); is the config the one it was saved with?"
                ) from None
            if not all(all_finite(tree) for tree in items.values()):
                self._reject(step, "holds non-finite values", report)
                continue
            if self.keep is not None and not (self.directory / str(step) / INTEGRITY_FILE).exists():
                # restored unverified, and it loads: sealed now, so that it is not left behind
                # unsealed (nor restored unverified again) once the run goes on
                self._unsealed.append(step)
                self._seal()
            return step, items, meta
        return None

    def _changed_while_read(self, step: int, report: Callable[[str], None]) -> bool:
        """Whether step ``step``, verified before the read that failed, is gone or no longer
        verifies: another process (a trainer rotating out its old steps) deleted it while it
        was read. Said in one line; the caller tries the newest step that still verifies."""
        changed = bool(from_leader(np.bool_(is_leader() and self.verify(step) is not None)))
        if changed:
            if is_leader():
                self._deleted_while_read(step, report)
            self.manager.reload()
        return changed

    @staticmethod
    def _deleted_while_read(step: int, report: Callable[[str], None]) -> None:
        report(
            f"checkpoint step {step}: deleted while it was read (another process, such as the "
            f"run's trainer rotating out old steps); trying the newest that verifies"
        )

    def restore(self, step: int, targets: dict[str, Any]) -> tuple[dict[str, Any], dict]:
        """(items named in ``targets``, each shaped like its target; meta) of step ``step``.

        Items of the checkpoint not named in ``targets`` are not read. Not verified: use
        :meth:`restore_newest` to resume.
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

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


def newest_verified_meta(directory: str | Path) -> tuple[int | None, dict]:
    """(newest verified step, its JSON meta) of the checkpoints in ``directory``; (None, {})
    when there is none. Damaged steps are moved aside as by :meth:`CheckpointStore.restore_newest`.
    """
    store = CheckpointStore(directory)
    try:
        step = store.newest_verified_step()
        return step, store.read_meta(step) if step is not None else {}
    finally:
        store.close()


def _one_line(err: BaseException, limit: int = 160) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
