"""``sagc-jax export``: the newest checkpoint of a run as a Hugging Face model directory.

OUT gets config.json and model.safetensors, with a LoRA run's adapters merged into the weights,
and the run's tokenizer files (a dataset run's; the synthetic task's character tokenizer has
none). A LoRA run also gets OUT/adapter/, its adapters alone in PEFT's layout over its base:
``model.hf_checkpoint`` when the run trained over it, otherwise the base is written to
OUT/base/ (a random preset, or the weights of ``train.init_checkpoint``). ``adapters_only``
writes just the PEFT layout into OUT, for a run over ``model.hf_checkpoint``.

An export is whole or absent: everything is written into the sibling OUT.export-tmp, renamed to
OUT at the end. One left by an export that was killed is removed (and said) by the next; a full
disk or a read-only OUT is one line, with nothing left at OUT. A checkpoint that the run's trainer
deletes while it is read (rotating out old steps) is said in one line and the newest that still
verifies exported instead, under its own step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
from flax import nnx

from sagc_jax.config import Config, ConfigError, from_dict
from sagc_jax.models import Decoder, DecoderConfig, lora
from sagc_jax.models.hf_checkpoint import hf_architecture, save_hf_params
from sagc_jax.models.hf_lora import save_merged, save_peft_adapters
from sagc_jax.models.lora import LoRAParam
from sagc_jax.programs.policy import (
    build_model,
    build_tokenizer,
    preset_architecture,
    run_settings,
)
from sagc_jax.programs.state import adapted_architecture
from sagc_jax.tasks import CharTokenizer
from sagc_jax.train.lora_base import base_identity, check_same_base
from sagc_jax.train.metrics import no_space_on
from sagc_jax.train.safety.checkpoint import CheckpointStore, newest_verified_meta
from sagc_jax.train.warm_start import load_run_params

# What transformers' AutoTokenizer reads from a model directory (those the tokenizer has).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
STAGING_SUFFIX = ".export-tmp"  # OUT is written as the sibling OUT.export-tmp, then renamed


@dataclasses.dataclass(frozen=True)
class RunCheckpoint:
    """The newest verified checkpoint of a run: its step, saved config and meta."""

    run: Path
    step: int
    cfg: Config
    meta: dict


def newest_checkpoint(run: Path, unfinished_ok: bool = False) -> RunCheckpoint:
    """The newest verified checkpoint of ``run``; ConfigError (one line) for a directory that is
    not a run, a run without a complete checkpoint, one whose saved config no longer loads, and
    (unless ``unfinished_ok``) a run that has not reached its last step."""
    if not (run / "checkpoints").is_dir():
        what = "no checkpoints/ directory" if run.is_dir() else "no such directory"
        raise ConfigError(f"{run}: {what}; export takes the run directory of sagc-jax train/sft")
    step, meta = newest_verified_meta(run / "checkpoints")
    if step is None:
        raise ConfigError(f"{run / 'checkpoints'}: no complete checkpoint to export")
    try:
        cfg = from_dict(meta["config"])
    except ConfigError as err:
        raise ConfigError(f"{run}: its saved config no longer loads ({err})") from None
    ckpt = RunCheckpoint(run, step, cfg, meta)
    _check_finished(ckpt, unfinished_ok)
    return ckpt


def _check_finished(ckpt: RunCheckpoint, unfinished_ok: bool) -> None:
    """ConfigError (unless ``unfinished_ok``) when ``ckpt`` is before the run's last step."""
    cfg, meta = ckpt.cfg, ckpt.meta
    if "finished" in meta:  # an sft run
        finished, last = meta["finished"], f"sft.steps = {cfg.sft.steps}"
    else:
        finished, last = ckpt.step >= cfg.train.steps, f"train.steps = {cfg.train.steps}"
    if not finished and not unfinished_ok:
        raise ConfigError(
            f"{ckpt.run}: its newest checkpoint is step {ckpt.step}, before {last} (running, or "
            f"stopped); --unfinished exports it anyway"
        )


def _restore(ckpt: RunCheckpoint, targets: dict, unfinished_ok: bool) -> tuple[RunCheckpoint, dict]:
    """(checkpoint, the items ``targets`` names) of the newest verified checkpoint of
    ``ckpt.run`` that can be read: ``ckpt``, or when another process (the run's trainer
    rotating out old steps) deleted it while it was read, the newest that still verifies, said
    in one line (``CheckpointStore.restore_newest``)."""

    def check(meta: dict) -> None:
        _check_finished(dataclasses.replace(ckpt, step=meta["step"], meta=meta), unfinished_ok)

    store = CheckpointStore(ckpt.run / "checkpoints")
    try:
        restored = store.restore_newest(targets, check_meta=check)
    finally:
        store.close()
    if restored is None:
        raise ConfigError(
            f"{ckpt.run / 'checkpoints'}: no complete checkpoint left to read (deleted while they "
            f"were read)"
        )
    step, items, meta = restored
    return dataclasses.replace(ckpt, step=step, meta=meta), items


def _architecture(cfg: Config, tokenizer) -> DecoderConfig:
    """The run's model (without adapters), as ``policy.build_model`` builds it."""
    m = cfg.model
    if m.hf_checkpoint:
        return hf_architecture(m.hf_checkpoint, **run_settings(m))
    return preset_architecture(m, tokenizer)


def _abstract(arch: DecoderConfig, kind=nnx.Param):
    """The ``kind`` variables of a model of ``arch``, as shapes placed on one device."""
    model = nnx.eval_shape(lambda: Decoder(arch, rngs=nnx.Rngs(0)))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state = nnx.split(model, kind, ...)[1]
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)


def _flat(state) -> dict:
    return {path: v[...] for path, v in nnx.to_flat_state(state)}


def export_run(
    run: Path,
    out: Path,
    *,
    adapters_only: bool = False,
    unfinished_ok: bool = False,
    report=print,
) -> None:
    """Writes the newest checkpoint of ``run`` into ``out`` (see the module docstring);
    ConfigError (one line) for what cannot be exported."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory; choose a new one")
    ckpt = newest_checkpoint(run, unfinished_ok)
    cfg, m = ckpt.cfg, ckpt.cfg.model
    if adapters_only and not m.lora_rank:
        raise ConfigError(
            f"{run}: full fine-tuning (model.lora_rank = 0) has no adapters; leave out "
            f"--adapters-only"
        )
    tokenizer = build_tokenizer(cfg)  # a dataset run's tokenizer directory must still be there
    source = None if isinstance(tokenizer, CharTokenizer) else m.tokenizer or m.hf_checkpoint
    arch = _architecture(cfg, tokenizer)
    if not m.lora_rank:
        ckpt, items = _restore(ckpt, {"params": _abstract(arch)}, unfinished_ok)
        with _staged(out, report) as into:
            save_hf_params(_flat(items["params"]), arch, str(into))
            note = _tokenizer_note(_copy_tokenizer(source, into))
        report(f"export {run} step {ckpt.step} (full fine-tuning): {out} ({note})")
        return
    _export_lora(ckpt, arch, tokenizer, source, out, adapters_only, unfinished_ok, report)


@contextlib.contextmanager
def _staged(out: Path, report) -> Iterator[Path]:
    """The folder to write ``out`` into: its sibling ``out.export-tmp``, renamed to ``out``
    when the block ends, removed when it raises. A full disk or a folder that cannot be written
    becomes one ConfigError line."""
    staging = out.with_name(out.name + STAGING_SUFFIX)
    try:
        if staging.is_dir():
            shutil.rmtree(staging)
            report(f"export: removed {staging}, left by an export that did not finish")
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as err:
        raise _write_error(err, out) or ConfigError(
            f"{staging}: cannot be written ({err.strerror}); make {out.parent} writable or "
            f"choose another OUT"
        ) from None
    try:
        yield staging
        if out.is_dir():  # an empty directory waiting for it
            out.rmdir()
        os.rename(staging, out)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        line = _write_error(err, out) if isinstance(err, Exception) else None
        if line is not None:
            raise line from None
        raise


def _write_error(err: Exception, out: Path) -> ConfigError | None:
    """A write of the export to ``out`` that failed for lack of space as one line; None for
    any other error."""
    if (where := no_space_on(err, out.parent)) is None:
        return None
    return ConfigError(
        f"{where} while exporting to {out}: nothing was written there; free space, then run "
        f"the same command"
    )


def _export_lora(
    ckpt, arch, tokenizer, source, out: Path, adapters_only: bool, unfinished_ok: bool, report
) -> None:
    """A LoRA run: merged weights, the adapters in PEFT's layout, and the base when it is not
    a Hugging Face checkpoint already (see the module docstring)."""
    cfg, m = ckpt.cfg, ckpt.cfg.model
    hf_base = m.hf_checkpoint if m.hf_checkpoint and not cfg.train.init_checkpoint else None
    if adapters_only and hf_base is None:
        base = "train.init_checkpoint" if cfg.train.init_checkpoint else f"preset {m.preset}"
        raise ConfigError(
            f"{ckpt.run}: its base ({base}) is not a Hugging Face checkpoint for PEFT to load the "
            f"adapters over; leave out --adapters-only to write the base next to them"
        )
    ckpt, params, adapters, adapted = lora_run_weights(ckpt, tokenizer, unfinished_ok)
    written = []
    with _staged(out, report) as into:  # written into ``into``, named as ``out``
        if not adapters_only:
            save_merged(params, adapters, adapted, str(into))
            written.append(f"{out} (merged; {_tokenizer_note(_copy_tokenizer(source, into))})")
        if hf_base is None:  # PEFT loads adapters over a Hugging Face directory: write the base
            hf_base = out / "base"
            save_hf_params(_flat(params), arch, str(into / "base"))
            _copy_tokenizer(source, into / "base")
            written.append(f"{hf_base} (the base)")
        adapter_dir = out if adapters_only else out / "adapter"
        base_path = str(Path(hf_base).absolute())
        adapter_into = into if adapters_only else into / "adapter"
        save_peft_adapters(adapters, adapted, str(adapter_into), base_path, m.lora_dropout)
        written.append(f"{adapter_dir} (PEFT adapters over {hf_base})")
    lora = f"LoRA rank {m.lora_rank} on {', '.join(m.lora_targets)}"
    report(f"export {ckpt.run} step {ckpt.step} ({lora}): " + ", ".join(written))


def lora_run_weights(
    ckpt: RunCheckpoint, tokenizer, unfinished_ok: bool = True
) -> tuple[RunCheckpoint, nnx.State, nnx.State, DecoderConfig]:
    """(the checkpoint read, base weights, adapters, adapted architecture) of a LoRA run's
    newest checkpoint (``ckpt``, or the newest that still verifies if it is deleted while it is
    read): the base built as the trainer builds it and checked against the one the adapters
    were trained over."""
    cfg = ckpt.cfg
    params = nnx.state(build_model(cfg.model, tokenizer, seed=cfg.train.seed), nnx.Param)
    if cfg.train.init_checkpoint:
        params = load_run_params(cfg.train.init_checkpoint, params)
    adapted = adapted_architecture(cfg.model, _architecture(cfg, tokenizer))
    ckpt, items = _restore(ckpt, {"params": _abstract(adapted, LoRAParam)}, unfinished_ok)
    check_same_base(ckpt.meta.get("base"), base_identity(cfg), ckpt.step)
    return ckpt, params, items["params"], adapted


def merged_run_params(run: Path, tokenizer) -> nnx.State:
    """The weights of the plain model that computes what a LoRA run's newest checkpoint does
    (its adapters merged into its base), for ``sagc-jax eval``."""
    _, base, adapters, adapted = lora_run_weights(
        newest_checkpoint(run, unfinished_ok=True), tokenizer
    )
    return lora.merge_adapters(adapters, base, lora.scale(adapted))


def _copy_tokenizer(source: str | None, out: Path) -> list[str]:
    """Copies the tokenizer files of directory ``source`` into ``out``; their names."""
    if source is None:
        return []
    copied = [name for name in TOKENIZER_FILES if (Path(source) / name).is_file()]
    for name in copied:
        shutil.copyfile(Path(source) / name, out / name)
    return copied


def _tokenizer_note(files: list[str]) -> str:
    if files:
        return "tokenizer: " + ", ".join(files)
    return "no tokenizer: the synthetic task's characters are sagc-jax's own (tasks.CharTokenizer)"
