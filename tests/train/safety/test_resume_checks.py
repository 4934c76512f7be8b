"""What a resume checks beyond the config (train/safety/run_state.py): the data files are the
ones the checkpoint was trained on (path, size, sha256). Each test is a row of the Reliability
table in docs/reliability.md."""

import json

import pytest
from helpers import RAW_ROWS, TINY, sets

from sagc_jax.cli import main

ROWS = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(4) for b in range(4)]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_a_resume_on_changed_data_is_refused_unless_allowed(tmp_path, capsys):
    data = write_rows(tmp_path / "train.jsonl", ROWS)
    tok = tmp_path / "tok"
    assert main(["tokenizer", "--data", str(data), "--out", str(tok), "--kind", "char"]) == 0
    run = tmp_path / "run"
    base = [
        *TINY,
        f"model.tokenizer={tok}",
        "data.task=dataset",
        *RAW_ROWS,
        f"data.path={data}",
        "train.eval_size=2",
        "train.checkpoint_every=1",
        "train.async_checkpoint=false",
        "logging.tensorboard=false",
        f"logging.run_dir={run}",
    ]
    assert main(["train", *sets([*base, "train.steps=1"])]) == 0
    capsys.readouterr()
    write_rows(data, ROWS[::-1])  # edited between a stop and a resume: same size, other rows
    assert main(["train", *sets([*base, "train.steps=2"])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"error: {data}: changed since the checkpoint of step 1 (data.path: ")
    assert "set train.resume_changed_data=true to continue at step 1" in err
    allowed = [*base, "train.steps=2", "train.resume_changed_data=true"]
    assert main(["train", *sets(allowed)]) == 0
    out = capsys.readouterr().out
    assert "continuing at step 1 on the new contents (train.resume_changed_data)" in out
    assert "resuming" in out and "train done" in out
    # the checkpoint of step 2 records the new contents: the same file resumes without a word
    assert main(["train", *sets([*base, "train.steps=3"])]) == 0
    assert "changed since" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_gradient_spike_holds_checkpoints_back_and_names_the_restart_point(
    tmp_path, capsys, monkeypatch
):
    """Steps 1-4 normal, a gradient-norm spike at step 5, then non-finite updates: no
    checkpoint after the spike, the divergence names step 4 and how to restart from it."""
    import sagc_jax.train.loop as loop

    real_update = loop.Trainer._update

    def scripted(self, batch, key, has_signal):
        metrics = real_update(self, batch, key, has_signal)
        step = self.step + 1  # the step being trained
        # (the tiny random policy's gradients are 0: its rewards do not vary; set the norms)
        metrics["grad_norm"] = 1000.0 if step == 5 else 1.0 + 0.1 * step
        if step >= 6:
            metrics["skipped"] = 1.0
        return metrics

    monkeypatch.setattr(loop.Trainer, "_update", scripted)
    run = tmp_path / "run"
    args = [
        *TINY,
        "train.steps=20",
        "train.checkpoint_every=1",
        "train.async_checkpoint=false",
        "train.spike_window=4",
        "logging.tensorboard=false",
        f"logging.run_dir={run}",
    ]
    assert main(["train", *sets(args)]) == 3
    captured = capsys.readouterr()
    assert "step 5: gradient norm" in captured.out and "train.spike_factor 10" in captured.out
    assert "step 6: checkpoint held back after the gradient-norm spike of step 5" in captured.out
    assert captured.err.strip() == (
        "error: step 8: the loss or gradient was not finite in 3 steps in a row "
        "(train.max_nonfinite_steps); checkpoint step 4, from before the gradient-norm spike of "
        f"step 5, is the last saved: start a new run from it with a lower learning rate (--set "
        f"train.init_checkpoint={run} --set train.learning_rate=... and a new logging.run_dir), "
        "or check the rewards"
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit())[-1] == "4"
    monkeypatch.setattr(loop.Trainer, "_update", real_update)
    restart = [*TINY, "train.steps=1", "train.learning_rate=1e-4", "logging.tensorboard=false"]
    restart += [f"train.init_checkpoint={run}", f"logging.run_dir={tmp_path / 'restart'}"]
    assert main(["train", *sets(restart)]) == 0
