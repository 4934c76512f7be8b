"""What one training step tells a controller: :class:`StepObservation` (numpy only).

Every controller's ``observe`` takes one. It holds the step's rollouts group by group, flat:
``lengths_b`` int64 ``[B]`` (``B = sum sizes_p``), each group's size ``sizes_p`` int64 ``[P]``,
and what else the step knows of them: ``finished_b`` (tail batching: False where the step
stopped the rollout first, its length a lower bound), the raw ``rewards_b`` and the groups'
``prompt_ids_p``. A controller that plays one G per step reads the ``[P, G]`` views
(:meth:`StepObservation.lengths_pg`, ``finished_pg``, ``rewards_pg``); the hybrid reads the
flat arrays and the sizes.

Build one with :meth:`StepObservation.of_groups` (``[P, G]`` arrays: one G for the step) or
:meth:`StepObservation.of_rollouts` (groups of any sizes, in any layout of
:func:`~sagc_jax.controller.observation.check_ragged_lengths`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sagc_jax.controller.observation import check_finished, check_lengths, check_ragged_lengths


@dataclasses.dataclass(frozen=True, eq=False)
class StepObservation:
    """One step's rollouts, group by group (see the module docstring).

    ``lengths_b``: int64 ``[B]`` tokens generated (EOS included); ``sizes_p``: int64 ``[P]``,
    the rows of group p consecutive; ``finished_b``: bool ``[B]`` or None (not cut; given and
    all True: a cut step whose groups all finished, reported with zero censored counts);
    ``rewards_b``: float64 ``[B]`` before shaping, or None; ``prompt_ids_p``: int64 ``[P]``
    stable ids of the groups' prompts, or None. ``group_size`` (set from ``sizes_p``): the
    step's G when every group has it, None for mixed sizes. Constructing one checks every
    field and raises ValueError naming the problem. The arrays are read-only views: one
    observation is read by the controller and the metrics line alike.
    """

    lengths_b: np.ndarray
    sizes_p: np.ndarray
    finished_b: np.ndarray | None = None
    rewards_b: np.ndarray | None = None
    prompt_ids_p: np.ndarray | None = None
    group_size: int | None = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        lengths_b, sizes_p = _checked_rollouts(self.lengths_b, self.sizes_p)
        object.__setattr__(self, "lengths_b", lengths_b)
        object.__setattr__(self, "sizes_p", sizes_p)
        g = int(sizes_p[0])
        uniform = int(sizes_p.min()) == int(sizes_p.max()) == g
        object.__setattr__(self, "group_size", g if uniform else None)
        if self.finished_b is not None:
            finished = np.asarray(self.finished_b)
            if finished.shape != lengths_b.shape or finished.dtype != np.bool_:
                raise ValueError(
                    f"finished must be a bool array of the lengths' shape {lengths_b.shape}, "
                    f"got {finished.dtype} {finished.shape}"
                )
            object.__setattr__(self, "finished_b", finished)
        if self.rewards_b is not None:
            rewards = np.asarray(self.rewards_b, dtype=np.float64)
            if rewards.shape != lengths_b.shape:
                raise ValueError(
                    f"rewards of shape {rewards.shape} do not match the lengths "
                    f"({sizes_p.size} groups, {lengths_b.size} rollouts)"
                )
            object.__setattr__(self, "rewards_b", rewards)
        if self.prompt_ids_p is not None:
            ids = np.asarray(self.prompt_ids_p)
            if ids.shape != sizes_p.shape or not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(
                    f"prompt_ids must be an integer array [{sizes_p.size}], one per group, got "
                    f"{ids.dtype} {ids.shape}"
                )
            object.__setattr__(self, "prompt_ids_p", ids.astype(np.int64, copy=False))
        for field in ("lengths_b", "sizes_p", "finished_b", "rewards_b", "prompt_ids_p"):
            value = getattr(self, field)
            if value is not None:  # read-only: the controller and the metrics share it
                frozen = value.view()
                frozen.flags.writeable = False
                object.__setattr__(self, field, frozen)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def of_groups(
        cls, lengths_pg, finished_pg=None, rewards_pg=None, prompt_ids=None
    ) -> StepObservation:
        """A step of one G: ``lengths_pg`` integer ``[P, G]``; ``finished_pg`` bool ``[P, G]``
        or None; ``rewards_pg`` float ``[P, G]`` or None; ``prompt_ids`` integer ``[P]`` or
        None."""
        lengths = np.asarray(lengths_pg)
        if lengths.ndim != 2 or 0 in lengths.shape:
            check_lengths(lengths)  # its message; dtype and values: checked as [B] below
        if finished_pg is not None:
            check_finished(finished_pg, lengths.shape)
            finished_pg = np.asarray(finished_pg).ravel()
        if rewards_pg is not None:
            rewards = np.asarray(rewards_pg, dtype=np.float64)
            if rewards.shape != lengths.shape:
                raise ValueError(
                    f"rewards_pg has shape {list(rewards.shape)}; it must match the lengths' "
                    f"{list(lengths.shape)}"
                )
            rewards_pg = rewards.ravel()
        sizes_p = np.full(lengths.shape[0], lengths.shape[1], dtype=np.int64)
        return cls(lengths.ravel(), sizes_p, finished_pg, rewards_pg, prompt_ids)

    @classmethod
    def of_rollouts(
        cls, lengths, group_sizes=None, finished=None, rewards=None, prompt_ids=None
    ) -> StepObservation:
        """Groups of any sizes: ``lengths`` in any layout of ``check_ragged_lengths`` (flat
        ``[B]`` with ``group_sizes``, padded ``[P, max G]`` with ``group_sizes``, a list of
        1-D arrays, or ``[P, G]``); ``finished`` and ``rewards`` (or None) in the same
        layout."""
        lengths_b, sizes_p = check_ragged_lengths(lengths, group_sizes)
        return cls(
            lengths_b,
            sizes_p,
            _flat(finished, sizes_p, "finished"),
            _flat(rewards, sizes_p, "rewards"),
            prompt_ids,
        )

    # ------------------------------------------------------------------ views

    @property
    def num_groups(self) -> int:
        return int(self.sizes_p.size)

    def lengths_pg(self, expected_group_size: int | None = None) -> np.ndarray:
        """int64 ``[P, G]`` view of a step of one G. Raises ValueError when the groups' sizes
        differ, or differ from ``expected_group_size`` (the G a controller proposed)."""
        g = self.group_size
        if g is None:
            raise ValueError(
                f"the step has groups of mixed sizes {self.sizes_p.tolist()}; a controller "
                f"that plays one G per step reads lengths [num_groups, G]"
            )
        if expected_group_size is not None and g != expected_group_size:
            raise ValueError(
                f"lengths have group size {g} (shape {(self.num_groups, g)}) but the "
                f"controller proposed G={expected_group_size}; observe the lengths of the step "
                f"that used the proposed G"
            )
        return self.lengths_b.reshape(self.num_groups, -1)

    @property
    def finished_pg(self) -> np.ndarray | None:
        """bool ``[P, G]`` view of ``finished_b`` (one G per step), or None."""
        return None if self.finished_b is None else self.finished_b.reshape(self.num_groups, -1)

    @property
    def rewards_pg(self) -> np.ndarray | None:
        """float64 ``[P, G]`` view of ``rewards_b`` (one G per step), or None."""
        return None if self.rewards_b is None else self.rewards_b.reshape(self.num_groups, -1)

    @property
    def cut(self) -> bool:
        """Whether tail batching stopped some rollout before it finished."""
        return self.finished_b is not None and not bool(self.finished_b.all())


def varied_groups(rewards_b, sizes_p=None) -> np.ndarray:
    """bool [P]: the groups (``sizes_p`` consecutive rows each of ``rewards_b`` [B]; None:
    ``rewards_b`` is ``[P, G]``, a group a row) whose rewards are not all equal: the groups with
    learning signal (advantages not all 0)."""
    rewards_b = np.asarray(rewards_b)
    if sizes_p is None:
        return rewards_b.max(axis=1) > rewards_b.min(axis=1)
    starts = np.concatenate([[0], np.cumsum(sizes_p)[:-1]]).astype(np.int64)
    return np.maximum.reduceat(rewards_b, starts) > np.minimum.reduceat(rewards_b, starts)


def _checked_rollouts(lengths_b, sizes_p) -> tuple[np.ndarray, np.ndarray]:
    """``check_ragged_lengths(lengths_b, sizes_p)``, with a fast path for the arrays the
    constructors pass (int64, flat, consistent): a step's observation is built every step."""
    if (
        isinstance(lengths_b, np.ndarray)
        and isinstance(sizes_p, np.ndarray)
        and lengths_b.dtype == np.int64
        and sizes_p.dtype == np.int64
        and lengths_b.ndim == sizes_p.ndim == 1
        and sizes_p.size > 0
        and lengths_b.size == int(sizes_p.sum())
        and int(sizes_p.min()) >= 1
        and int(lengths_b.min()) >= 0
    ):
        return lengths_b, sizes_p
    return check_ragged_lengths(lengths_b, sizes_p)


def _flat(values, sizes_p: np.ndarray, name: str) -> np.ndarray | None:
    """``values`` laid out as the lengths (flat, padded ``[P, max G]``, a list of 1-D arrays
    or ``[P, G]``) as one flat array ``[B]``, group by group; None stays None."""
    if values is None:
        return None
    if isinstance(values, list | tuple) and values and np.ndim(values[0]) == 1:
        return np.concatenate([np.asarray(v) for v in values])
    arr = np.asarray(values)
    if arr.ndim == 2 and arr.shape[0] == sizes_p.size and arr.shape[1] >= sizes_p.max():
        return arr[np.arange(arr.shape[1])[None, :] < sizes_p[:, None]]  # row-major: group order
    if arr.ndim != 1:
        raise ValueError(
            f"{name} of shape {arr.shape} do not match the lengths ({sizes_p.size} groups, "
            f"{int(sizes_p.sum())} rollouts)"
        )
    return arr


def check_observation(obs) -> StepObservation:
    """``obs`` itself; raises TypeError, saying how to build one, when it is not a
    :class:`StepObservation` (``observe`` took arrays before it took this type)."""
    if not isinstance(obs, StepObservation):
        raise TypeError(
            f"observe() takes a StepObservation, got {type(obs).__name__}; build one with "
            f"StepObservation.of_groups(lengths_pg, finished_pg, rewards_pg) or "
            f"StepObservation.of_rollouts(lengths, group_sizes, ...)"
        )
    return obs
