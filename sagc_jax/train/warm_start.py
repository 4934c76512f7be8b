"""The parameters of an earlier run (the SFT warm start, ``train.init_checkpoint``), read from its
newest verified checkpoint."""

from __future__ import annotations

from pathlib import Path

import jax

from sagc_jax.config import ConfigError
from sagc_jax.train.safety.checkpoint import CheckpointStore


def load_run_params(run_dir: str | Path, params, unfinished_ok: bool = False):
    """The parameters of the newest verified checkpoint of another run (shaped like
    ``params``; damaged checkpoints are reported and moved aside, see ``CheckpointStore``).
    An SFT run stopped before its last step is refused unless ``unfinished_ok``."""

    def check_finished(meta: dict) -> None:
        if meta.get("finished") is False and not unfinished_ok:  # only SFT writes the flag
            raise ConfigError(
                f"{run_dir}: its sft stopped at step {meta['step']} of "
                f"{meta['config']['sft']['steps']}; rerun the same sagc-jax sft command to "
                f"finish it before starting from it (train.init_checkpoint)"
            )
        rank = meta["config"].get("model", {}).get("lora_rank", 0)
        if rank:
            raise ConfigError(
                f"{run_dir}: a LoRA run (model.lora_rank = {rank}), whose checkpoints hold "
                f"adapters, not the model; start from its merged export (model.hf_checkpoint) "
                f"or from the run it was trained over (train.init_checkpoint)"
            )

    ckpt_dir = Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        raise ConfigError(f"{run_dir}: no checkpoints/ directory (train.init_checkpoint)")
    store = CheckpointStore(ckpt_dir)
    # Restored straight into the shardings of ``params`` (one piece per device).
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        params,
    )
    try:
        restored = store.restore_newest({"params": target}, check_meta=check_finished)
    finally:
        store.close()
    if restored is None:
        raise ConfigError(f"{ckpt_dir}: no complete checkpoint (train.init_checkpoint)")
    return restored[1]["params"]
