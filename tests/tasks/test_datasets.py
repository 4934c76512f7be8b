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


# --------------------------------------------------------------------------- prompt lengths
# Every prompt is tokenised as the sampler will see it when the source is built, before step 0.


def dataset_source(tmp_path, path, *overrides, log=None, shard=(0, 1)):
    """``make_source`` of a dataset run with the tiny word tokenizer (no model is built)."""
    from helpers import RAW_ROWS, TINY, write_word_tokenizer

    from sagc_jax.config import load_config
    from sagc_jax.models import Tokenizer
    from sagc_jax.tasks.source import make_source

    tok_dir = tmp_path / "tok"
    if not tok_dir.exists():
        write_word_tokenizer(tok_dir)
    sets = [
        *TINY,
        "data.task=dataset",
        *RAW_ROWS,
        f"data.path={path}",
        f"model.tokenizer={tok_dir}",
    ]
    cfg = load_config(None, [*sets, *overrides])
    notes = [] if log is None else log
    return make_source(cfg, Tokenizer.from_dir(str(tok_dir)), *shard, log=notes.append)


def sums(lengths):
    """Rows whose prompts are ``n`` word tokens ("1 2 ..."), answers their index."""
    return [{"prompt": " ".join(["1"] * n), "answer": str(i)} for i, n in enumerate(lengths)]


def test_a_20000_token_prompt_stops_the_load_naming_its_line(tmp_path, capsys):
    from helpers import RAW_ROWS, TINY

    from sagc_jax.cli import main

    path = write_jsonl(tmp_path / "d.jsonl", [*sums([3] * 6), "", *sums([20_000, 4])])
    with pytest.raises(DatasetError) as info:
        dataset_source(tmp_path, path)
    message = str(info.value)
    assert message.startswith(f"{path}:8: the prompt has 20000 tokens, over the limit of 16 ")
    assert "largest sampling.prompt_buckets entry" in message
    assert "data.on_long_prompt=skip" in message and "\n" not in message
    # the train command: one line, exit 2, before step 0 (no metrics written)
    sets = [
        *TINY,
        "data.task=dataset",
        *RAW_ROWS,
        f"data.path={path}",
        f"model.tokenizer={tmp_path / 'tok'}",
    ]
    run = tmp_path / "run"
    args = ["train", *[a for s in sets for a in ("--set", s)], "--set", f"logging.run_dir={run}"]
    assert main(args) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert not (run / "metrics.jsonl").exists()


def test_the_limit_counts_the_chat_template_and_the_model_positions(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", sums([14, 3]))  # 14 words + "user: assistant:"
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: the prompt has 16 tokens with the chat"):
        dataset_source(tmp_path, path, "data.chat_template=true", "sampling.prompt_buckets=[8]")
    # the tiny preset has 2048 positions: bucket 2048 leaves no room for 12 new tokens
    path = write_jsonl(tmp_path / "e.jsonl", sums([3, 40]))
    with pytest.raises(DatasetError) as info:
        dataset_source(tmp_path, path, "sampling.prompt_buckets=[32,2048]")
    assert str(info.value).startswith(f"{path}:2: the prompt has 40 tokens, over the limit of 32")
    assert "model.preset tiny has 2048 positions, sampling.max_new_tokens = 12" in str(info.value)


def test_an_empty_prompt_is_an_error(tmp_path):
    # the word tokenizer adds no bos: an empty prompt would be 0 tokens
    path = write_jsonl(tmp_path / "d.jsonl", [*sums([3, 3]), {"prompt": "", "answer": "1"}])
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}:3: the prompt is empty"):
        dataset_source(tmp_path, path, "data.on_long_prompt=skip")


def test_a_long_held_out_prompt_stops_the_load(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", sums([3, 4, 5]))
    held = write_jsonl(tmp_path / "held.jsonl", sums([3, 17, 4]))  # bucket 16
    with pytest.raises(DatasetError) as info:
        dataset_source(tmp_path, train, f"data.eval_path={held}")
    assert str(info.value).startswith(f"{held}:2: the prompt has 17 tokens, over the limit of 16")


def test_skip_leaves_long_rows_out_and_says_how_many_once(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", sums([3, 30, 4, 5, 20_000, 6, 7]))
    notes = []
    source = dataset_source(tmp_path, path, "data.on_long_prompt=skip", log=notes)
    assert [r.answer for r in source.rows] == ["0", "2", "3", "5", "6"]
    assert [p.answer for p in source.heldout(10)] == ["0", "2", "3", "5", "6"]
    assert notes == [
        f"data: the evaluation reads the first rows of the training file {path} "
        "(data.eval_split = 0, no data.eval_path): its accuracy is not held-out",
        f"data: skipped 2 of 7 rows of {path}: prompts over 16 tokens (the largest "
        "sampling.prompt_buckets entry; data.on_long_prompt: skip)",
    ]
    # two processes: the shards partition the rows kept, the held-out rows are the whole file's,
    # and only process 0 says it (once, though it reads the file twice)
    notes = []
    shards = [
        dataset_source(tmp_path, path, "data.on_long_prompt=skip", log=notes, shard=(i, 2))
        for i in range(2)
    ]
    assert [[r.answer for r in s.rows] for s in shards] == [["0", "3", "6"], ["2", "5"]]
    assert [p.answer for p in shards[1].heldout(10)] == ["0", "2", "3", "5", "6"]
    assert len(notes) == 2
    # the same prompts in the same order every time the source is built (a resumed run)
    again = dataset_source(tmp_path, path, "data.on_long_prompt=skip")
    assert again.batch(3, 0, 2) == source.batch(3, 0, 2)


def test_the_held_out_split_is_seeded_and_never_trained_on(tmp_path):
    """Without data.eval_path, data.eval_split rows drawn by data.seed are held out, and no row
    with a held-out prompt is trained on; every process draws the same split."""
    rows = [{"prompt": f"what is {i % 10} plus 1", "answer": str(i % 10 + 1)} for i in range(14)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)  # every prompt twice (rows i and i + 10)
    notes = []
    source = dataset_source(tmp_path, path, "data.eval_split=3", log=notes)
    held = {p.text for p in source.heldout(10)}
    assert len(held) == 3 and not held & {r.prompt for r in source.rows}
    kept = {i for i, r in enumerate(rows) if r["prompt"] not in held}  # duplicates left out too
    assert {r.index for r in source.rows} == kept and len(kept) < 11
    assert notes[0].startswith(f"data: held-out: 3 rows of {path} drawn by data.seed = 0")
    shards = [dataset_source(tmp_path, path, "data.eval_split=3", shard=(i, 2)) for i in (0, 1)]
    assert all({p.text for p in s.heldout(10)} == held for s in shards)
    assert sorted(r.index for s in shards for r in s.rows) == sorted(r.index for r in source.rows)
    other = dataset_source(tmp_path, path, "data.eval_split=3", "data.seed=1")
    assert {p.text for p in other.heldout(10)} != held  # another seed, another draw


def test_a_file_too_small_for_its_split_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DatasetError, match=r"data.eval_split = 7 held-out rows leave none of"):
        dataset_source(tmp_path, path, "data.eval_split=7")


def test_a_chat_tokenizer_gets_its_template_unless_told_otherwise(tmp_path):
    from helpers import write_word_tokenizer

    from sagc_jax.models import Tokenizer

    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    write_word_tokenizer(tmp_path / "tok")
    assert Tokenizer.from_dir(str(tmp_path / "tok")).chat_template is not None
    notes = []
    auto = dataset_source(tmp_path, path, "data.chat_template=null", log=notes)
    raw = dataset_source(tmp_path, path, "data.chat_template=false")
    prompt = raw.heldout(1)[0]
    assert auto.encode(prompt) != raw.encode(prompt)
    assert auto.encode(prompt) == auto.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=True
    )
    assert [n for n in notes if "chat template" in n] == [
        "data: prompts go through the tokenizer's chat template (data.chat_template unset and "
        "the tokenizer has one; set it to false for raw prompts)"
    ]


def test_auto_buckets_from_the_data_and_from_the_synthetic_task(tmp_path):
    from helpers import TINY

    from sagc_jax.config import load_config
    from sagc_jax.tasks.prompt_source import auto_buckets
    from sagc_jax.tasks.source import make_source

    path = write_jsonl(tmp_path / "d.jsonl", sums([5, 61, 20]))
    held = write_jsonl(tmp_path / "held.jsonl", sums([150, 9]))
    notes = []
    source = dataset_source(
        tmp_path, path, f"data.eval_path={held}", "sampling.prompt_buckets=auto", log=notes
    )
    assert source.prompt_buckets == (24, 40, 80, 152)  # 150 -> 152, halving while >= 5
    assert notes == [
        "data: sampling.prompt_buckets auto -> [24, 40, 80, 152] (prompts of 5 to 150 tokens)"
    ]
    cfg = load_config(None, [*TINY, "sampling.prompt_buckets=auto"])
    # synthetic prompts: bos + 2..4 one-digit terms with a sign each = 5..9 tokens
    assert make_source(cfg, log=notes.append).prompt_buckets == (8, 16)
    assert auto_buckets(100, 100, 2036) == (104,) and auto_buckets(1, 3000, 2036) == (
        256,
        512,
        1024,
        2036,
    )
    # more than the model's positions allow after max_new_tokens: the same one-line error
    long = write_jsonl(tmp_path / "long.jsonl", sums([3, 2040]))
    with pytest.raises(DatasetError, match=r"long\.jsonl:2: the prompt has 2040 tokens, over the"):
        dataset_source(tmp_path, long, "sampling.prompt_buckets=auto")


def test_synthetic_prompts_must_fit_the_largest_bucket():
    from helpers import TINY

    from sagc_jax.config import ConfigError, load_config
    from sagc_jax.tasks.source import make_source

    cfg = load_config(None, [*TINY, "data.max_terms=8", "data.max_digits=2"])
    with pytest.raises(ConfigError, match="synthetic prompts reach 25 tokens .* at most 16 fit"):
        make_source(cfg)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    from sagc_jax.config import ConfigError

    (tmp_path / "tok").mkdir()
    words = ["<pad>", "</s>", "<unk>", *[f"w{i}" for i in range(600)]]
    Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")).save(
        str(tmp_path / "tok" / "tokenizer.json")
    )
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    path = write_jsonl(tmp_path / "d.jsonl", sums([3]))
    with pytest.raises(
        ConfigError, match=r"tok: 603 tokens, more than the 512 embeddings of model"
    ):
        dataset_source(tmp_path, path)
