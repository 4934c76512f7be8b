"""What a run checks of its directory before it writes: does one checkpoint fit the disk (the
devices' memory is checked where the run is resolved, ``planning.resolve``). A refusal is one
line naming the sizes and what to change."""

from __future__ import annotations

from pathlib import Path

from sagc_jax.train.safety import disk
from sagc_jax.train.safety.runlock import RunDirError


def check_free_space(run_dir: str | Path, items) -> None:
    """RunDirError when the disk of ``run_dir`` has less room than a checkpoint of ``items``
    (the parameters and optimizer state, uncompressed: what a checkpoint holds once the
    optimizer's moments are no longer zeros)."""
    needed = disk.tree_bytes(items)
    free = disk.free_bytes(Path(run_dir))
    if free < needed:
        raise RunDirError(
            f"{run_dir}: {disk.human_bytes(free)} free on its disk, one checkpoint needs "
            f"about {disk.human_bytes(needed)} (parameters and optimizer state); free space "
            f"or use another logging.run_dir"
        )
