"""Generation: left-padded prompt buckets, one prefill per prompt, decode over slots whose rows
leave the batch when they finish (see ``sampler`` and ``schedule``), sampling functions.

The names below load their module on first use, so that the step-time model (``sim``, numpy
only) can import ``sagc_jax.sampling.schedule`` without importing jax.
"""

import importlib

_HOMES = {
    "filter_top_k_top_p": "functions",
    "sample_token": "functions",
    "DEFAULT_BUCKETS": "padding",
    "bucket_length": "padding",
    "left_pad": "padding",
    "SampleOutput": "sampler",
    "Sampler": "sampler",
    "sample": "sampler",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
