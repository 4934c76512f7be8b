"""Left-padding prompts into a few length buckets, so the sampler compiles a handful of shapes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_BUCKETS: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket >= length."""
    for bucket in sorted(buckets):
        if bucket >= length:
            return bucket
    raise ValueError(f"prompt of {length} tokens is longer than the largest bucket {max(buckets)}")


def left_pad(
    prompts: Sequence[Sequence[int]],
    pad_id: int,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    min_length: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads token lists to the bucket of the longest one (or of ``min_length`` if longer:
    batches that must share a width, such as the processes' parts of one global batch).

    Returns (prompt_ids_bt int32 [B, P], prompt_lens_b int32 [B]) with P a bucket; row b holds
    its prompt in the last prompt_lens_b[b] columns.
    """
    if not prompts:
        raise ValueError("left_pad needs at least one prompt")
    lens_b = np.array([len(p) for p in prompts], np.int32)
    if lens_b.min() < 1:
        raise ValueError(f"empty prompt at row {int(lens_b.argmin())}; every prompt needs a token")
    width = bucket_length(max(int(lens_b.max()), min_length), buckets)
    ids_bt = np.full((len(prompts), width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        ids_bt[row, width - len(prompt) :] = prompt
    return ids_bt, lens_b
