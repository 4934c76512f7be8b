"""Faults a run must survive: preemption, crashes at any point, non-finite updates, bad input.

Each test here is a row of the Reliability table in docs/reliability.md.
"""

import json
import os
import signal
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest
from helpers import RAW_ROWS, sets, tree_digest, write_word_tokenizer
from helpers import TINY as TRAIN_TINY

from sagc_jax.cli import main
from sagc_jax.config import load_config
from sagc_jax.train.hooks import TrainingDiverged
from sagc_jax.train.loop import Trainer
from sagc_jax.train.safety.checkpoint import CheckpointStore
from sagc_jax.train.safety.faults import CRASH_ENV, Interrupted, stop_signals

TINY = [*TRAIN_TINY, "logging.tensorboard=false"]


def run_cli(args, env_extra=None, **kw):
    env = {**os.environ, **(env_extra or {})}
    env.pop(CRASH_ENV, None) if not env_extra or CRASH_ENV not in env_extra else None
    return subprocess.run(
        [sys.executable, "-m", "sagc_jax", *args], capture_output=True, text=True, env=env, **kw
    )


@pytest.mark.slow
def test_sigkill_at_any_point_resumes_to_the_uninterrupted_result(tmp_path):
    overrides = [*TINY, "train.steps=6", "train.checkpoint_every=2"]
    straight = Trainer(load_config(None, overrides), tmp_path / "straight")
    straight.run(progress=False)
    straight.close()

    run = tmp_path / "crashy"
    args = ["train", *sets(overrides), "--set", f"logging.run_dir={run}"]
    sync = ["--set", "train.async_checkpoint=false"]  # the crash points see finished writes
    store = lambda: CheckpointStore(run / "checkpoints")  # noqa: E731
    for crash, extra, latest in (
        ("rollout:3", sync, {2}),
        ("update:5", sync, {4}),
        ("checkpoint:6", [], {4, 6}),  # killed while step 6 is being written in the background
    ):
        proc = run_cli([*args, *extra], {CRASH_ENV: crash})
        assert proc.returncode == -signal.SIGKILL, (crash, proc.stderr[-2000:])
        s = store()
        assert s.latest_step() in latest, crash  # never a partial checkpoint
        s.close()
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stderr[-2000:]

    s = store()
    assert s.latest_step() == 6
    items, meta = s.restore(6, {"params": straight.state.params})
    s.close()
    chex.assert_trees_all_equal(items["params"], straight.state.params)
    mine = straight.controller.state_dict()
    for key, value in mine.items():
        np.testing.assert_array_equal(np.asarray(meta["controller"][key]), np.asarray(value))
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5, 6]  # steps redone after a crash are logged once


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_then_resumes(tmp_path):
    run = tmp_path / "run"
    args = [
        "train",
        *sets([*TINY, "train.steps=400", "train.checkpoint_every=0"]),
        "--set",
        f"logging.run_dir={run}",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sagc_jax", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:
        if metrics.exists() and metrics.read_text().count("group_size") >= 2:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM" in err and "run the same command to resume" in err
    s = CheckpointStore(run / "checkpoints")
    stopped = s.latest_step()
    s.close()
    assert stopped is not None and stopped >= 2
    resumed = Trainer(load_config(None, [*TINY, "train.steps=400"]), run)
    assert resumed.step == stopped
    resumed.close()


@pytest.mark.slow
def test_nonfinite_updates_are_skipped_then_abort(tmp_path, monkeypatch, capsys):
    import sagc_jax.train.loop as loop

    def nan_advantages(rewards, group_ids, num_groups, **kw):
        adv = np.full(len(rewards), np.nan, np.float32)
        return adv, {"zero_variance_p": np.zeros(num_groups, bool)}

    monkeypatch.setattr(loop, "group_advantages", nan_advantages)
    cfg = load_config(None, [*TINY, "train.steps=5", "train.max_nonfinite_steps=2"])
    trainer = Trainer(cfg, tmp_path / "run")
    before = [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]
    with pytest.raises(TrainingDiverged, match="not finite in 2 steps in a row"):
        trainer.run(progress=False)
    trainer.close()
    chex.assert_trees_all_equal(jax.tree.leaves(trainer.state.params), before)  # skipped: untouched
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["update/skipped"] for x in lines if "group_size" in x] == [1.0, 1.0]
    assert all("non-finite" in x["warning"] for x in lines if "group_size" in x)

    assert (
        main(
            [
                "train",
                *sets([*TINY, "train.steps=5", "train.max_nonfinite_steps=1"]),
                "--set",
                f"logging.run_dir={tmp_path / 'cli'}",
            ]
        )
        == 3
    )
    err = capsys.readouterr().err
    assert err.startswith("error: step 1:") and err.count("\n") == 1


def bad_input(args, capsys):
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.slow
def test_reward_function_that_raises_or_returns_nan(tmp_path, capsys, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(
        "def boom(prompts, completions, answers):\n    raise RuntimeError('no network')\n"
        "def nan(prompts, completions, answers):\n    return [float('nan')] * len(prompts)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["train", *sets([*TINY, "train.steps=1"])]
    err = bad_input(
        [
            *base,
            "--set",
            "data.reward=user_rewards:boom",
            "--set",
            f"logging.run_dir={tmp_path / 'a'}",
        ],
        capsys,
    )
    assert "failed at index 0" in err and "no network" in err
    err = bad_input(
        [
            *base,
            "--set",
            "data.reward=user_rewards:nan",
            "--set",
            f"logging.run_dir={tmp_path / 'b'}",
        ],
        capsys,
    )
    assert "failed at index 0" in err and "nan" in err
    # the 'zero' policy scores the rows 0 and keeps training
    assert (
        main(
            [
                *base,
                "--set",
                "data.reward=user_rewards:nan",
                "--set",
                "data.reward_on_error=zero",
                "--set",
                f"logging.run_dir={tmp_path / 'c'}",
            ]
        )
        == 0
    )
    logged = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [x["reward_failed_rows"] for x in logged if "group_size" in x] == [8]  # 2 prompts x G=4
    err = bad_input(
        [
            *base,
            "--set",
            "data.reward=user_rewards:missing",
            "--set",
            f"logging.run_dir={tmp_path / 'd'}",
        ],
        capsys,
    )
    assert "user_rewards:missing" in err


def test_checkpoint_whose_tensors_do_not_match_its_config(tmp_path, capsys):
    from flax import nnx

    from sagc_jax.models import Decoder, get_preset, save_hf_checkpoint

    arch = get_preset("tiny").replace(vocab_size=64)
    save_hf_checkpoint(Decoder(arch, rngs=nnx.Rngs(0)), arch, str(tmp_path / "hf"))
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf_config["intermediate_size"] = arch.intermediate_size * 2  # config disagrees with tensors
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))
    write_word_tokenizer(tmp_path / "tok")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "what is 1 plus 1", "answer": "2"}\n')
    err = bad_input(
        [
            "train",
            *sets(
                [
                    *TINY,
                    "data.task=dataset",
                    *RAW_ROWS,
                    f"data.path={data}",
                    f"model.hf_checkpoint={tmp_path / 'hf'}",
                    f"model.tokenizer={tmp_path / 'tok'}",
                    f"logging.run_dir={tmp_path / 'run'}",
                ]
            ),
        ],
        capsys,
    )
    assert "mlp" in err and str(arch.intermediate_size) in err
    assert str(2 * arch.intermediate_size) in err


@pytest.mark.slow
def test_refused_resume_and_missing_paths_leave_files_untouched(tmp_path, capsys):
    run = tmp_path / "run"
    base = ["train", *sets([*TINY, "train.steps=1"]), "--set", f"logging.run_dir={run}"]
    assert main(base) == 0
    capsys.readouterr()
    digest = tree_digest(run)
    err = bad_input([*base, "--set", "sampling.max_new_tokens=16"], capsys)
    assert "cannot resume" in err and "sampling.max_new_tokens" in err
    write_word_tokenizer(tmp_path / "tok")
    missing = [
        "data.task=dataset",
        *RAW_ROWS,
        f"data.path={tmp_path / 'missing.jsonl'}",
        f"model.tokenizer={tmp_path / 'tok'}",
    ]
    err = bad_input([*base, *sets(missing)], capsys)
    assert "missing.jsonl" in err
    err = bad_input([*base, "--set", f"train.init_checkpoint={tmp_path / 'nope'}"], capsys)
    assert "nope" in err and "init_checkpoint" in err
    assert tree_digest(run) == digest


def test_a_stop_signal_inside_an_import_is_raised_once_the_import_is_done(tmp_path, monkeypatch):
    """Ctrl-C while start-up imports numpy from a C extension: raised there, the exception was
    printed as a traceback by the extension (PyErr_Print) before the one line (the soak found
    it). The signal is delivered again until it lands outside the import."""
    (tmp_path / "signalled_import.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.3)\n"
        "DONE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(Interrupted) as stop, stop_signals():
        import signalled_import  # noqa: F401

        time.sleep(10)  # the signal again, outside the import
    assert sys.modules["signalled_import"].DONE and stop.value.signum == signal.SIGINT
