"""The static group-size baseline ("Vanilla" / OpenRLHF-style fixed G)."""

from __future__ import annotations

from typing import Any

from sagc_jax.controller.base import GroupController


class FixedGroupController(GroupController):
    """Always proposes ``group_size``; measures stragglers like SAGC for a fair comparison."""

    def __init__(self, group_size: int, tau: float = 3.0, scope: str = "group") -> None:
        if int(group_size) < 1:
            raise ValueError(f"group_size = {group_size} is not allowed; use an integer >= 1")
        super().__init__((int(group_size),), tau, scope)
        self.group_size = int(group_size)

    def _decide(self) -> int:
        return self.group_size

    def _learn(
        self, group_size: int, s_t: float, lengths_pg=None, finished_pg=None
    ) -> dict[str, Any]:
        return {}
