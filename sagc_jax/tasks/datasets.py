"""Prompt/answer datasets from JSONL or Parquet files, validated row by row, sharded per process.

Every row is a record with at least ``prompt`` (str) and ``answer`` (str); other fields are kept
in :attr:`Example.fields`. The format follows the suffix: ``.jsonl``/``.ndjson`` (one JSON object
per line; blank lines are skipped but still counted) or ``.parquet``/``.pq`` (needs pyarrow).

Anything wrong raises :class:`DatasetError` with a one-line message that starts with where it is:
``data.jsonl:7: ...`` (1-based line number) or ``data.parquet: row 6: ...`` (0-based row index),
then the field, the bad value and what is allowed. All rows are validated in every process, so
every process of a multi-host run fails on the same row, whichever shard it keeps.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["REQUIRED_FIELDS", "DatasetError", "Example", "load_dataset", "shard_rows"]

REQUIRED_FIELDS = ("prompt", "answer")
_JSONL = (".jsonl", ".ndjson")
_PARQUET = (".parquet", ".pq")


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or has a bad row (message is one line)."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One validated row: its ``prompt`` and reference ``answer``, ``where`` it came from
    (``path:line`` or ``path: row i``) and all its ``fields`` (extra ones included)."""

    prompt: str
    answer: str
    where: str
    fields: dict[str, Any]
    index: int = -1  # the row's index among the file's data rows (a stable prompt id)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _validate(row: Any, where: str) -> Example:
    allowed = ", ".join(f"'{f}' (str)" for f in REQUIRED_FIELDS)
    if not isinstance(row, dict):
        raise DatasetError(
            f"{where}: expected an object with fields {allowed}, got {type(row).__name__} "
            f"{_short(row)}"
        )
    for name in REQUIRED_FIELDS:
        if name not in row:
            raise DatasetError(f"{where}: missing field '{name}'; every row needs {allowed}")
        value = row[name]
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            hint = "a string column" if ": row " in where else f'quote numbers: "{name}": "17"'
            raise DatasetError(
                f"{where}: field '{name}' = {_short(value)} has type {kind}; expected a string "
                f"({hint})"
            )
    return Example(row["prompt"], row["answer"], where, row)


def _open(path: Path):
    try:
        return path.open("rb")
    except OSError as err:
        raise DatasetError(f"{path}: cannot read the dataset file ({err.strerror})") from None


def _jsonl_rows(path: Path) -> Iterator[tuple[Any, str]]:
    with _open(path) as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(
                    f"{path}:{lineno}: not valid UTF-8 text (byte {err.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                raise DatasetError(
                    f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno})"
                ) from None
            yield row, f"{path}:{lineno}"


def _parquet_rows(path: Path) -> Iterator[tuple[Any, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or use JSONL"
        ) from None
    _open(path).close()
    try:
        table = pq.read_table(path)
    except OSError as err:  # pyarrow raises OSError subclasses (ArrowIOError) for bad files
        reason = err.strerror or str(err).splitlines()[0]
        raise DatasetError(f"{path}: cannot read the dataset file ({reason})") from None
    except Exception as err:  # corrupt footer, unsupported encoding: still one line
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DatasetError(f"{path}: cannot read the Parquet file ({reason})") from None
    for i, row in enumerate(table.to_pylist()):
        yield row, f"{path}: row {i}"


def load_dataset(
    path: str | Path,
    shard_index: int = 0,
    num_shards: int = 1,
    keep: Callable[[Example], bool] | None = None,
) -> list[Example]:
    """Read and validate every row of ``path``; keep rows ``shard_index::num_shards``.

    Row numbering for sharding counts data rows only (blank JSONL lines excluded), so the
    ``num_shards`` shards partition the file. ``keep`` (optional) sees every valid row in file
    order, in every process, before sharding; a row it returns False for is left out and the
    shards partition the rows kept (it may also raise DatasetError for a row). Raises
    :class:`DatasetError` for a missing or unreadable file, an unknown suffix, a bad row, an
    empty file, a file whose rows were all left out or an empty shard, and ValueError for shard
    arguments outside ``0 <= shard_index < num_shards``.
    """
    if not (isinstance(num_shards, int) and num_shards >= 1):
        raise ValueError(f"load_dataset: num_shards = {num_shards!r} must be an integer >= 1")
    if not (isinstance(shard_index, int) and 0 <= shard_index < num_shards):
        raise ValueError(
            f"load_dataset: shard_index = {shard_index!r} is out of range; "
            f"allowed: 0 <= shard_index < num_shards = {num_shards}"
        )
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in _JSONL:
        rows = _jsonl_rows(path)
    elif suffix in _PARQUET:
        rows = _parquet_rows(path)
    else:
        raise DatasetError(
            f"{path}: unknown dataset format {suffix or '(no suffix)'!r}; "
            f"allowed suffixes: {', '.join(_JSONL + _PARQUET)}"
        )
    examples, seen = [], 0
    for row, where in rows:
        example = dataclasses.replace(_validate(row, where), index=seen)
        seen += 1
        if keep is None or keep(example):
            examples.append(example)
    if seen == 0:
        raise DatasetError(f"{path}: the dataset has no rows")
    if not examples:
        raise DatasetError(f"{path}: all {seen} rows were skipped; no prompt is left to train on")
    skipped = f" after skipping {seen - len(examples)}" if seen > len(examples) else ""
    return shard_rows(examples, shard_index, num_shards, path, f"the file has {{}} rows{skipped}")


def shard_rows(
    examples: list[Example], shard_index: int, num_shards: int, path, rows_are: str
) -> list[Example]:
    """Rows ``shard_index::num_shards`` of ``examples`` (every process holds them all); a
    DatasetError naming ``path`` when that shard is empty, ``rows_are`` saying what the rows
    are (``{}`` for their count)."""
    mine = examples[shard_index::num_shards]
    if not mine:
        raise DatasetError(
            f"{path}: shard {shard_index} of {num_shards} is empty "
            f"({rows_are.format(len(examples))}); use fewer shards than rows"
        )
    return mine
