"""Stop signals anywhere, and the SFT warm start: checkpoints, resume, reuse, --force; eval with
the run's own config.

Every stop must end with exit code 128 + signal (130 for SIGINT, 143 for SIGTERM) and exactly one
line on stderr, never a traceback. Most tests call ``main`` in this process (the hook of
``SAGC_JAX_CRASH_AT=point:step:SIGNAL`` sends the signal to it); two run the command line as a
subprocess, one of them stopped from outside at whatever it is doing.
"""

import os
import shutil
import signal
import subprocess
import sys

import chex
import pytest
from flax import nnx
from helpers import TINY as TRAIN_TINY
from helpers import sets

from sagc_jax.cli import main
from sagc_jax.config import ConfigError, load_config
from sagc_jax.programs.policy import build_model
from sagc_jax.tasks.source import make_source
from sagc_jax.train.safety.checkpoint import CheckpointStore
from sagc_jax.train.safety.faults import CRASH_ENV
from sagc_jax.train.warm_start import load_run_params

TINY = [*TRAIN_TINY, "logging.tensorboard=false"]
SFT = [*TINY, "sft.steps=6", "sft.batch_size=4", "sft.checkpoint_every=2"]


def run_dir(path):
    return ["--set", f"logging.run_dir={path}"]


def one_stop_line(err: str, code: int, got: int) -> str:
    assert got == code, err[-2000:]
    assert err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
    assert f"stopped by {signal.Signals(code - 128).name}" in err
    return err


def cli_env(crash: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    return {**env, CRASH_ENV: crash} if crash else env


def sft_params(path):
    cfg = load_config(None, SFT)
    _, template = nnx.split(build_model(cfg.model, make_source(cfg).tokenizer, seed=0))
    return load_run_params(path, template, unfinished_ok=True)


@pytest.fixture(scope="module")
def straight_sft(tmp_path_factory):
    """An uninterrupted tiny SFT run directory."""
    path = tmp_path_factory.mktemp("sft") / "straight"
    assert main(["sft", *sets(SFT), *run_dir(path)]) == 0
    return path


@pytest.mark.slow
def test_signal_during_startup_in_a_subprocess(tmp_path):
    args = ["train", *sets([*TINY, "train.steps=2"]), *run_dir(tmp_path / "run")]
    proc = subprocess.run(
        [sys.executable, "-m", "sagc_jax", *args],
        capture_output=True,
        text=True,
        env=cli_env("startup:0:SIGINT"),
    )
    err = one_stop_line(proc.stderr, 130, proc.returncode)
    assert "during start-up; nothing was saved" in err


@pytest.mark.slow
def test_signal_from_outside_before_the_first_step(tmp_path):
    """Sent once the trainer is built: the step-0 evaluation or compilation is running."""
    overrides = [*TINY, "train.steps=400", "train.eval_size=64", "train.compile_ahead=true"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sagc_jax", "train", *sets(overrides), *run_dir(tmp_path / "r")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**cli_env(), "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout.readline().startswith("train:")  # printed once the trainer is built
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    one_stop_line(err, 143, proc.returncode)


@pytest.mark.parametrize(
    "crash, code, during",
    [
        ("eval:0:SIGTERM", 143, "during the step-0 evaluation"),
        ("compile:0:SIGINT", 130, "during compilation"),
    ],
)
def test_signal_before_the_step_loop(tmp_path, capsys, monkeypatch, crash, code, during):
    monkeypatch.setenv(CRASH_ENV, crash)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    overrides = [*TINY, "train.steps=2", "train.compile_ahead=true"]
    got = main(["train", *sets(overrides), *run_dir(tmp_path / "run")])
    err = one_stop_line(capsys.readouterr().err, code, got)
    assert during in err and "nothing was saved" in err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


@pytest.mark.slow
def test_sft_stopped_saves_and_resumes_to_the_uninterrupted_result(
    straight_sft, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "stopped"
    args = ["sft", *sets(SFT), *run_dir(run)]
    monkeypatch.setenv(CRASH_ENV, "sft:2:SIGTERM")  # arrives during step 3 (index 2)
    got = main(args)
    err = one_stop_line(capsys.readouterr().err, 143, got)
    assert "checkpoint of step 3 saved" in err and "run the same command to resume" in err
    monkeypatch.delenv(CRASH_ENV)
    store = CheckpointStore(run / "checkpoints")
    assert store.latest_step() == 3 and not store.read_meta(3)["finished"]
    store.close()
    # an unfinished warm start is not a starting point for train, and not resumed if changed
    with pytest.raises(ConfigError, match="stopped at step 3 of 6"):
        cfg = load_config(None, SFT)
        _, template = nnx.split(build_model(cfg.model, make_source(cfg).tokenizer, seed=0))
        load_run_params(run, template)
    assert main([*args, "--set", "sft.learning_rate=0.01"]) == 2
    err = capsys.readouterr().err
    assert "stopped at step 3" in err and "sft.learning_rate" in err and "--force" in err

    assert main(args) == 0
    assert "resuming" in capsys.readouterr().out
    chex.assert_trees_all_equal(sft_params(run), sft_params(straight_sft))
    assert (run / "summary.json").is_file()


@pytest.mark.slow
def test_sft_reuses_refuses_a_changed_config_and_force_retrains(straight_sft, tmp_path, capsys):
    args = ["sft", *sets(SFT), *run_dir(straight_sft)]
    assert main([*args, "--set", "logging.progress=false"]) == 0  # logging.* does not matter
    assert "reusing the warm start" in capsys.readouterr().out
    assert main([*args, "--set", "sampling.max_new_tokens=16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "finished warm start" in err and "sampling.max_new_tokens" in err and "--force" in err

    forced = tmp_path / "forced"
    shutil.copytree(straight_sft, forced)
    forced_args = ["sft", *sets(SFT), *run_dir(forced)]
    assert main([*forced_args, "--set", "sft.learning_rate=0.01", "--force"]) == 0
    out = capsys.readouterr().out
    assert "moved the earlier checkpoints" in out and "sft done" in out
    assert (forced / "checkpoints.replaced").is_dir()
    store = CheckpointStore(forced / "checkpoints")
    assert store.read_meta(store.latest_step())["config"]["sft"]["learning_rate"] == 0.01
    store.close()


@pytest.mark.slow
def test_eval_uses_the_runs_saved_config(straight_sft, tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(straight_sft)]) == 0
    out = capsys.readouterr().out
    assert "the config saved with the run (step 6)" in out
    # the saved sampling.max_new_tokens = 12 bounds the lengths (the default would allow 256)
    length = float(out.split("eval/length_mean=")[1].split(",")[0])
    assert length <= 12

    config = tmp_path / "other.yaml"
    config.write_text(
        "sampling: {max_new_tokens: 5, prompt_buckets: [16]}\n"
        "data: {max_terms: 4}\ntrain: {eval_size: 4}\n"
    )
    assert main(["eval", "--config", str(config), "--checkpoint", str(straight_sft)]) == 0
    out = capsys.readouterr().out
    assert "differs from the run's saved config in" in out and "sampling.max_new_tokens" in out
    assert float(out.split("eval/length_mean=")[1].split(",")[0]) <= 5

    before = sorted(p.name for p in (straight_sft / "checkpoints").iterdir())
    got = main(
        [
            "eval",
            *sets(SFT),
            "--set",
            "model.param_dtype=bfloat16",
            "--config",
            str(config),
            "--checkpoint",
            str(straight_sft),
        ]
    )
    err = capsys.readouterr().err
    assert got == 2 and "model.param_dtype" in err and "leave out --config" in err
    assert sorted(p.name for p in (straight_sft / "checkpoints").iterdir()) == before


@pytest.mark.slow
def test_compare_stops_at_a_signal_instead_of_going_on(tmp_path, capsys, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("{}\n")
    out_dir = tmp_path / "cmp"
    args = [
        "compare",
        "--config",
        str(config),
        *sets(TINY),
        *run_dir(out_dir),
        "--controllers",
        "fixed:2,fixed:4",
        "--steps",
        "2",
    ]
    monkeypatch.setenv(CRASH_ENV, "update:0:SIGTERM")
    got = main(args)
    err = one_stop_line(capsys.readouterr().err, 143, got)
    assert "fixed:2 run" in err and "fixed2-seed0" in err
    assert "its checkpoint is saved" in err and "run the same command to resume" in err
    assert not (out_dir / "fixed4-seed0").exists()  # the next run did not start
    store = CheckpointStore(out_dir / "fixed2-seed0" / "checkpoints")
    assert store.latest_step() == 1
    store.close()
