"""Run records: written whole, read only when whole and unedited, refused under another config;
``compare --records`` skips recorded runs, and ``--from-records`` rebuilds the tables alone."""

import json

import pytest
from helpers import TINY

from sagc_jax.analysis.records import (
    RecordError,
    check_record,
    config_sha256,
    make_record,
    read_record,
    run_name,
    write_record,
)
from sagc_jax.cli import main
from sagc_jax.config import load_config, to_dict

STEPS = [{"step": 1, "group_size": 2, "lengths": [[3, 4], [5, 9]], "rewards": [[0, 1], [0, 0]]}]
EVALS = [{"step": 0, "eval/accuracy": 0.25}]


def _record(overrides=(), steps=STEPS):
    cfg = load_config(None, [*TINY, *overrides])
    return cfg, make_record(
        run_name("fixed:2", 1),
        "fixed:2",
        1,
        cfg,
        cfg,
        steps,
        EVALS,
        segments=[{"step": 0, "commit": "abc", "dirty": False, "host": {"cores": 2}}],
        weights={"preset": "tiny", "seed": 1},
        data={},
    )


def test_a_record_reads_back_as_written(tmp_path):
    cfg, record = _record()
    path = tmp_path / "fixed2-seed1.json"
    write_record(path, record)
    back = read_record(path)
    assert back == record
    assert back["run"] == "fixed2-seed1" and back["steps"] == STEPS and back["evals"] == EVALS
    assert not list(tmp_path.glob("*.tmp"))
    check_record(back, cfg, path, {"preset": "tiny", "seed": 1})  # the same config: accepted


def test_a_truncated_or_edited_record_is_refused(tmp_path):
    _, record = _record()
    path = tmp_path / "r.json"
    write_record(path, record)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(RecordError, match=r"r\.json: truncated or not JSON .*git checkout"):
        read_record(path)
    path.write_text(text.replace('"eval/accuracy": 0.25', '"eval/accuracy": 0.5'))
    with pytest.raises(RecordError, match=r"r\.json: its content does not match its sha256"):
        read_record(path)
    path.write_text(json.dumps({"steps": []}))
    with pytest.raises(RecordError, match="not a sagc-jax run record"):
        read_record(path)


def test_another_config_is_refused_naming_the_keys(tmp_path):
    _, record = _record()
    path = tmp_path / "r.json"
    other = load_config(None, [*TINY, "train.learning_rate=0.5"])
    with pytest.raises(RecordError) as err:
        check_record(record, other, path)
    line = str(err.value)
    assert "\n" not in line
    assert "train.learning_rate = 0.001 there, 0.5 here" in line and str(path) in line
    # a key the config gained since the record was made counts at its default
    del record["config"]["controller"]["tau"]
    check_record(record, load_config(None, TINY), path)
    with pytest.raises(RecordError, match="other weights"):
        check_record(record, load_config(None, TINY), path, {"preset": "tiny", "seed": 2})


def test_where_files_go_and_how_programs_compile_are_not_the_config():
    """Keys of ``option(outcome=False)`` (logging, checkpoints, the compilation cache, the HF
    checkpoint's path) leave the record's config hash as it is."""
    cfg = load_config(None, TINY)
    same = load_config(
        None,
        [
            *TINY,
            "logging.run_dir=/elsewhere",
            "train.checkpoint_every=1",
            "train.compile_ahead=true",
            "train.compilation_cache_dir=null",
            "model.hf_checkpoint=/somewhere/SmolLM2",
        ],
    )
    assert config_sha256(to_dict(cfg)) == config_sha256(to_dict(same))
    other = load_config(None, [*TINY, "controller.tau=2.5"])
    assert config_sha256(to_dict(cfg)) != config_sha256(to_dict(other))


@pytest.mark.slow
def test_compare_writes_records_skips_them_and_rebuilds_from_them(tmp_path, capsys):
    records = tmp_path / "records"
    base = [
        "compare",
        "--config",
        "configs/demo.yaml",
        *[a for o in [*TINY, "train.eval_size=4", "logging.plots=false"] for a in ("--set", o)],
        "--controllers",
        "fixed:2,sagc",
        "--seeds",
        "1",
        "--steps",
        "2",
        "--records",
        str(records),
    ]
    assert main([*base, "--set", f"logging.run_dir={tmp_path / 'a'}"]) == 0
    printed = capsys.readouterr().out
    names = ["fixed2-seed0", "sagc-seed0"]
    assert sorted(p.stem for p in records.glob("*.json")) == names
    assert printed.count("wrote its record") == 2
    first = read_record(records / "fixed2-seed0.json")
    assert len(first["steps"]) == 2 and first["segments"][0]["step"] == 0
    assert first["segments"][0]["host"]["cores"] >= 1
    assert first["steps"][0]["rewards"] and first["steps"][0]["prompt_ids"]
    # the step-0 evaluation was taken once and reused, marked with the run it came from
    later = read_record(records / "sagc-seed0.json")["evals"][0]
    assert later["eval_from"] == "fixed2-seed0"
    values = [
        {k: v for k, v in e.items() if k.startswith("eval/")} for e in (later, first["evals"][0])
    ]
    assert values[0] == values[1] and "time/compile_s" in later  # its own compile seconds
    tables = (tmp_path / "a" / "compare.md").read_text()

    # the same study again, elsewhere: every run is recorded, none is run
    assert main([*base, "--set", f"logging.run_dir={tmp_path / 'b'}"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("not run again") == 2 and not (tmp_path / "b" / "fixed2-seed0").exists()
    assert (tmp_path / "b" / "compare.md").read_text() == tables

    # from the records alone
    out_c = ["--set", f"logging.run_dir={tmp_path / 'c'}", "--from-records"]
    assert main([*base, *out_c]) == 0
    assert (tmp_path / "c" / "compare.md").read_text() == tables

    # a record missing mid-way, one made under another config: one line each, nothing written
    (records / "sagc-seed0.json").rename(tmp_path / "aside.json")
    assert main([*base, *out_c]) == 2
    err = capsys.readouterr().err
    assert "sagc-seed0.json: missing (1 of 2 runs recorded)" in err and err.count("\n") == 1
    (tmp_path / "aside.json").rename(records / "sagc-seed0.json")
    assert main([*base, *out_c, "--set", "controller.delta=0.05"]) == 2
    err = capsys.readouterr().err
    assert "fixed2-seed0.json: made under another config" in err
    assert "controller.delta" in err and err.count("\n") == 1
    assert sorted(p.stem for p in records.glob("*.json")) == names
