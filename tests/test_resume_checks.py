"""What a resume checks beyond the config (train/loop.py): the data files are the ones the
checkpoint was trained on (path, size, sha256). Each test is a row of README's Reliability
table."""

import json

from helpers import TINY, sets

from sagc_jax.cli import main

ROWS = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(4) for b in range(4)]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_resume_on_changed_data_is_refused_unless_allowed(tmp_path, capsys):
    data = write_rows(tmp_path / "train.jsonl", ROWS)
    tok = tmp_path / "tok"
    assert main(["tokenizer", "--data", str(data), "--out", str(tok), "--kind", "char"]) == 0
    run = tmp_path / "run"
    base = [
        *TINY,
        f"model.tokenizer={tok}",
        "data.task=dataset",
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
