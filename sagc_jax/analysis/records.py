"""A study's run records: what outlives the machine a study ran on.

``sagc-jax compare --records DIR`` writes, as each run of the study finishes, one small JSON file
``DIR/<controller>-seed<k>.json`` meant to be committed (no checkpoints): the run's metrics lines
(every step's lengths, group signal, rewards and prompts, G, the controller's state), its
evaluations, the config it was given and as resolved, the sha256 of the config keys that can
change what a run computes (``option(outcome=...)``), the weights' and the data's identity, the
HF model's config.json (so that the step-time model re-times the lengths on a machine without
the weights) and, for each segment of the run (a resumed run has several), the code's commit
and the host it ran on. The tables, dominance and plots of ``compare`` are rebuilt from the
records alone (``compare --from-records``).

A record carries the sha256 of its own content: a truncated or hand-edited one is refused, not
read, and a record made under another config than the study's is refused with the keys that
differ. Reading a record does not import jax.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from sagc_jax.config import Config, ConfigError, from_dict, to_dict
from sagc_jax.config.saved import config_differences, key_flag

FORMAT = "sagc-jax run record"
VERSION = 1
PROVENANCE = "provenance.jsonl"  # in a run directory: one line per segment of the run


class RecordError(ConfigError):
    """A record that cannot be read as the study's (one line naming the file)."""


def run_name(spec: str, seed: int) -> str:
    """A study run's name: its run directory's and its record's (``fixed8-seed1``)."""
    return f"{spec.replace(':', '')}-seed{seed}"


def outcome_config(tree: dict, prefix: str = "") -> dict:
    """A ``to_dict`` config tree without the keys that cannot change what a run computes (where
    files go, logging, checkpoint cadence, compilation: ``option(outcome=False)``)."""
    kept = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            kept[key] = outcome_config(value, f"{dotted}.")
        elif key_flag(dotted, "outcome"):
            kept[key] = value
    return kept


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def config_sha256(tree: dict) -> str:
    """The sha256 of a config tree's outcome keys (``outcome_config``)."""
    return hashlib.sha256(_canonical(outcome_config(tree))).hexdigest()


# ---------------------------------------------------------------------- provenance


def code_version() -> dict:
    """The commit of the checkout this package runs from (None outside a git checkout) and
    whether its tracked files differ from it."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = None if commit is None else bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit, "dirty": dirty}


def host_facts() -> dict:
    """What a run's wall-clock times depend on: the processor, its cores, the jax version and
    the devices it ran on."""
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }


def note_segment(run_dir: Path, step: int) -> None:
    """Append the code and host a run (re)starts on, at ``step``, to its ``provenance.jsonl``."""
    line = {
        "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **code_version(),
        "host": host_facts(),
    }
    with (Path(run_dir) / PROVENANCE).open("a") as f:
        f.write(json.dumps(line) + "\n")


def read_segments(run_dir: Path) -> list[dict]:
    """The segments ``note_segment`` noted (a torn last line is left out)."""
    path = Path(run_dir) / PROVENANCE
    if not path.is_file():
        return []
    segments = []
    for line in path.read_text().splitlines():
        try:
            segments.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return segments


# ---------------------------------------------------------------------- records


def make_record(
    name: str,
    spec: str,
    seed: int,
    given: Config,
    resolved: Config,
    steps: list[dict],
    evals: list[dict],
    *,
    segments: list[dict],
    weights: dict,
    data: dict,
) -> dict:
    """A finished run's record (see the module docstring), its own sha256 included."""
    checkpoint = resolved.model.hf_checkpoint
    model_config = None
    if checkpoint and (Path(checkpoint) / "config.json").is_file():
        model_config = json.loads((Path(checkpoint) / "config.json").read_text())
    given_tree = to_dict(given)
    record = {
        "format": FORMAT,
        "version": VERSION,
        "run": name,
        "controller": spec,
        "seed": seed,
        "config": given_tree,
        "config_sha256": config_sha256(given_tree),
        "resolved": to_dict(resolved),
        "weights": weights,
        "model": {"name": Path(checkpoint).name, "config": model_config} if checkpoint else None,
        "data": data,
        "segments": segments,
        "steps": steps,
        "evals": evals,
    }
    record["sha256"] = hashlib.sha256(_canonical(record)).hexdigest()
    return record


def write_record(path: Path, record: dict) -> None:
    """Write ``record`` to ``path`` whole (through a sibling renamed over it) or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    try:
        partial.write_text(json.dumps(record) + "\n")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def read_record(path: Path) -> dict:
    """A record as written, checked whole: RecordError (one line naming ``path`` and what to
    do) when it is truncated, not a record, of another format version, or edited since."""
    fix = f"restore it (git checkout -- {path}) or delete it to run that run again"
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RecordError(
            f"{path}: truncated or not JSON (line {err.lineno}, column {err.colno}); {fix}"
        ) from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise RecordError(f"{path}: not a sagc-jax run record; {fix}")
    if record.get("version") != VERSION:
        raise RecordError(
            f"{path}: record version {record.get('version')!r}; this sagc-jax reads {VERSION}"
        )
    digest = record.pop("sha256", None)
    if digest != hashlib.sha256(_canonical(record)).hexdigest():
        raise RecordError(f"{path}: its content does not match its sha256 (edited?); {fix}")
    record["sha256"] = digest
    return record


def check_record(record: dict, given: Config, path: Path, weights: dict | None = None) -> None:
    """RecordError (one line) when ``record`` was not made under ``given`` (the study's config
    for that run): the outcome keys that differ, or other weights (``weights``: None, not
    checked). A key added to the config since the record was made counts at its default."""
    here = to_dict(given)
    try:
        made = to_dict(from_dict(record["config"]))
    except ConfigError:
        made = record["config"]  # a key since removed or renamed: compared as written
    differ = config_differences(outcome_config(made), outcome_config(here))
    if differ:
        shown = [f"{k} = {_at(record['config'], k)!r} there, {_at(here, k)!r} here" for k in differ]
        more = f" (+{len(shown) - 2} more)" if len(shown) > 2 else ""
        raise RecordError(
            f"{path}: made under another config than this study's: {'; '.join(shown[:2])}{more}; "
            "move the record away to run that run again, or run the study with its config"
        )
    if weights is not None and record["weights"] != weights:
        raise RecordError(
            f"{path}: made with other weights than this study's (their sha256 differ); move the "
            "record away to run that run again"
        )


def _at(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree
