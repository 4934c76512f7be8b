"""Every extension point's table by the config key that names its kinds, and the check of a
config's names against them: ``config/`` declares those keys (``option(..., named=True)``) but
cannot import the tables, which live with their kinds in the layers above it (why:
``sagc_jax.config.choices``). Read by every command's config (``commands.common.load_config``),
by ``resolve_run`` and by docs/config.md (``sagc-jax config --reference``)."""

from __future__ import annotations

from sagc_jax import config
from sagc_jax.controller.registry import CONTROLLERS, SPECS
from sagc_jax.rl.losses import ALGORITHMS
from sagc_jax.tasks.rewards import REWARDS
from sagc_jax.tasks.source import SOURCES

TABLES = {table.key: table for table in (CONTROLLERS, SPECS, SOURCES, REWARDS, ALGORITHMS)}


def check_names(cfg: config.Config) -> None:
    """A ConfigError (one line: the key, the value, the names allowed) for the first key of
    ``cfg`` whose name no table has."""
    config.check_names(cfg, TABLES)


def reference_markdown() -> str:
    """docs/config.md, its kinds and their help read from ``TABLES``."""
    return config.reference_markdown(TABLES)
