"""``sagc-jax export`` is whole or absent: it writes into the sibling OUT.export-tmp and renames
it at the end. A write that fails (here a full disk, half a safetensors file written) leaves
nothing at OUT and no temporary folder, in one line; one left by an export that was killed is
removed, with a line, by the rerun. A row of the Reliability table in docs/reliability.md."""

import errno
import json
import os

from helpers import TINY, sets

from sagc_jax.cli import main
from sagc_jax.models import hf_checkpoint

RUN = [*TINY, "train.steps=1", "train.checkpoint_every=1", "logging.tensorboard=false"]


def test_an_export_that_fails_mid_write_leaves_nothing_and_a_rerun_completes(
    tmp_path, monkeypatch, capsys
):
    run, out = tmp_path / "run", tmp_path / "out"
    staging = tmp_path / "out.export-tmp"
    assert main(["train", *sets([*RUN, f"logging.run_dir={run}"])]) == 0
    capsys.readouterr()

    def full_disk(tensors, path, stem="model", max_shard_bytes=None):
        (tmp_path / "seen").write_text(path)
        with open(os.path.join(path, f"{stem}.safetensors"), "wb") as f:
            f.write(b"\x00" * 100)  # half a file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(hf_checkpoint, "write_safetensors", full_disk)
    assert main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: no space left on {tmp_path} (the disk mounted at ")
    assert f"while exporting to {out}: nothing was written there; free space" in err
    assert (tmp_path / "seen").read_text() == str(staging)  # written beside OUT, not into it
    assert not out.exists() and not staging.exists()
    monkeypatch.undo()

    # an export killed mid-write (SIGKILL: no clean-up) left its temporary folder behind
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"\x00" * 100)
    assert main(["export", str(run), str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"export: removed {staging}, left by an export that did not finish"
    assert "(full fine-tuning)" in lines[1]
    assert not staging.exists()
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["vocab_size"] > 0
    assert (out / "model.safetensors").stat().st_size > 1000
