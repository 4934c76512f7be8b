"""The frozen base of a LoRA run: what identifies it, and the check that a resumed run trains
over the same weights.

A LoRA run's checkpoints hold the adapters, the optimizer and the controller, not the base
weights, which are rebuilt at every start from where they came from. The checkpoint's meta
records that source (``base_identity``) and a resume compares it (``check_same_base``):

- ``model.hf_checkpoint``: the directory and the sha256 of each of its ``*.safetensors`` files;
- ``train.init_checkpoint`` (e.g. the SFT warm start): the run directory, the step its weights
  were read from and the sha256 of that step's integrity record (which holds every file's);
- a random preset: the preset and ``train.seed``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from sagc_jax.config import Config, ConfigError
from sagc_jax.train.safety.checkpoint import INTEGRITY_FILE, CheckpointStore


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def base_identity(cfg: Config) -> dict:
    """What identifies the weights under the adapters (see the module docstring)."""
    m, t = cfg.model, cfg.train
    if t.init_checkpoint:
        directory = Path(t.init_checkpoint) / "checkpoints"
        store = CheckpointStore(directory)
        try:
            step = store.newest_verified_step()
        finally:
            store.close()
        record = directory / str(step) / INTEGRITY_FILE if step is not None else None
        digest = _sha256(record) if record is not None and record.is_file() else None
        return {"init_checkpoint": t.init_checkpoint, "step": step, "sha256": digest}
    if m.hf_checkpoint:
        files = sorted(Path(m.hf_checkpoint).glob("*.safetensors"))
        return {"hf_checkpoint": m.hf_checkpoint, "sha256": {p.name: _sha256(p) for p in files}}
    return {"preset": m.preset, "seed": t.seed}


def check_same_base(saved: dict | None, now: dict, step: int) -> None:
    """Raise ConfigError (one line naming the file) when the base under the checkpoint of
    ``step``, recorded as ``saved``, is not ``now``'s."""
    if saved is None or saved == now:
        return
    where = "restore it or start a new logging.run_dir"
    if "hf_checkpoint" in now and "hf_checkpoint" in saved:
        old, new = saved["sha256"], now["sha256"]
        name = next(n for n in sorted(set(old) | set(new)) if old.get(n) != new.get(n))
        raise ConfigError(
            f"{Path(now['hf_checkpoint']) / name}: changed since the checkpoint of step {step} "
            f"(sha256 {str(old.get(name))[:12]} -> {str(new.get(name))[:12]}); the run's LoRA "
            f"adapters were trained over the old weights: {where}"
        )
    if "init_checkpoint" in now and "init_checkpoint" in saved:
        raise ConfigError(
            f"{now['init_checkpoint']}: its weights changed since the checkpoint of step {step} "
            f"(train.init_checkpoint: step {saved['step']}, {INTEGRITY_FILE} sha256 "
            f"{str(saved['sha256'])[:12]} -> step {now['step']}, {str(now['sha256'])[:12]}); "
            f"the run's LoRA adapters were trained over the old weights: {where}"
        )
    raise ConfigError(
        f"the base model changed since the checkpoint of step {step} ({saved} -> {now}); the "
        f"run's LoRA adapters were trained over the old one: {where}"
    )
