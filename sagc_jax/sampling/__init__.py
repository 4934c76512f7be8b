"""Generation: left-padded prompt buckets, prefill + while_loop decode, sampling functions."""

from sagc_jax.sampling.functions import filter_top_k_top_p, sample_token
from sagc_jax.sampling.padding import DEFAULT_BUCKETS, bucket_length, left_pad
from sagc_jax.sampling.sampler import SampleOutput, Sampler, sample

__all__ = [
    "DEFAULT_BUCKETS",
    "SampleOutput",
    "Sampler",
    "bucket_length",
    "filter_top_k_top_p",
    "left_pad",
    "sample",
    "sample_token",
]
