"""Build the policy (model, tokenizer) a run trains, from a preset or a Hugging Face checkpoint
(its LoRA adapters and the adapted model: ``programs.state``; the parameters of an earlier run,
the SFT warm start: ``train.warm_start``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from sagc_jax.config import Config, ConfigError, ModelConfig
from sagc_jax.models import Decoder, DecoderConfig, Tokenizer, get_preset, load_hf_checkpoint
from sagc_jax.models.hf_checkpoint import hf_architecture, read_hf_params
from sagc_jax.tasks import CharTokenizer
from sagc_jax.tasks.source import SOURCES


class Policy(NamedTuple):
    """The model a run starts from, placed by the run's ``ShardingPlan``: ``graphdef``,
    ``params`` (arrays, or ShapeDtypeStructs with shardings), its architecture and the params'
    shardings."""

    graphdef: nnx.GraphDef
    params: Any
    arch: DecoderConfig
    shardings: Any


def source_tokenizer(cfg: Config):
    """The tokenizer the prompt source is handed: None for a source with its own (the
    synthetic task's characters, ``SourceEntry.tokenizer``), else the model's."""
    return None if SOURCES[cfg.data.task].tokenizer else build_tokenizer(cfg)


def build_tokenizer(cfg: Config):
    """The run's tokenizer: its source's own, or the model's (``model.tokenizer`` or
    ``model.hf_checkpoint``)."""
    own = SOURCES[cfg.data.task].tokenizer
    if own is not None:
        if cfg.model.hf_checkpoint:
            raise ConfigError(
                f"data.task = {cfg.data.task!r} uses its own character tokenizer with a preset "
                "model; unset model.hf_checkpoint or use data.task = 'dataset'"
            )
        return own()
    path = cfg.model.tokenizer or cfg.model.hf_checkpoint
    if not path:
        raise ConfigError(
            "data.task = 'dataset' needs a tokenizer: set model.hf_checkpoint or model.tokenizer"
        )
    if not (Path(path) / "tokenizer.json").is_file():
        raise ConfigError(f"{path}: no tokenizer.json there (model.tokenizer / hf_checkpoint)")
    return Tokenizer.from_dir(path)


def build_model(m: ModelConfig, tokenizer, seed: int) -> Decoder:
    """A fresh model of the ``model`` section: HF weights when model.hf_checkpoint is set, else
    a random preset."""
    if not m.hf_checkpoint:
        return Decoder(preset_architecture(m, tokenizer), rngs=nnx.Rngs(seed))
    return _checkpoint_model(m)


def _checkpoint_model(m: ModelConfig) -> Decoder:
    """The model of ``model.hf_checkpoint``, read with the section's run settings."""
    settings = run_settings(m)
    dtype = settings.pop("param_dtype")
    model, _ = load_hf_checkpoint(m.hf_checkpoint, dtype=dtype, **settings)
    return model


def build_sharded_policy(abstract: Policy, hf_checkpoint: str | None, seed: int) -> Policy:
    """The model of ``abstract`` (the run's, as ``resolve_run`` traced it once: ``RunShape.policy``)
    with its params made and placed by ``abstract.shardings``.

    A random preset (no ``hf_checkpoint``) is initialised inside one program whose outputs are
    already split, so no device ever holds the whole model; HF weights are read (onto the first
    device), copied to the host once, and each device takes its piece from there.
    """
    arch, shardings = abstract.arch, abstract.shardings
    if not hf_checkpoint:

        def init():
            return nnx.split(Decoder(arch, rngs=nnx.Rngs(seed)))[1]

        return abstract._replace(params=jax.jit(init, out_shardings=shardings)())
    if not (Path(hf_checkpoint) / "config.json").is_file():
        raise ConfigError(
            f"model.hf_checkpoint = {hf_checkpoint}: no config.json there; a Hugging Face "
            "checkpoint directory holds config.json and its .safetensors"
        )
    params = read_hf_params(hf_checkpoint, arch, abstract.params)

    def place(x, sharding):  # every device takes its own piece of one host copy
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return abstract._replace(params=jax.tree.map(place, params, shardings))


def run_settings(m: ModelConfig) -> dict:
    """The `DecoderConfig` fields a run's ``model`` section sets over the architecture of its
    checkpoint or preset: dtypes, remat, scanned layers, attention."""
    return dict(
        param_dtype=m.param_dtype,
        compute_dtype=m.compute_dtype,
        remat=m.remat,
        scan_layers=m.scan_layers,
        attention=m.attention,
    )


def preset_architecture(m: ModelConfig, tokenizer=None) -> DecoderConfig:
    """The architecture of ``model.preset`` with the configured dtypes and remat policy, and the
    tokenizer's special tokens (none given: the preset's, enough for shapes)."""
    try:
        arch: DecoderConfig = get_preset(m.preset)
    except (KeyError, ValueError) as err:
        raise ConfigError(f"model.preset = {m.preset!r}: {err}") from None
    arch = arch.replace(**run_settings(m))
    if tokenizer is not None:
        eos = (tokenizer.eos_id,) if tokenizer.eos_id is not None else arch.eos_ids
        arch = arch.replace(bos_id=tokenizer.bos_id, eos_ids=eos)
    if isinstance(tokenizer, CharTokenizer):  # a small vocab keeps the CPU demo fast
        arch = arch.replace(vocab_size=tokenizer.vocab_size)
    return arch


def architecture(cfg: Config, tokenizer=None) -> tuple[DecoderConfig, str]:
    """The model's architecture and where it came from: the HF checkpoint's config.json if
    present, else the preset with ``tokenizer``'s special tokens (the run's; None: its source's
    own tokenizer if it has one, whose vocabulary then sizes the preset, else the preset's)."""
    m = cfg.model
    if not (m.hf_checkpoint and (Path(m.hf_checkpoint) / "config.json").is_file()):
        source = f"preset {m.preset}"
        if m.hf_checkpoint:
            source += f" ({m.hf_checkpoint} not found)"
        own = SOURCES[cfg.data.task].tokenizer
        if tokenizer is None and own is not None:
            tokenizer = own()
        return preset_architecture(m, tokenizer), source
    settings = run_settings(m)
    arch = hf_architecture(m.hf_checkpoint, **settings)  # a bad config.json: one line naming it
    return arch, f"{m.hf_checkpoint}/config.json"
