"""JSONL/Parquet prompt datasets: happy path, every error with its location, sharding."""

import json
import re

import pytest

from sagc_jax.tasks import DatasetError, load_dataset


def write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


ROWS = [{"prompt": f"q{i}", "answer": str(i), "source": "unit"} for i in range(7)]


def test_jsonl_happy_path_keeps_extra_fields_and_skips_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], "", ROWS[1], "   ", *ROWS[2:]])
    examples = load_dataset(path)
    assert [e.prompt for e in examples] == [f"q{i}" for i in range(7)]
    assert [e.answer for e in examples] == [str(i) for i in range(7)]
    assert examples[0].fields["source"] == "unit"
    assert examples[0].where == f"{path}:1" and examples[1].where == f"{path}:3"


@pytest.mark.parametrize(
    "bad, lineno, needle",
    [
        ({"prompt": "q"}, 3, "missing field 'answer'; every row needs 'prompt' (str), 'answer'"),
        ({"answer": "1"}, 3, "missing field 'prompt'"),
        ({"prompt": "q", "answer": 17}, 3, "field 'answer' = 17 has type int; expected a string"),
        ({"prompt": None, "answer": "1"}, 3, "field 'prompt' = None has type null"),
        (["q", "1"], 3, "expected an object with fields 'prompt' (str), 'answer' (str), got list"),
        ('{"prompt": "q", "answer": ', 3, "not valid JSON (Expecting value at column 27)"),
    ],
)
def test_jsonl_errors_name_file_line_and_field(tmp_path, bad, lineno, needle):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], "", bad, ROWS[1]])
    with pytest.raises(DatasetError) as info:
        load_dataset(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{lineno}: ") and needle in message
    assert "\n" not in message


def test_bad_row_outside_the_shard_still_fails(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"prompt": "q"}])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: missing field 'answer'"):
        load_dataset(path, shard_index=0, num_shards=2)


def test_missing_file_empty_file_bad_suffix_bad_utf8(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(missing))}: cannot read the dataset file \(No such"
    ):
        load_dataset(missing)
    empty = write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(empty))}: the dataset has no rows"):
        load_dataset(empty)
    with pytest.raises(DatasetError, match=r"unknown dataset format '\.csv'; allowed suffixes"):
        load_dataset(tmp_path / "d.csv")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(json.dumps(ROWS[0]).encode() + b"\n\xff\xfe\n")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(binary))}:2: not valid UTF-8"):
        load_dataset(binary)
    directory = tmp_path / "dir.jsonl"
    directory.mkdir()
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(directory))}: cannot read the"):
        load_dataset(directory)


def test_sharding_partitions_the_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:3] + [""] + ROWS[3:])
    shards = [load_dataset(path, shard_index=i, num_shards=3) for i in range(3)]
    assert [[e.prompt for e in s] for s in shards] == [
        ["q0", "q3", "q6"],
        ["q1", "q4"],
        ["q2", "q5"],
    ]
    assert sorted(e.prompt for s in shards for e in s) == sorted(r["prompt"] for r in ROWS)
    with pytest.raises(DatasetError, match="shard 7 of 8 is empty \\(the file has 7 rows\\)"):
        load_dataset(path, shard_index=7, num_shards=8)
    with pytest.raises(ValueError, match="shard_index = 3 is out of range"):
        load_dataset(path, shard_index=3, num_shards=3)
    with pytest.raises(ValueError, match="num_shards = 0"):
        load_dataset(path, num_shards=0)


def write_parquet(path, columns):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), path)
    return path


def test_parquet_happy_path_and_sharding(tmp_path):
    cols = {"prompt": [r["prompt"] for r in ROWS], "answer": [r["answer"] for r in ROWS]}
    path = write_parquet(tmp_path / "d.parquet", {**cols, "level": list(range(7))})
    examples = load_dataset(path)
    assert [e.answer for e in examples] == [str(i) for i in range(7)]
    assert examples[2].fields["level"] == 2 and examples[2].where == f"{path}: row 2"
    assert [e.prompt for e in load_dataset(path, 1, 2)] == ["q1", "q3", "q5"]


@pytest.mark.parametrize(
    "columns, needle",
    [
        ({"prompt": ["a", "b"]}, "row 0: missing field 'answer'"),
        ({"prompt": ["a", "b"], "answer": [1, 2]}, "row 0: field 'answer' = 1 has type int"),
        (
            {"prompt": ["a", None], "answer": ["1", "2"]},
            "row 1: field 'prompt' = None has type null",
        ),
    ],
)
def test_parquet_errors_name_file_row_and_field(tmp_path, columns, needle):
    path = write_parquet(tmp_path / "bad.parquet", columns)
    with pytest.raises(DatasetError) as info:
        load_dataset(path)
    assert str(info.value).startswith(f"{path}: {needle}")


def test_parquet_missing_and_corrupt_files(tmp_path):
    pytest.importorskip("pyarrow.parquet")
    missing = tmp_path / "nope.parquet"
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(missing))}: cannot read the dataset file \(No such"
    ):
        load_dataset(missing)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(corrupt))}: cannot read the"):
        load_dataset(corrupt)
