"""What a run checks before it builds anything costly (train/safety: preflight.py, runlock.py):
the run directory is writable, a checkpoint fits its disk, the largest candidate G fits the
device; a refused start leaves no directory behind and a finished run no lock file. Each test is
a row of the Reliability table in docs/reliability.md."""

import errno
import os

import pytest
from helpers import TINY, sets

import sagc_jax.train.loop as loop
from sagc_jax.cli import main
from sagc_jax.train.safety import disk, runlock
from sagc_jax.train.safety.runlock import LOCK_FILE

FAST = [*TINY, "logging.tensorboard=false", "train.async_checkpoint=false", "train.steps=2"]


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the policy is built: the refusal must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the start-up check")

    monkeypatch.setattr(loop, "build_sharded_policy", refuse)


def train(run, *extra):
    return main(["train", *sets([*FAST, *extra, f"logging.run_dir={run}"])])


def test_a_ladder_that_cannot_fit_is_refused_before_the_model_is_built(tmp_path, capsys, no_model):
    run = tmp_path / "run"
    assert train(run, "controller.candidates=[2,4,65536]") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: controller.candidates: the largest candidate G")
    assert "GiB per device against" in err and "train.memory_check=false" in err
    assert not run.exists()  # the refused start left no directory behind


def test_the_memory_check_names_the_fixed_size_key(tmp_path, capsys, no_model):
    args = ["controller.kind=fixed", "controller.group_size=65536"]
    assert train(tmp_path / "run", *args) == 2
    assert "error: controller.group_size: the largest" in capsys.readouterr().err


def test_a_directory_that_cannot_be_written_is_refused_first(
    tmp_path, capsys, monkeypatch, no_model
):
    real_open = os.open

    def read_only(path, *args, **kwargs):  # root may write anywhere: refuse the lock file
        if str(path).endswith(LOCK_FILE):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(runlock.os, "open", read_only)
    run = tmp_path / "run"
    run.mkdir()
    assert train(run) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {run}: cannot write the run directory (Permission denied); make it writable "
        f"or use another logging.run_dir"
    )


def test_a_disk_without_room_for_a_checkpoint_is_refused_before_compiling(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(disk, "free_bytes", lambda directory: 1000)

    def no_compile(*args, **kwargs):
        raise AssertionError("a sampler was built before the disk check")

    monkeypatch.setattr(loop, "policy_sampler", no_compile)
    run = tmp_path / "run"
    assert train(run) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {run}: 1000 B free on its disk, one checkpoint needs about")
    assert not run.exists()


@pytest.mark.slow
def test_a_finished_run_leaves_no_lock_file(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run) == 0
    assert (run / "checkpoints").is_dir() and not (run / LOCK_FILE).exists()
    assert train(run) == 0  # finished: read, and released again
    assert "is finished" in capsys.readouterr().out and not (run / LOCK_FILE).exists()


# ---------------------------------------------------------------------- a padded vocabulary


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """Tiny Hugging Face checkpoints whose embeddings have 512 rows (more than the character
    tokenizer's ids) and exactly the character tokenizer's ids."""
    from flax import nnx

    from sagc_jax.models import Decoder, get_preset, save_hf_checkpoint
    from sagc_jax.tasks import CharTokenizer

    root = tmp_path_factory.mktemp("vocab")
    for name, rows in [("padded", 512), ("exact", CharTokenizer().vocab_size)]:
        arch = get_preset("tiny").replace(vocab_size=rows)
        save_hf_checkpoint(Decoder(arch, rngs=nnx.Rngs(0)), arch, str(root / name))
    return root


def test_a_checkpoint_with_more_rows_than_the_tokenizer_has_ids_is_refused_before_step_0(
    hf_checkpoints, tmp_path, capsys
):
    """Before: the rollouts drew ids past the character tokenizer's and the run ended
    mid-sampling with `CharTokenizer: id 488 is out of range`."""
    from sagc_jax.tasks import CharTokenizer

    ids = CharTokenizer().vocab_size
    padded = hf_checkpoints / "padded"
    run = [*TINY, "train.steps=1", "logging.tensorboard=false"]
    args = [
        "train",
        *sets([*run, f"model.hf_checkpoint={padded}", f"logging.run_dir={tmp_path / 'a'}"]),
    ]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert err == (
        f"error: model.hf_checkpoint {padded}: its embedding has 512 rows but the synthetic "
        f"task's character tokenizer has {ids} ids; a rollout could draw an id from {ids} to "
        f"511, which it cannot decode; use data.task=dataset with the checkpoint's tokenizer, "
        f"or a model.preset (sized to the {ids} ids) for the synthetic task\n"
    )
    assert "compiled" not in out and not (tmp_path / "a").exists()  # refused before step 0

    # a checkpoint sized to the character tokenizer trains
    exact = hf_checkpoints / "exact"
    args = [
        "train",
        *sets([*run, f"model.hf_checkpoint={exact}", f"logging.run_dir={tmp_path / 'b'}"]),
    ]
    assert main(args) == 0
