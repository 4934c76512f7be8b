"""Hugging Face checkpoints in and out: `load_hf_checkpoint` and `save_hf_checkpoint`.

The mapping between transformers tensor names and this package's parameters is the declarative
table `RULES`: each row names the HF tensor, the parameter path here and the layout change between
them (one of `TRANSFORMS`). transformers stores a linear layer as weight[out, in]; here a
projection is [in, out] with heads split out (q_dnh, o_nhd, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import safetensors
import safetensors.flax
from flax import nnx

from sagc_jax.config import ConfigError
from sagc_jax.models.architecture import DecoderConfig
from sagc_jax.models.decoder import Decoder
from sagc_jax.models.files import read_json


class CheckpointMismatchError(ValueError):
    """A checkpoint tensor is missing, unexpected or of the wrong shape (one line per tensor)."""


@dataclasses.dataclass(frozen=True)
class Transform:
    """Layout change between an HF tensor and a parameter here (shapes: HF vs ours)."""

    hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # our shape -> HF shape
    to_ours: Callable  # (hf array, our shape) -> our array
    to_hf: Callable  # our array -> hf array


TRANSFORMS: dict[str, Transform] = {
    "copy": Transform(lambda s: s, lambda x, s: x, lambda x: x),
    # weight[out, in] <-> [in, out]
    "transpose": Transform(lambda s: s[::-1], lambda x, s: x.T, lambda x: x.T),
    # weight[N*H, D] <-> [D, N, H]
    "split_out_heads": Transform(
        lambda s: (s[1] * s[2], s[0]),
        lambda x, s: x.T.reshape(s),
        lambda x: x.reshape(x.shape[0], -1).T,
    ),
    # weight[D, N*H] <-> [N, H, D]
    "split_in_heads": Transform(
        lambda s: (s[2], s[0] * s[1]),
        lambda x, s: x.T.reshape(s),
        lambda x: x.reshape(-1, x.shape[-1]).T,
    ),
    # bias[N*H] <-> [N, H]
    "split_bias_heads": Transform(
        lambda s: (s[0] * s[1],), lambda x, s: x.reshape(s), lambda x: x.reshape(-1)
    ),
}


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: str  # HF tensor name; "{i}" is the layer index
    path: str  # parameter path here, dot-separated; "{i}" is the layer index
    transform: str  # a key of TRANSFORMS
    when: str = "always"  # "always", "qkv_bias" or "untied"


_ATTN, _MLP = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
RULES: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", "embed_vd", "copy"),
    Rule("model.norm.weight", "final_norm.scale_d", "copy"),
    Rule("lm_head.weight", "lm_head_dv", "transpose", when="untied"),
    Rule("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.scale_d", "copy"),
    Rule("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.scale_d", "copy"),
    Rule(f"{_ATTN}.q_proj.weight", "layers.{i}.attn.q_dnh", "split_out_heads"),
    Rule(f"{_ATTN}.k_proj.weight", "layers.{i}.attn.k_dkh", "split_out_heads"),
    Rule(f"{_ATTN}.v_proj.weight", "layers.{i}.attn.v_dkh", "split_out_heads"),
    Rule(f"{_ATTN}.o_proj.weight", "layers.{i}.attn.o_nhd", "split_in_heads"),
    Rule(f"{_ATTN}.q_proj.bias", "layers.{i}.attn.q_bias_nh", "split_bias_heads", "qkv_bias"),
    Rule(f"{_ATTN}.k_proj.bias", "layers.{i}.attn.k_bias_kh", "split_bias_heads", "qkv_bias"),
    Rule(f"{_ATTN}.v_proj.bias", "layers.{i}.attn.v_bias_kh", "split_bias_heads", "qkv_bias"),
    Rule(f"{_MLP}.gate_proj.weight", "layers.{i}.mlp.gate_df", "transpose"),
    Rule(f"{_MLP}.up_proj.weight", "layers.{i}.mlp.up_df", "transpose"),
    Rule(f"{_MLP}.down_proj.weight", "layers.{i}.mlp.down_fd", "transpose"),
)
# Checkpoint tensors that carry no parameter: old rotary buffers; lm_head of a tied model.
_IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)


def _path(template: str, i: int | None) -> tuple:
    parts = template.format(i=i).split(".")
    return tuple(int(p) if p.isdigit() else p for p in parts)


def expand_rules(cfg: DecoderConfig) -> list[tuple[str, tuple, Transform]]:
    """(HF name, parameter path, transform) for every parameter of a model with config `cfg`."""
    active = {"always": True, "qkv_bias": cfg.qkv_bias, "untied": not cfg.tie_embeddings}
    out = []
    for rule in RULES:
        if not active[rule.when]:
            continue
        layers = range(cfg.num_layers) if "{i}" in rule.hf else [None]
        for i in layers:
            out.append((rule.hf.format(i=i), _path(rule.path, i), TRANSFORMS[rule.transform]))
    return out


def _abstract_model(cfg: DecoderConfig):
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def _check_table_covers(cfg: DecoderConfig, flat_paths: set[tuple]) -> None:
    mapped = {path for _, path, _ in expand_rules(cfg)}
    if mapped != flat_paths:
        raise AssertionError(
            f"RULES out of date: parameters without a rule {sorted(flat_paths - mapped)}, "
            f"rules without a parameter {sorted(mapped - flat_paths)}"
        )


# config.json keys the architecture needs: positive integers (required, then optional ones).
_HF_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
_HF_SIZES += ("num_attention_heads",)
_HF_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_HF_OPTIONAL_NUMBERS = ("rope_theta", "rms_norm_eps")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _config_file(path: str) -> str:
    """``path``/config.json, or ``path`` itself when it is a .json file."""
    path = str(path)
    if path.endswith(".json") and os.path.isfile(path):
        return path
    return os.path.join(path, "config.json")


def read_hf_config(path: str) -> dict:
    """The ``config.json`` of the Hugging Face checkpoint directory ``path`` (or that file),
    checked.

    Raises ConfigError (one line naming the file) when it cannot be read, is not a complete JSON
    object, lacks a size the architecture needs, or holds a value of the wrong kind.
    """
    file = _config_file(path)
    hf = read_json(file, "model config")
    for key in _HF_SIZES:
        if key not in hf:
            raise ConfigError(f'{file}: no "{key}"; a Llama or Qwen2 config.json has it')
    for key in _HF_SIZES + _HF_OPTIONAL_SIZES:
        value = hf.get(key)
        if (key in _HF_SIZES or value is not None) and not (_is_int(value) and value > 0):
            raise ConfigError(f'{file}: "{key}": {value!r}; allowed: a positive integer')
    for key in _HF_OPTIONAL_NUMBERS:
        value = hf.get(key)
        if value is not None and not (isinstance(value, int | float) and value > 0):
            raise ConfigError(f'{file}: "{key}": {value!r}; allowed: a positive number')
    eos = hf.get("eos_token_id")
    if not (eos is None or _is_int(eos) or (isinstance(eos, list) and all(map(_is_int, eos)))):
        raise ConfigError(f'{file}: "eos_token_id": {eos!r}; allowed: an integer, a list or null')
    if not (hf.get("bos_token_id") is None or _is_int(hf["bos_token_id"])):
        raise ConfigError(
            f'{file}: "bos_token_id": {hf["bos_token_id"]!r}; allowed: an integer or null'
        )
    return hf


def hf_architecture(path: str, **overrides) -> DecoderConfig:
    """The `DecoderConfig` of checkpoint directory ``path`` or its config.json (``overrides``:
    dtypes, remat, ...);
    ConfigError naming its config.json for anything unreadable or unsupported."""
    hf = read_hf_config(path)
    try:
        return DecoderConfig.from_hf_config(hf, **overrides)
    except (KeyError, TypeError, ValueError) as err:
        why = str(err).removeprefix("config.json ")
        if isinstance(err, KeyError):
            why = f"no {err}"
        raise ConfigError(f"{_config_file(path)}: {why}") from None


def _open_safetensors(file: str):
    try:
        return safetensors.safe_open(file, framework="flax")
    except Exception as err:  # SafetensorError for a damaged header, OSError
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"{file}: not a readable safetensors file ({reason}); truncated or damaged?"
        ) from None


def _safetensors_files(path: str) -> dict[str, str]:
    """HF tensor name -> file, from model.safetensors.index.json or the single .safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ConfigError(
                f'{index}: "weight_map" must be an object of tensor name -> .safetensors file'
            )
        for file in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(path, file)):
                raise ConfigError(f"{index}: names {file}, which is not in {path}")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if len(files) != 1:
        raise ConfigError(
            f"{path}: expected model.safetensors.index.json or exactly one .safetensors file, "
            f"found {files}"
        )
    file = os.path.join(path, files[0])
    with _open_safetensors(file) as f:
        return {name: file for name in f.keys()}


def _shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x)


def load_hf_checkpoint(
    path: str,
    dtype: str = "float32",
    compute_dtype: str | None = None,
    remat: str = "none",
    attention: str = "auto",
    scan_layers: bool = False,
) -> tuple[Decoder, DecoderConfig]:
    """Reads a local transformers directory (config.json + safetensors) into a `Decoder`.

    dtype: parameter dtype ("float32" or "bfloat16"); compute_dtype defaults to dtype.
    Raises ConfigError naming the file for an unreadable, truncated or mis-typed config.json,
    index or safetensors file, and CheckpointMismatchError (a ValueError) listing every
    missing, unexpected or mis-shaped tensor, one line each with the tensor name and both shapes.
    """
    cfg = hf_architecture(
        path,
        param_dtype=dtype,
        compute_dtype=compute_dtype or dtype,
        remat=remat,
        attention=attention,
        scan_layers=scan_layers,
    )
    graphdef, abstract_state = _abstract_model(cfg)
    return nnx.merge(graphdef, read_hf_params(path, cfg, abstract_state)), cfg


def read_hf_params(path: str, cfg: DecoderConfig, abstract_state: nnx.State) -> nnx.State:
    """The tensors of checkpoint directory ``path`` as the params of a model of ``cfg`` (its
    architecture, read from the same directory): ``abstract_state`` (the model's params as
    shapes, e.g. ``nnx.split(nnx.eval_shape(...))``) with every value read, in
    ``cfg.param_dtype``, on the default device.

    Raises ConfigError naming the file for an unreadable or truncated index or safetensors
    file, and CheckpointMismatchError listing every missing, unexpected or mis-shaped tensor."""
    flat = dict(nnx.to_flat_state(abstract_state))
    _check_table_covers(cfg, set(flat))
    files = _safetensors_files(path)
    expected = {}
    for hf_name, param_path, transform in expand_rules(cfg):
        expected[hf_name] = (param_path, transform, _shape(flat[param_path].shape))

    problems, handles, values = [], {}, {}

    def read(name):
        file = files[name]
        if file not in handles:
            handles[file] = _open_safetensors(file)
        return handles[file]

    def shape(name):
        try:
            return _shape(read(name).get_slice(name).get_shape())
        except Exception as err:  # SafetensorError: a name the index lists that is not there
            raise ConfigError(f"{files[name]}: cannot read tensor {name!r} ({err})") from None

    for hf_name, (param_path, transform, our_shape) in expected.items():
        want = _shape(transform.hf_shape(our_shape))
        if hf_name not in files:
            problems.append(f"missing tensor {hf_name!r}: checkpoint shape None, expected {want}")
            continue
        got = shape(hf_name)
        if got != want:
            problems.append(f"tensor {hf_name!r}: checkpoint shape {got}, expected {want}")
            continue
        x = transform.to_ours(read(hf_name).get_tensor(hf_name), our_shape)
        values[param_path] = jnp.asarray(x, cfg.param_jnp_dtype)
    for name in sorted(set(files) - set(expected)):
        tied_head = cfg.tie_embeddings and name == "lm_head.weight"
        if tied_head or any(p.match(name) for p in _IGNORED):
            continue
        got = shape(name)
        problems.append(f"unexpected tensor {name!r}: checkpoint shape {got}, expected None")
    if problems:
        raise CheckpointMismatchError(
            f"{path} does not match a {cfg.family} model with {cfg.num_layers} layers "
            f"({len(problems)} problems):\n" + "\n".join(problems)
        )
    return nnx.map_state(lambda p, var: var.replace(value=values[p]), abstract_state)


def write_safetensors(
    tensors: dict[str, jax.Array],
    path: str,
    stem: str = "model",
    max_shard_bytes: int | None = None,
) -> None:
    """Writes ``tensors`` into ``path``/``stem``.safetensors, or past ``max_shard_bytes`` into
    shards ``stem``-00001-of-0000n.safetensors listed by ``stem``.safetensors.index.json."""
    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, jax.Array]] = [{}]
    size = 0
    for name, x in tensors.items():
        if max_shard_bytes and shards[-1] and size + x.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    metadata = {"format": "pt"}  # transformers refuses safetensors without it
    if len(shards) == 1:
        safetensors.flax.save_file(tensors, os.path.join(path, f"{stem}.safetensors"), metadata)
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"{stem}-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.flax.save_file(shard, os.path.join(path, file), metadata)
        weight_map.update({name: file for name in shard})
    index = {
        "metadata": {"total_size": int(sum(x.nbytes for x in tensors.values()))},
        "weight_map": weight_map,
    }
    with open(os.path.join(path, f"{stem}.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def save_hf_params(
    flat: dict[tuple, jax.Array],
    config: DecoderConfig,
    path: str,
    max_shard_bytes: int | None = None,
) -> None:
    """Writes config.json and safetensors from parameter path -> array: every parameter of a
    model with config ``config``, no other (adapters merged first: ``hf_lora.merge_lora``)."""
    _check_table_covers(config, set(flat))
    tensors = {
        hf_name: jnp.asarray(transform.to_hf(flat[param_path]))
        for hf_name, param_path, transform in expand_rules(config)
    }
    write_safetensors(tensors, path, max_shard_bytes=max_shard_bytes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf_config(), f, indent=2)


def save_hf_checkpoint(
    model: Decoder, config: DecoderConfig, path: str, max_shard_bytes: int | None = None
) -> None:
    """Writes config.json and safetensors (sharded with an index past `max_shard_bytes`)."""
    flat = {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    save_hf_params(flat, config, path, max_shard_bytes)


def hf_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensor names and shapes of a model with config `cfg` (no allocation)."""
    _, abstract_state = _abstract_model(cfg)
    flat = dict(nnx.to_flat_state(abstract_state))
    return {name: _shape(t.hf_shape(_shape(flat[p].shape))) for name, p, t in expand_rules(cfg)}


__all__ = [
    "RULES",
    "TRANSFORMS",
    "CheckpointMismatchError",
    "hf_architecture",
    "hf_shapes",
    "load_hf_checkpoint",
    "read_hf_params",
    "read_hf_config",
    "save_hf_checkpoint",
    "save_hf_params",
    "write_safetensors",
]
