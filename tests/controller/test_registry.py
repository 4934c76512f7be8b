"""The controller registry: one entry per kind, the kinds the config and the spec grammar
allow, and the recipe of docs/architecture.md ("Add a controller") followed once: a toy
controller registered in one entry is built from its spec and its own metrics reach the run's
log, with no allowlist to extend."""

import dataclasses

import numpy as np
import pytest

from sagc_jax.config import ConfigError, ControllerConfig
from sagc_jax.controller import GroupController, StepObservation, make_controller
from sagc_jax.controller.registry import CONTROLLERS, ControllerEntry, parse_controller_spec
from sagc_jax.planning.choices import TABLES
from sagc_jax.train.metrics import controller_metrics


def test_the_config_reads_its_kinds_from_the_registry():
    (kind,) = [f for f in dataclasses.fields(ControllerConfig) if f.name == "kind"]
    assert kind.metadata["named"] and TABLES["controller.kind"] is CONTROLLERS


@pytest.mark.parametrize("kind", list(CONTROLLERS))
def test_every_kind_builds_from_its_spec_and_the_config(kind):
    cfg = ControllerConfig(kind=kind, group_size=8)
    spec = CONTROLLERS[kind].spec_of(kind, cfg)
    assert parse_controller_spec(spec)[0] == kind
    assert type(make_controller(spec)) is CONTROLLERS[kind].cls
    assert type(make_controller(cfg)) is CONTROLLERS[kind].cls
    seeded = CONTROLLERS[kind].seeded  # the section compare offsets per seed has a seed
    assert seeded is None or hasattr(getattr(cfg, seeded), "seed")


class HalvingController(GroupController):
    """A toy: the smallest rung, and a metric of its own."""

    logged_metrics = ("halves",)

    def __init__(self, config: ControllerConfig) -> None:
        super().__init__(config.candidates, config.tau, config.scope)

    def _decide(self) -> int:
        return self.candidates[0]

    def _learn(self, group_size, s_t, lengths_pg, finished_pg=None):
        return {"halves": group_size / 2, "unlogged": 1.0}


def test_a_new_controller_is_one_entry(monkeypatch):
    build = lambda config, _, __: HalvingController(config)  # noqa: E731
    entry = ControllerEntry(HalvingController, build, "the smallest rung")
    monkeypatch.setitem(CONTROLLERS, "halving", entry)
    assert parse_controller_spec("halving") == ("halving", None)
    controller = make_controller("halving", ControllerConfig(candidates=(2, 4)))
    g = controller.propose()
    ctrl = controller.observe(StepObservation.of_groups(np.array([[3, 5], [4, 4]])))
    record = controller_metrics(ctrl, controller)
    assert g == 2 and record == {"controller/halves": 1.0}  # its own key; no allowlist


def test_a_kind_not_registered_is_refused_with_the_forms_allowed():
    with pytest.raises(ConfigError, match=r"'halving' is not allowed; use 'sagc', .*'fixed:<G>'"):
        parse_controller_spec("halving")
