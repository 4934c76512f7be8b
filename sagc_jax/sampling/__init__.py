"""Generation: left-padded prompt buckets, one prefill per prompt, decode over slots whose rows
leave the batch when they finish (see ``sampler``, its loop in ``decode`` and its order of events
in ``sagc_jax.decode_schedule``, which the step-time model shares), sampling functions."""

from sagc_jax.sampling.functions import filter_top_k_top_p, sample_token
from sagc_jax.sampling.padding import DEFAULT_BUCKETS, bucket_length, left_pad
from sagc_jax.sampling.sampler import SampleOutput, Sampler

__all__ = [
    "DEFAULT_BUCKETS",
    "SampleOutput",
    "Sampler",
    "bucket_length",
    "filter_top_k_top_p",
    "left_pad",
    "sample_token",
]
