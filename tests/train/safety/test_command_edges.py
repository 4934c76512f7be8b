"""``sft``, ``eval`` and ``export`` against a full disk, a read-only output and a checkpoint
deleted while it is read (a trainer rotating out its old steps): one line on stderr, exit 2, no
traceback, nothing half-written left, and a rerun that completes once the cause is gone; a
checkpoint deleted mid-read is replaced by the newest that still verifies. Rows of the
Reliability table in docs/reliability.md.

The full disk and the read-only directory are real in the last two tests (a tmpfs and a
read-only bind mount in a private mount namespace, skipped where ``unshare`` is not allowed);
the others patch the write or the read that fails.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PYTHONPATH, TINY, enospc_on_step, sets

from sagc_jax.cli import main
from sagc_jax.train.safety.checkpoint import CheckpointStore

BASE = [*TINY, "logging.tensorboard=false"]
SFT = [*BASE, "sft.steps=6", "sft.batch_size=4", "sft.checkpoint_every=2"]
TRAIN = [*BASE, "train.steps=3", "train.checkpoint_every=1"]


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    """A finished tiny train run with checkpoints of steps 1, 2 and 3."""
    run = tmp_path_factory.mktemp("train") / "run"
    assert main(["train", *sets([*TRAIN, f"logging.run_dir={run}"])]) == 0
    return run


def one_error_line(err: str) -> str:
    assert "Traceback" not in err and err.count("\n") == 1, err[-3000:]
    assert err.startswith("error: "), err
    return err


def steps(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


# ---------------------------------------------------------------------- a full disk


@pytest.mark.slow
def test_sft_on_a_full_disk_is_one_line_and_the_rerun_completes(tmp_path, monkeypatch, capfd):
    """The disk fills up while step 4's checkpoint is written, then (space freed, the training
    resumed) while the summary is written: one line each, nothing torn, and the rerun ends."""
    run = tmp_path / "sft"
    args = ["sft", *sets([*SFT, f"logging.run_dir={run}"])]
    enospc_on_step(monkeypatch, 4)
    assert main(args) == 2
    err = one_error_line(capfd.readouterr().err)
    assert err.startswith(f"error: no space left on {run / 'checkpoints'} (the disk mounted at ")
    assert "while saving step 4: needed ~" in err and "(newest: step 2)" in err
    assert steps(run) == ["2"]
    monkeypatch.undo()

    real_write_text = Path.write_text

    def full_disk(path, data, *args, **kwargs):
        if path.name.startswith("summary.json"):
            real_write_text(path, data[: len(data) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write_text(path, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert main(args) == 2
    err = one_error_line(capfd.readouterr().err)
    assert err.startswith(f"error: no space left on {run} (the disk mounted at ")
    assert "while writing summary.json: it was not written; free space, then run the" in err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]  # no half a summary
    assert steps(run) == ["4", "6"]
    monkeypatch.undo()

    assert main(args) == 0
    out, err = capfd.readouterr()
    assert "from step 6" in out and not err
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


# ---------------------------------------------------------------------- a read-only output


def test_export_into_a_read_only_directory_is_one_line(train_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "ro" / "out"
    real_mkdir = Path.mkdir

    def read_only(path, *args, **kwargs):  # root may write anywhere: refuse OUT's parent
        if path.parent == out.parent:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["export", str(train_run), str(out)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert err == (
        f"error: {out}.export-tmp: cannot be written (Read-only file system); make "
        f"{out.parent} writable or choose another OUT\n"
    )
    assert not out.exists() and not out.with_name("out.export-tmp").exists()
    monkeypatch.undo()
    assert main(["export", str(train_run), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


# ---------------------------------------------------------------------- a step deleted mid-read


def rotate_on_read(monkeypatch, times=1):
    """The first ``times`` restores find their step deleted just before they read it, as when
    the run's trainer rotates it out; returns the steps deleted."""
    original, deleted = CheckpointStore.restore, []

    def restore(self, step, targets):
        if len(deleted) < times:
            shutil.rmtree(self.directory / str(step))
            deleted.append(step)
        return original(self, step, targets)

    monkeypatch.setattr(CheckpointStore, "restore", restore)
    return deleted


def test_export_and_eval_of_a_step_deleted_while_read_use_the_newest_that_verifies(
    train_run, tmp_path, monkeypatch, capsys
):
    run, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(train_run, run)
    deleted = rotate_on_read(monkeypatch)
    assert main(["export", "--unfinished", str(run), str(out)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert deleted == [3] and steps(run) == ["1", "2"]
    assert said[0] == (
        "checkpoint step 3: deleted while it was read (another process, such as the run's "
        "trainer rotating out old steps); trying the newest that verifies"
    )
    assert said[1].startswith(f"export {run} step 2 (full fine-tuning): {out} ")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not (run / "checkpoints-rejected").exists()  # nothing to set aside: it is gone

    deleted = rotate_on_read(monkeypatch)
    assert main(["eval", "--checkpoint", str(run)]) == 0
    said = capsys.readouterr().out
    assert deleted == [2] and "checkpoint step 2: deleted while it was read" in said
    assert "eval/accuracy=" in said


def test_export_of_a_run_whose_steps_are_all_deleted_while_read_is_one_line(
    train_run, tmp_path, monkeypatch, capsys
):
    run, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(train_run, run)
    rotate_on_read(monkeypatch, times=3)
    assert main(["export", "--unfinished", str(run), str(out)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert err == (
        f"error: {run / 'checkpoints'}: no complete checkpoint left to read (deleted while they "
        f"were read)\n"
    )
    assert not out.exists() and not out.with_name("out.export-tmp").exists()


def test_a_finished_runs_export_falls_back_only_to_a_finished_step(
    train_run, tmp_path, monkeypatch, capsys
):
    run, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(train_run, run)
    rotate_on_read(monkeypatch)
    assert main(["export", str(run), str(out)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "its newest checkpoint is step 2, before train.steps = 3" in err
    assert "--unfinished exports it anyway" in err
    assert not out.exists() and not out.with_name("out.export-tmp").exists()


# ---------------------------------------------------------------------- real disks


def in_private_mounts(tmp_path, script: str) -> subprocess.CompletedProcess:
    """Run ``script`` (sh) as root of a private mount namespace; skip where it is not allowed."""
    if not shutil.which("unshare") or subprocess.run(["unshare", "-rm", "true"]).returncode:
        pytest.skip("no private mount namespace here (unshare -rm)")
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env
    )


@pytest.mark.slow
def test_sft_on_a_real_full_disk_is_one_line(tmp_path):
    """A 3 MiB tmpfs does not hold the first checkpoint (4.2 MiB): Orbax's write tasks fail in
    their threads, where they used to print up to 40 "Event loop is closed" tracebacks and could
    re-raise into the clean-up (exit 1, the partial step left)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    sft = f"{sys.executable} -m sagc_jax sft {' '.join(sets(SFT))} --set logging.run_dir={disk}/s"
    script = f"mount -t tmpfs -o size=3m tmpfs {disk} && {sft}; echo rc=$?; ls -A {disk}/s/*"
    proc = in_private_mounts(tmp_path, script)
    assert "rc=2" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    err = one_error_line(proc.stderr)
    assert err.startswith(f"error: no space left on {disk}/s/checkpoints (the disk mounted at ")
    assert "while saving step 2" in err and "no checkpoint was sealed yet" in err
    assert proc.stdout.splitlines()[-1] == "rc=2"  # nothing left in checkpoints/


@pytest.mark.slow
def test_sft_and_export_into_real_read_only_directories(train_run, tmp_path):
    """``sft`` on a finished run directory and ``export`` into a directory, both mounted read
    only; ``eval`` reads a read-only run."""
    ro = tmp_path / "ro"
    ro.mkdir()
    shutil.copytree(train_run, ro / "run")
    run_sft = f"{sys.executable} -m sagc_jax sft {' '.join(sets(SFT))} --set logging.run_dir={ro}"
    commands = [
        run_sft,
        f"{sys.executable} -m sagc_jax export {ro / 'run'} {ro / 'out'}",
        f"{sys.executable} -m sagc_jax eval --checkpoint {ro / 'run'}",
    ]
    script = f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && " + "; ".join(
        f"{c} 2>{tmp_path}/err{i}; echo rc=$?" for i, c in enumerate(commands)
    )
    proc = in_private_mounts(tmp_path, script)
    codes = [line for line in proc.stdout.splitlines() if line.startswith("rc=")]
    errs = [(tmp_path / f"err{i}").read_text() for i in range(3)]
    assert codes == ["rc=2", "rc=2", "rc=0"], proc.stdout[-2000:] + "".join(errs)[-3000:]
    assert one_error_line(errs[0]) == (
        f"error: {ro}: cannot write the run directory (Read-only file system); make it writable "
        f"or use another logging.run_dir\n"
    )
    assert one_error_line(errs[1]) == (
        f"error: {ro}/out.export-tmp: cannot be written (Read-only file system); make {ro} "
        f"writable or choose another OUT\n"
    )
    assert "eval/accuracy=" in proc.stdout and not errs[2]
    assert sorted(p.name for p in ro.iterdir()) == ["run"]
