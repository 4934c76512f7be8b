"""Run configuration: frozen dataclasses, one per section, loaded from YAML with overrides.

A config file is a YAML mapping of sections (``model``, ``sampling``, ``loss``, ``controller``,
``train``, ``data``, ``mesh``, ``logging``, ``sim``); every key is optional and falls back to
its default.
``--set section.key=value`` overrides are applied on top, their values parsed as YAML scalars
(``--set controller.candidates=[2,4,8]`` works). A key that moved (:data:`MOVED_KEYS`) fails
naming its new key.

Every field declares what it accepts through :func:`option` (``ge``/``gt``/``le``/``lt`` bounds,
``choices``); cross-field rules live in ``__post_init__``. Anything wrong raises
:class:`ConfigError` whose message is one line naming the file (and line), the key, the bad value
and what is allowed. The package is numpy-free and jax-free so that the host-side controller and
simulator can import it cheaply. One module per job:

- :mod:`~sagc_jax.config.base`: :func:`option`, :class:`Section`, :class:`ConfigError`;
- :mod:`~sagc_jax.config.sections`: the sections and :class:`Config` (:mod:`~sagc_jax.config.sim`:
  the ``sim`` section);
- :mod:`~sagc_jax.config.choices`: the table of an extension point (``Registry``) and the check of
  the keys that name a kind against the tables, which live with the kinds (``check_names``);
- :mod:`~sagc_jax.config.load`: YAML, ``--set`` overrides, :func:`to_dict` / :func:`from_dict`;
- :mod:`~sagc_jax.config.saved`: a saved config against a resumed or warm-started run's;
- :mod:`~sagc_jax.config.reference`: docs/config.md.
"""

from __future__ import annotations

from sagc_jax.config.base import ConfigError, option
from sagc_jax.config.choices import Registry, check_names
from sagc_jax.config.load import MOVED_KEYS, from_dict, load_config, to_dict
from sagc_jax.config.reference import reference_markdown
from sagc_jax.config.saved import changed_keys, config_differences, config_over_saved
from sagc_jax.config.sections import (
    HYBRID_MODES,
    LORA_TARGETS,
    Config,
    ControllerConfig,
    DataConfig,
    HybridConfig,
    LoggingConfig,
    LossConfig,
    MeshConfig,
    ModelConfig,
    SAGCConfig,
    SAGCPlusConfig,
    SAGCValueConfig,
    SamplingConfig,
    SFTConfig,
    TailBatchingConfig,
    TrainConfig,
)
from sagc_jax.config.sim import HARDWARE_NAMES, SimConfig

__all__ = [
    "HARDWARE_NAMES",
    "HYBRID_MODES",
    "LORA_TARGETS",
    "MOVED_KEYS",
    "SimConfig",
    "TailBatchingConfig",
    "Config",
    "ConfigError",
    "changed_keys",
    "config_differences",
    "config_over_saved",
    "ControllerConfig",
    "DataConfig",
    "HybridConfig",
    "LoggingConfig",
    "LossConfig",
    "MeshConfig",
    "ModelConfig",
    "SAGCConfig",
    "SAGCPlusConfig",
    "SAGCValueConfig",
    "SFTConfig",
    "SamplingConfig",
    "TrainConfig",
    "from_dict",
    "load_config",
    "option",
    "Registry",
    "check_names",
    "reference_markdown",
    "to_dict",
]
