"""Generation: left-padded prompt buckets, one prefill per prompt, decode over slots whose rows
leave the batch when they finish (see ``sampler``, its loop in ``decode`` and its order of events
in ``schedule``), sampling functions.

The names below load their module on first use, so that the step-time model (``sim``, numpy
only) can import ``sagc_jax.sampling.schedule`` without importing jax.
"""

from sagc_jax.lazy import lazy_names

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


__getattr__, __dir__ = lazy_names(__name__, _HOMES, globals())
