"""Tasks and rewards: the synthetic running-sum task, prompt datasets, math answer checking and
the reward registry. Pure Python and numpy: never imports jax (math-verify and pyarrow load
lazily, only when a symbolic comparison or a Parquet file needs them)."""

from sagc_jax.tasks.chars import DEFAULT_ALPHABET, CharTokenizer, encode_sft_batch
from sagc_jax.tasks.datasets import REQUIRED_FIELDS, DatasetError, Example, load_dataset
from sagc_jax.tasks.math_checker import (
    extract_answer,
    math_equal,
    normalize_answer,
    parse_number,
    score_math,
)
from sagc_jax.tasks.rewards import (
    REWARDS,
    MathReward,
    RewardError,
    RewardFn,
    RewardResult,
    Scores,
    TimeLimitedReward,
    math_reward,
    resolve_reward,
    score_batch,
    synthetic_reward,
)
from sagc_jax.tasks.synthetic import SPLITS, Problem, SyntheticTask, check_running_sum

__all__ = [
    "REWARDS",
    "DEFAULT_ALPHABET",
    "REQUIRED_FIELDS",
    "SPLITS",
    "CharTokenizer",
    "DatasetError",
    "Example",
    "MathReward",
    "Problem",
    "RewardError",
    "RewardFn",
    "RewardResult",
    "Scores",
    "TimeLimitedReward",
    "SyntheticTask",
    "check_running_sum",
    "encode_sft_batch",
    "extract_answer",
    "load_dataset",
    "math_equal",
    "math_reward",
    "normalize_answer",
    "parse_number",
    "resolve_reward",
    "score_batch",
    "score_math",
    "synthetic_reward",
]
