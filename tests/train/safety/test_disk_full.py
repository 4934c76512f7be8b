"""A full disk while saving a checkpoint: one line, exit 2, the partial step removed, every sealed
step kept, and the same command resumes once there is space. A row of the Reliability table in
docs/reliability.md.

No disk is filled here except in the last test (a 4 MiB tmpfs in a private mount namespace,
skipped where ``unshare`` is not allowed): the others raise ``ENOSPC`` inside Orbax's write of the
step's JSON item (it runs in Orbax's commit threads, like the array writes), or make
``free_bytes`` report little space.
"""

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import TINY as TRAIN_TINY
from helpers import enospc_on_step, sets

from sagc_jax.cli import main
from sagc_jax.train import metrics
from sagc_jax.train.safety import checkpoint, disk
from sagc_jax.train.safety.checkpoint import CheckpointError, CheckpointStore
from sagc_jax.train.safety.disk import space_errno
from sagc_jax.train.safety.runlock import RunDirError

TINY = [*TRAIN_TINY, "logging.tensorboard=false", "train.checkpoint_every=2"]
TENSORSTORE_ENOSPC = (
    'RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database at local file "/x/4.orbax-'
    'checkpoint-tmp/params.orbax-checkpoint-tmp/ocdbt.process_0/": Failed to write 365379 bytes '
    "to file 6: No space left on device [os_error_code='28']"
)


def step_dirs(ckpt):
    return sorted(p.name for p in ckpt.iterdir())


def test_space_errors_are_recognised_in_chains_and_tensorstore_text():
    assert space_errno(OSError(errno.ENOSPC, "No space left on device")) == errno.ENOSPC
    assert space_errno(OSError(errno.EDQUOT, "Disk quota exceeded")) == errno.EDQUOT
    assert space_errno(ValueError(TENSORSTORE_ENOSPC)) == errno.ENOSPC
    try:
        try:
            raise OSError(errno.ENOSPC, "full")
        except OSError as inner:
            raise RuntimeError("commit failed") from inner
    except RuntimeError as outer:
        assert space_errno(outer) == errno.ENOSPC
    assert space_errno(ExceptionGroup("tasks", [ValueError(TENSORSTORE_ENOSPC)])) == errno.ENOSPC
    assert space_errno(OSError(errno.EACCES, "Permission denied")) is None
    assert space_errno(ValueError("RESOURCE_EXHAUSTED: out of memory")) is None

    quiet = checkpoint._QuietSpaceErrors()
    error = ValueError(TENSORSTORE_ENOSPC)
    record = logging.LogRecord(
        "absl", 40, __file__, 1, "commit failed", (), (ValueError, error, None)
    )
    assert not quiet.filter(record)  # Orbax's traceback of a full disk is dropped
    record = logging.LogRecord("absl", 40, __file__, 1, "raised: %s", (TENSORSTORE_ENOSPC,), None)
    assert not quiet.filter(record)
    record = logging.LogRecord("absl", 40, __file__, 1, "another failure", (), None)
    assert quiet.filter(record)


@pytest.mark.slow
def test_full_disk_during_an_async_save_stops_with_one_line_then_resumes(
    tmp_path, monkeypatch, capfd
):
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    args = ["train", *sets([*TINY, "train.steps=6", f"logging.run_dir={run}"])]
    enospc_on_step(monkeypatch, 4)
    assert main(args) == 2
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "Traceback" not in out  # Orbax's are silenced
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: no space left on {ckpt} (the disk mounted at ")
    assert "while saving step 4: needed ~" in err
    assert "sealed checkpoints kept (newest: step 2); free space, then run the same command" in err
    assert step_dirs(ckpt) == ["2"]  # no 4.orbax-checkpoint-tmp left behind
    store = CheckpointStore(ckpt)
    assert store.verify(2) is None
    store.close()

    monkeypatch.undo()  # space is free again
    assert main(args) == 0
    out, err = capfd.readouterr()
    assert "resuming" in out and "from step 2" in out
    assert step_dirs(ckpt) == ["2", "4", "6"]


def small_items(n=4096, seed=0):
    rng = np.random.default_rng(seed)
    return {"params": {"w": rng.standard_normal(n).astype(np.float32)}}


def test_save_refused_when_the_last_checkpoint_does_not_fit_and_warned_when_two_do_not(
    tmp_path, monkeypatch
):
    ckpt = tmp_path / "ckpt"
    store = CheckpointStore(ckpt, async_save=True)
    lines = []
    store.save(1, small_items(), {"step": 1}, report=lines.append)
    store.wait()
    size = sum(p.stat().st_size for p in (ckpt / "1").rglob("*"))
    assert not lines  # plenty of room

    monkeypatch.setattr(disk, "free_bytes", lambda d: size * 3 // 2)
    store.save(2, small_items(seed=2), {"step": 2}, report=lines.append)
    store.save(3, small_items(seed=3), {"step": 3}, report=lines.append)
    store.wait()
    assert len(lines) == 1 and lines[0].startswith(f"low disk space on {ckpt} (the disk mounted")
    assert "a checkpoint takes ~" in lines[0]

    monkeypatch.setattr(disk, "free_bytes", lambda d: 1000)
    with pytest.raises(CheckpointError) as caught:
        store.save(4, small_items(seed=4), {"step": 4}, resume_hint="rerun it")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"no space left on {ckpt} (the disk mounted at ")
    assert "while saving step 4: needed ~" in message and ", 1000 B free; " in message
    assert message.endswith("sealed checkpoints kept (newest: step 3); free space, then rerun it")
    assert step_dirs(ckpt) == ["1", "2", "3"]  # nothing written
    store.close()


def test_full_disk_during_a_synchronous_save_and_while_sealing(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    store = CheckpointStore(ckpt, async_save=False)
    store.save(1, small_items(), {"step": 1})
    store.wait()
    enospc_on_step(monkeypatch, 2)
    with pytest.raises(CheckpointError, match=r"while saving step 2: .*\(newest: step 1\)"):
        store.save(2, small_items(seed=2), {"step": 2})
    assert step_dirs(ckpt) == ["1"]
    monkeypatch.undo()

    # the step lands, but its integrity record does not fit: unsealed, so it is removed too
    store.save(3, small_items(seed=3), {"step": 3})
    real_write_text = type(ckpt).write_text

    def write_text(path, *a, **kw):
        if path.name.startswith(checkpoint.INTEGRITY_FILE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write_text(path, *a, **kw)

    monkeypatch.setattr(type(ckpt), "write_text", write_text)
    with pytest.raises(CheckpointError, match=r"while saving step 3: .*\(newest: step 1\)"):
        store.wait()
    monkeypatch.undo()
    assert step_dirs(ckpt) == ["1"]
    store.close()
    store = CheckpointStore(ckpt)
    assert store.newest_verified_step() == 1
    store.close()


REAL_DISK = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import numpy as np

    from sagc_jax.train.safety.checkpoint import CheckpointError, CheckpointStore

    ckpt = Path(sys.argv[1]) / "ckpt"
    store = CheckpointStore(ckpt)
    rng = np.random.default_rng(0)
    store.save(1, {"params": {"w": rng.standard_normal(64 * 1024).astype(np.float32)}}, {})
    store.wait()  # 256 KiB: sealed
    try:  # 8 MiB of incompressible numbers on a disk of 4 MiB
        store.save(2, {"params": {"w": rng.standard_normal(2 << 20).astype(np.float32)}}, {})
        store.wait()
    except CheckpointError as err:
        print("MESSAGE", err)
    store.close()
    print("LEFT", sorted(p.name for p in ckpt.iterdir()), store.verify(1))
    """
)


@pytest.mark.slow
def test_a_real_full_disk_through_tensorstore(tmp_path):
    if not shutil.which("unshare") or subprocess.run(["unshare", "-rm", "true"]).returncode:
        pytest.skip("no private mount namespace here (unshare -rm)")
    tmpfs = tmp_path / "disk"
    tmpfs.mkdir()
    (tmp_path / "script.py").write_text(REAL_DISK)
    mount = f"mount -t tmpfs -o size=4m tmpfs {tmpfs} && {sys.executable} {tmp_path / 'script.py'}"
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"{mount} {tmpfs}"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = next(x for x in proc.stdout.splitlines() if x.startswith("MESSAGE"))
    assert f"no space left on {tmpfs / 'ckpt'} (the disk mounted at {tmpfs})" in message
    assert "while saving step 2" in message and "(newest: step 1)" in message
    assert "LEFT ['1'] None" in proc.stdout  # the partial step 2 is gone, step 1 verifies


# ---------------------------------------------------------------------- metrics.jsonl


@pytest.mark.slow
def test_full_disk_while_logging_a_step_is_one_line_nothing_torn_then_resumes(
    tmp_path, monkeypatch, capfd
):
    """The disk fills up halfway through step 3's line of metrics.jsonl: half of it reaches the
    file, then the write fails. The line is taken back, one line says so, and the rerun
    resumes from the step-2 checkpoint and logs every step once."""
    run = tmp_path / "run"
    args = ["train", *sets([*TINY, "train.steps=4", f"logging.run_dir={run}"])]
    real_write = metrics._write

    def write(fd, data):
        if bytes(data).startswith(b'{"step": 3,'):
            real_write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(metrics, "_write", write)
    assert main(args) == 2
    out, err = capfd.readouterr()
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"error: no space left on {run} (the disk mounted at ")
    assert "while logging step 3 to metrics.jsonl: the line was not kept; free space, then" in err
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    assert [json.loads(line)["step"] for line in text.splitlines()] == [0, 1, 2]  # none torn

    monkeypatch.undo()  # space is free again
    assert main(args) == 0
    out, err = capfd.readouterr()
    assert "resuming" in out and "from step 2" in out
    assert "dropped a torn line" not in out
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "group_size" in r] == [1, 2, 3, 4]


def test_full_disk_while_trimming_the_log_at_a_resume_leaves_it_whole(tmp_path, monkeypatch):
    log = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"step": s, "group_size": 2}) + "\n" for s in range(5))
    log.write_text(text)
    real_write_text = type(log).write_text

    def write_text(path, data, *a, **kw):
        real_write_text(path, data[: len(data) // 2], *a, **kw)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(type(log), "write_text", write_text)
    with pytest.raises(RunDirError, match=r"while trimming metrics.jsonl to step 2 to resume: it"):
        metrics.MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    monkeypatch.undo()
    assert log.read_text() == text and sorted(p.name for p in tmp_path.iterdir()) == [log.name]
