"""A run's state stays true: verified checkpoints, one writer per run directory, logs that
survive a cut, a summary of the whole run. Each test is a row of the Reliability table in
docs/reliability.md."""

import json
import os
import shutil
import socket

import chex
import jax
import numpy as np
import pytest
from helpers import TINY as TRAIN_TINY
from helpers import sets, tree_digest

from sagc_jax.cli import main
from sagc_jax.config import load_config
from sagc_jax.train.loop import Trainer
from sagc_jax.train.safety.checkpoint import INTEGRITY_FILE, CheckpointError, CheckpointStore
from sagc_jax.train.safety.runlock import LOCK_FILE, RunLock

TINY = [*TRAIN_TINY, "logging.tensorboard=false", "train.async_checkpoint=false"]
SIX_STEPS = [*TINY, "train.steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=3"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted six-step run with checkpoints at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("straight") / "run"
    trainer = Trainer(load_config(None, SIX_STEPS), run)
    trainer.run(progress=False)
    trainer.close()
    return run, [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]


def largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_bytes(step_dir):
    """XOR one byte every 50 kB (at least one) of the step's largest parameter file."""
    path = largest_file(step_dir / "params")
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data), 50_000):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "flipped bytes": ({6: flip_bytes}, 4),
    "truncated params": ({6: lambda d: truncate(largest_file(d / "params"))}, 4),
    "deleted optimizer state": ({6: lambda d: shutil.rmtree(d / "opt_state")}, 4),
    "deleted then truncated metadata": (
        {
            6: lambda d: (d / "meta" / "metadata").unlink(),
            4: lambda d: truncate(d / "meta" / "metadata"),
        },
        2,
    ),
    "never sealed": ({6: lambda d: (d / INTEGRITY_FILE).unlink()}, 4),
}


def restored_at(run, step, like):
    store = CheckpointStore(run / "checkpoints")
    items, _ = store.restore(step, {"params": like})
    store.close()
    return [np.asarray(x) for x in jax.tree.leaves(items["params"])]


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(DAMAGE))
def test_damaged_checkpoint_falls_back_to_the_previous_good_one(tmp_path, straight, fault, capsys):
    straight_run, straight_params = straight
    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    damage, good = DAMAGE[fault]
    expected = restored_at(straight_run, good, None)  # the state the resume must start from
    for step, hurt in damage.items():
        hurt(run / "checkpoints" / str(step))
    trainer = Trainer(load_config(None, SIX_STEPS), run)
    assert trainer.step == good
    out = capsys.readouterr().out
    for step in damage:
        assert f"checkpoint step {step}:" in out and "moved aside" in out
        assert (run / "checkpoints-rejected" / str(step) / "REJECTED.txt").is_file()  # kept
    chex.assert_trees_all_equal(jax.tree.leaves(trainer.state.params), expected)
    if fault == "flipped bytes":  # and on to the uninterrupted run's result
        trainer.run(progress=False)
        chex.assert_trees_all_equal(jax.tree.leaves(trainer.state.params), straight_params)
    trainer.close()


@pytest.mark.slow
def test_no_good_checkpoint_is_one_line_and_loses_nothing(tmp_path, straight, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight[0], run)
    for step in (2, 4, 6):
        flip_bytes(run / "checkpoints" / str(step))
    metrics = (run / "metrics.jsonl").read_bytes()
    code = main(["train", *sets(SIX_STEPS), "--set", f"logging.run_dir={run}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no checkpoint passes verification" in err
    assert (run / "metrics.jsonl").read_bytes() == metrics  # not started over
    assert sorted(p.name for p in (run / "checkpoints-rejected").iterdir()) == ["2", "4", "6"]


def test_store_never_writes_nonfinite_values_and_rotates_only_sealed_steps(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=2, async_save=True)
    good = {"w": np.ones(3, np.float32)}
    for step in (1, 2, 3):
        assert store.save(step, {"params": good}, {"step": step})
    assert not store.save(4, {"params": {"w": np.array([1.0, np.nan], np.float32)}}, {"step": 4})
    store.wait()
    assert store.manager.all_steps() == [2, 3]
    assert store.verify(2) is None and store.verify(3) is None
    assert store.restore_newest({"params": good})[0] == 3
    store.close()


def test_reading_another_runs_checkpoints_deletes_none_of_them(tmp_path):
    """train.init_checkpoint, eval, export and report open another run's checkpoints: a run that
    keeps five keeps its five (a reader used to rotate them to the default three on close)."""
    from sagc_jax.train.safety.checkpoint import newest_verified_meta
    from sagc_jax.train.warm_start import load_run_params

    writer = CheckpointStore(tmp_path / "checkpoints", keep=5, async_save=False)
    params = {"w": np.ones(3, np.float32)}
    for step in range(1, 6):
        assert writer.save(step, {"params": params}, {"step": step, "config": {}})
    writer.close()
    assert newest_verified_meta(tmp_path / "checkpoints")[0] == 5
    np.testing.assert_array_equal(load_run_params(tmp_path, params)["w"], params["w"])
    assert CheckpointStore(tmp_path / "checkpoints").manager.all_steps() == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_second_writer_is_refused_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", *sets([*TINY, "train.steps=1"]), "--set", f"logging.run_dir={run}"]
    with RunLock(run, "train"):  # a live holder (this process)
        assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"pid {os.getpid()} on host {socket.gethostname()}" in err
    assert not (run / "metrics.jsonl").exists()

    dead = {"host": socket.gethostname(), "pid": 2**22 + 17, "command": "train", "started": 0}
    (run / LOCK_FILE).write_text(json.dumps(dead))  # left by a killed process
    assert main(args) == 0
    assert f"taking over the lock of sagc-jax train (pid {dead['pid']}" in capsys.readouterr().out

    (run / LOCK_FILE).write_text(json.dumps({**dead, "host": "another-machine"}))
    assert main([*args[:-1], f"logging.run_dir={run}", "--set", "train.steps=2"]) == 2
    err = capsys.readouterr().err
    assert "another-machine" in err and f"delete {run / LOCK_FILE}" in err


@pytest.mark.slow
def test_torn_log_line_resume_summary_of_the_whole_run_and_finished_rerun(tmp_path, capsys):
    run = tmp_path / "run"
    common = [*TINY, "train.checkpoint_every=2", f"logging.run_dir={run}"]
    assert main(["train", *sets([*common, "train.steps=2"])]) == 0
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward": 0.')  # a kill mid-write
    capsys.readouterr()
    assert main(["train", *sets([*common, "train.steps=4"])]) == 0
    assert "dropped a torn line" in capsys.readouterr().out
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "group_size" in r]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    summary = json.loads((run / "summary.json").read_text())  # strict JSON: no NaN
    assert summary["steps"] == 4 and summary["eval/accuracy"] == records[-1]["eval/accuracy"]
    assert summary["wall_clock_s"] == pytest.approx(sum(r["time/step_s"] for r in steps))

    digest = tree_digest(run)
    assert main(["train", *sets([*common, "train.steps=4"])]) == 0
    assert "is finished (step 4" in capsys.readouterr().out
    assert tree_digest(run) == digest  # nothing rewritten
    # a summary.json the end of the run could not write (a full disk) is written by the rerun
    (run / "summary.json").unlink()
    assert main(["train", *sets([*common, "train.steps=4"])]) == 0
    assert "wrote its missing summary.json" in capsys.readouterr().out
    del summary["steps_run"]  # this segment's steps: the rerun ran none
    assert json.loads((run / "summary.json").read_text()) == summary


def test_a_verified_checkpoint_of_another_model_is_an_error_not_damage(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", async_save=False)
    store.save(1, {"params": {"w": np.ones(3, np.float32)}}, {"step": 1})
    store.wait()
    with pytest.raises(CheckpointError, match="cannot be restored into this model"):
        store.restore_newest({"params": {"w": np.ones(3, np.float32), "b": np.ones(2, np.float32)}})
    assert store.manager.all_steps() == [1]  # intact, so not moved aside
    store.close()


def test_checkpoints_of_an_older_version_without_records_restore_unverified(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", async_save=False)
    for step in (1, 2):
        store.save(step, {"params": {"w": np.full(3, step, np.float32)}}, {"step": step})
    store.wait()
    for step in (1, 2):
        (tmp_path / "ckpt" / str(step) / INTEGRITY_FILE).unlink()
    said = []
    step, items, _ = store.restore_newest(
        {"params": {"w": np.ones(3, np.float32)}}, report=said.append
    )
    assert step == 2 and np.all(items["params"]["w"] == 2)
    assert "restoring it unverified" in said[0]
    store.close()
    assert not (tmp_path / "ckpt" / "2" / INTEGRITY_FILE).exists()  # a reader writes nothing
    # the run's own store (a writer) seals the step it restored: a run killed before sealing
    # its first checkpoint leaves no unsealed step behind once it goes on
    store = CheckpointStore(tmp_path / "ckpt", keep=3, async_save=False)
    said = []
    step, _, _ = store.restore_newest({"params": {"w": np.ones(3, np.float32)}}, report=said.append)
    assert step == 2 and "restoring it unverified" in said[0]
    assert store.verify(2) is None and not (tmp_path / "ckpt" / "1" / INTEGRITY_FILE).exists()
    assert store.newest_verified_step(report=said.append) == 2 and len(said) == 1
    store.close()


def test_a_reader_skips_a_step_it_cannot_verify_and_leaves_it_in_place(tmp_path):
    """eval or export beside a live trainer: the trainer's newest step is written and not yet
    sealed; the reader restores the newest sealed one and moves nothing (the trainer then seals
    its step as usual)."""
    store = CheckpointStore(tmp_path / "ckpt", keep=3, async_save=False)
    for step in (1, 2):
        store.save(step, {"params": {"w": np.full(3, step, np.float32)}}, {"step": step})
    store.wait()
    (tmp_path / "ckpt" / "2" / INTEGRITY_FILE).unlink()  # written, not sealed yet
    reader, said = CheckpointStore(tmp_path / "ckpt"), []
    step, items, _ = reader.restore_newest(
        {"params": {"w": np.ones(3, np.float32)}}, report=said.append
    )
    assert step == 1 and np.all(items["params"]["w"] == 1)
    assert said == [
        "checkpoint step 2: no integrity record (the run stopped before sealing it); skipped "
        "(left in place), trying older ones"
    ]
    assert store.manager.all_steps() == [1, 2] and not (tmp_path / "ckpt-rejected").exists()
    reader.close()
    store.close()
