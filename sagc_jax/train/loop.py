"""The synchronous GRPO/DAPO loop with SAGC in it.

Every step: ``G = controller.propose()`` -> rollout of ``prompts x G`` completions (more rounds
with DAPO dynamic sampling) -> rewards and shaping -> group advantages -> policy update ->
``controller.observe(lengths)`` -> metrics, checkpoint. The prompt-aware hybrid controller
decides from the step's prompts (ids and token lengths): one G (``step`` mode) or a group size
per prompt summing to a rollout budget (``per_prompt``), and observes with ids and rewards.
Per-step randomness comes from ``fold_in(root_key, step)``, prompts from the step counter and G
from the controller, whose state is checkpointed, so a resumed run continues exactly as an
uninterrupted one would.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sagc_jax.config import Config, ConfigError, changed_keys, to_dict
from sagc_jax.controller import make_controller
from sagc_jax.models import lora
from sagc_jax.parallel import ShardingPlan, any_process, from_leader, gather_rows, is_leader
from sagc_jax.rl import (
    ALGORITHMS,
    completion_mask,
    group_advantages,
    informative_groups,
    overlong_penalty,
)
from sagc_jax.sampling.padding import bucket_length
from sagc_jax.tasks.source import data_identity, make_source, with_resolved_buckets
from sagc_jax.train.evaluate import evaluate_policy, policy_sampler
from sagc_jax.train.hooks import Hooks, ProgressBar, itstime
from sagc_jax.train.lora_base import base_identity, check_same_base
from sagc_jax.train.metrics import MetricsWriter, read_metrics, summarize
from sagc_jax.train.packing import (
    pack_update_batch,
    packed_rows_needed,
    resolve_pack_len,
    row_multiple,
)
from sagc_jax.train.policy import (
    build_sharded_adapters,
    build_sharded_policy,
    build_tokenizer,
    load_run_params,
)
from sagc_jax.train.programs import PolicyPrograms, StateShardings, batch_spec
from sagc_jax.train.rollout import Rollouts, generate
from sagc_jax.train.safety.checkpoint import CheckpointStore
from sagc_jax.train.safety.faults import StopRequest, crash_point, phase, resume_hint
from sagc_jax.train.safety.preflight import check_device_memory, check_free_space, device_memory
from sagc_jax.train.safety.runlock import RunDirError, RunLock
from sagc_jax.train.shapes import (
    check_batch_shapes,
    check_hybrid,
    make_trainer_optimizer,
    prompts_for,
    rollout_shapes,
    update_settings,
)
from sagc_jax.train.tail import TailBatcher

# The hybrid controller's per-prompt table: its state keys whose arrays (one row per prompt) are
# saved as an Orbax item padded to controller.hybrid.capacity rows, not in the JSON meta.
PROMPT_TABLE = "predictor_table_"


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one train step produced, this process's rows (:meth:`Trainer.record` makes the log
    line of it)."""

    group_size: int | np.ndarray  # G, or int64 [P] per-prompt sizes (hybrid per_prompt)
    batch: Rollouts  # the rows trained on (informative groups of every round)
    rounds: list[Rollouts]  # every sampling round, as sampled
    used_rounds: int
    update_rows: int  # packed rows (or one per rollout, unpacked)
    rewards: np.ndarray  # float32 [N] shaped rewards of ``batch``
    zero_variance_p: np.ndarray  # bool [P] groups whose rewards were all equal
    update: dict[str, float]  # the update program's metrics
    controller: dict[str, Any]  # what the controller observed
    lengths: np.ndarray  # int [all rows] completion lengths, every process's, every round
    clock: dict[str, float]  # when the stages ended: start, sampled, packed, updated, end


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite updates (message is one line)."""


class Trainer:
    """Owns the policy, optimizer, controller, programs and run directory of one RL run."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, log: bool = True):
        check_hybrid(cfg, jax.process_count())
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.leader = is_leader()  # only process 0 writes logs and prints
        # The run directory first: writable and free, before anything is built or compiled.
        self.lock = RunLock(self.run_dir, "train", report=self._say)
        self._lock_run_dir()
        try:
            self._build(cfg, log)
        except BaseException:
            self.lock.release()  # a refused start leaves the directory as it was
            raise

    def _build(self, cfg: Config, log: bool) -> None:
        """Everything after the lock: data, memory check, policy, optimizer, programs, the
        checkpoint store and a resume from it, the metrics writer."""
        if cfg.train.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", cfg.train.compilation_cache_dir)
        self.plan = ShardingPlan.from_config(cfg.mesh)
        self.source = make_source(
            cfg,
            build_tokenizer(cfg) if cfg.data.task != "synthetic" else None,
            shard_index=jax.process_index(),
            num_shards=jax.process_count(),
        )
        self.tokenizer = self.source.tokenizer
        self.data_identity = data_identity(cfg)  # checkpoints record it; a resume compares it
        self.controller = make_controller(cfg.controller)
        self.tail = None  # on-policy tail batching: its deferred queue and data cursor
        if cfg.tail_batching.enabled:
            self.tail = TailBatcher(cfg.tail_batching, jax.process_count())
        check_batch_shapes(
            cfg, self.controller.candidates, self.plan.batch_shards, jax.process_count()
        )
        if cfg.train.memory_check:
            check_device_memory(with_resolved_buckets(cfg, self.source))
        self.graphdef, self.params, self.model_config, param_shardings = build_sharded_policy(
            cfg, self.tokenizer, cfg.train.seed, self.plan
        )
        if cfg.train.init_checkpoint:
            self.params = load_run_params(cfg.train.init_checkpoint, self.params)
        # The samplers decode the plain model: the params, or the base with the adapters merged.
        self.sampling_graphdef, sampling_shardings = self.graphdef, param_shardings
        self.base = base_shardings = self.base_identity = None
        if cfg.model.lora_rank:  # the params built so far become the frozen base
            self.base, base_shardings = self.params, param_shardings
            self.base_identity = base_identity(cfg)  # checkpoints record it; a resume compares
            self.graphdef, self.params, param_shardings, arch = build_sharded_adapters(
                cfg, self.model_config, cfg.train.seed, self.plan
            )
            merge = functools.partial(lora.merge_adapters, lora_scale=lora.scale(arch))
            self._merge = jax.jit(merge, out_shardings=base_shardings)
        self.tx = make_trainer_optimizer(cfg)
        opt_shardings = self.plan.opt_state(
            self.tx, jax.eval_shape(self.tx.init, self.params), param_shardings
        )
        self.opt_state = jax.jit(self.tx.init, out_shardings=opt_shardings)(self.params)
        check_free_space(self.run_dir, (self.params, self.opt_state))  # on every process
        self.ref_params = None  # LoRA: the reference is the base with the adapters off
        if cfg.loss.kl_beta > 0 and self.base is None:
            copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=param_shardings)
            self.ref_params = copy(self.params)
        self.scale_by_std = ALGORITHMS[cfg.loss.algorithm][1]
        self.settings = update_settings(cfg)
        t = cfg.train
        self.pack_len = resolve_pack_len(
            t.pack_len, self.source.prompt_buckets, cfg.sampling.max_new_tokens
        )
        self.row_multiple = row_multiple(
            t.minibatches, t.microbatches, self.plan.batch_shards, jax.process_count()
        )
        ref_shardings = param_shardings if self.ref_params is not None else None
        shardings = StateShardings(param_shardings, opt_shardings, ref_shardings, base_shardings)
        self.programs = PolicyPrograms(self.graphdef, self.tx, self.plan, shardings)
        on_mesh = dict(plan=self.plan, state_shardings=sampling_shardings, sampling=cfg.sampling)
        # two samplers, so that compiles/sampler counts the rollout programs only; held-out
        # prompts decode one slot each
        self.sampler, self.eval_sampler = (
            policy_sampler(
                self.sampling_graphdef, self.model_config, self.tokenizer, slots=slots, **on_mesh
            )
            for slots in (self._rollout_slots(), 0)
        )
        self.root_key = jax.random.key(t.seed)
        self.step = 0
        self.store = CheckpointStore(
            self.run_dir / "checkpoints", keep=t.keep_checkpoints, async_save=t.async_checkpoint
        )
        self.last_eval: dict[str, float] = {}
        self.interrupted = ""  # name of the signal that stopped the run, if one did
        self.last_saved_step: int | None = None
        self.spike_step: int | None = None  # the last gradient-norm spike (train.spike_factor)
        self.quiet_until = -1  # no checkpoint is written up to this step after a spike
        self._resume()
        # a finished run is left exactly as it is: no log is opened, nothing is rewritten
        self.writer = MetricsWriter(
            self.run_dir,
            enabled=log and self.leader and not self.finished,
            tensorboard=cfg.logging.tensorboard,
            resume_step=self.step,
            report=self._say,
        )

    def _rollout_slots(self) -> int:
        """``sampling.slots`` as rows (0: every rollout of a step); ``auto``: as many as the
        devices' memory holds beside the rest of ``sagc-jax plan``'s estimate."""
        slots = self.cfg.sampling.slots
        if slots != "auto":
            return slots
        from sagc_jax.train.plan import auto_slots

        cfg = with_resolved_buckets(self.cfg, self.source)
        chosen = auto_slots(cfg, jax.device_count(), device_memory()[0])
        self._say(f"sampling.slots = auto: {chosen} rows decode at once")
        return chosen

    def sampling_params(self):
        """What the samplers decode: the params, or (LoRA) the base with the adapters merged in,
        once per use (faster than adding them in every decode step: docs/lora.md)."""
        if self.base is None:
            return self.params
        return self._merge(self.params, self.base)

    @property
    def finished(self) -> bool:
        return self.step >= self.cfg.train.steps

    def _say(self, line: str) -> None:
        if self.leader:
            print(f"train: {line}", flush=True)

    def _lock_run_dir(self) -> None:
        """Process 0 locks the run directory for all; every process stops if it cannot."""
        error = None
        if self.leader:
            try:
                self.lock.acquire()
            except RunDirError as err:
                error = err
        if any_process(error is not None):
            raise error or RunDirError(
                f"{self.run_dir}: process 0 could not lock the run directory"
            )

    # ------------------------------------------------------------------ checkpoints

    def _resume(self) -> None:
        """Continue from the newest checkpoint that verifies (older ones are tried when the
        newest is damaged; see ``CheckpointStore``)."""
        targets = {"params": self.params, "opt_state": self.opt_state}
        _, table = self._controller_state()
        if table:
            targets["prompt_table"] = table  # a fresh table: the saved one's shapes and dtypes
        restored = self.store.restore_newest(
            targets, check_meta=self._check_resumable, report=self._say
        )
        if restored is None:
            return
        self.last_saved_step, items, meta = restored
        self.params, self.opt_state = items["params"], items["opt_state"]
        state = dict(meta["controller"])
        rows = int(state.get(f"{PROMPT_TABLE}size", 0))
        state.update({k: np.asarray(v)[:rows] for k, v in items.get("prompt_table", {}).items()})
        self.controller.load_state_dict(state)
        if self.tail is not None:
            self.tail.load_state_dict(meta["tail_batching"], jax.process_index())
        self.step = int(meta["step"])
        self.last_eval = meta.get("last_eval", {})

    def _check_resumable(self, meta: dict) -> None:
        """Raise ConfigError when the run in ``meta`` cannot continue under this config."""
        changed = changed_keys(meta["config"], self.cfg, "unresumable")
        processes = meta.get("processes", 1)
        if self.cfg.data.task == "dataset" and processes != jax.process_count():
            raise ConfigError(
                f"{self.run_dir}: cannot resume with {jax.process_count()} processes a run of "
                f"{processes}: each process reads its own shard of the dataset, so the prompt "
                f"order would change; use {processes} processes or a new logging.run_dir"
            )
        if changed:
            raise ConfigError(
                f"{self.run_dir}: cannot resume, the config differs from the run's in "
                f"{', '.join(changed[:8])}{'...' if len(changed) > 8 else ''}; use a new "
                f"logging.run_dir or the run's own config"
            )
        if self.base is not None:
            check_same_base(meta.get("base"), self.base_identity, meta["step"])
        self._check_same_data(meta)

    def _check_same_data(self, meta: dict) -> None:
        """Refuse (ConfigError) a resume whose data files changed since the checkpoint, unless
        ``train.resume_changed_data``; checkpoints from before data identities were recorded
        are not checked."""
        for key, saved in meta.get("data", {}).items():
            now = self.data_identity.get(key)
            if now is None or now["sha256"] == saved["sha256"]:
                continue  # the key itself changing is a config difference, refused above
            step = meta["step"]
            what = (
                f"{now['path']}: changed since the checkpoint of step {step} ({key}: "
                f"{saved['size']:,} -> {now['size']:,} bytes, sha256 {saved['sha256'][:12]} -> "
                f"{now['sha256'][:12]})"
            )
            if not self.cfg.train.resume_changed_data:
                raise ConfigError(
                    f"{what}; resuming would continue at the same position on other rows: "
                    f"restore the file, use a new logging.run_dir, or set "
                    f"train.resume_changed_data=true to continue at step {step} on the new "
                    f"contents"
                )
            self._say(
                f"{what}; continuing at step {step} on the new contents "
                f"(train.resume_changed_data): the prompts of the next steps are the new file's "
                f"rows at the saved position"
            )

    def _controller_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The controller's state split in two: for the JSON meta, and the hybrid's per-prompt
        table (``PROMPT_TABLE`` arrays padded to ``controller.hybrid.capacity`` rows; empty for
        the other controllers) for an Orbax item."""
        state = self.controller.state_dict()
        table = {k: v for k, v in state.items() if k.startswith(PROMPT_TABLE) and np.ndim(v) == 1}
        capacity = self.cfg.controller.hybrid.capacity
        padded = {k: np.pad(v, (0, capacity - len(v))) for k, v in table.items()}
        return {k: v for k, v in state.items() if k not in table}, padded

    def save(self) -> None:
        controller, table = self._controller_state()
        meta = {
            "step": self.step,
            "controller": controller,
            "config": to_dict(self.cfg),
            "last_eval": self.last_eval,
            "processes": jax.process_count(),
            "data": self.data_identity,
        }
        if self.base is not None:  # the weights under the adapters are not saved: named here
            meta["base"] = self.base_identity
        if self.tail is not None:  # every process's queue (a collective)
            queue = self.tail.queue_array()  # as long on every process
            queues = gather_rows(queue) if len(queue) else queue
            meta["tail_batching"] = self.tail.state_dict(queues)
        items = {"params": self.params, "opt_state": self.opt_state}
        if table:
            items["prompt_table"] = table
        hint = resume_hint(self.cfg, self.run_dir)
        if not self.store.save(self.step, items, meta, report=self._say, resume_hint=hint):
            self._say(
                f"step {self.step}: parameters or optimizer state not finite, checkpoint not "
                f"written (the last one is step {self.last_saved_step})"
            )
            return
        self.last_saved_step = self.step
        crash_point("checkpoint", self.step)  # the write is in flight (asynchronous)

    # ------------------------------------------------------------------ compilation

    def compile_ahead(self, log=print) -> None:
        """Compile the rollout and update programs of every candidate G now (one line per G).

        Uses the prompt bucket of the step's first batch; other buckets compile on first use,
        and so does each packed update's row-count rung (it depends on the step's lengths).
        """
        cfg = self.cfg
        first = self.source.batch(self.step, 0, jax.process_count())  # one prompt per process
        width = int(gather_rows(np.array([len(self.source.encode(first[0]))])).max())
        bucket = bucket_length(width, self.source.prompt_buckets)  # 'auto' resolved
        new = cfg.sampling.max_new_tokens
        key = jax.random.key(0)
        for label, (n, prompts) in rollout_shapes(cfg, self.controller.candidates).items():
            t0 = time.perf_counter()
            self.sampler.compile(
                self.sampling_params(), n, bucket, max_new_tokens=new, prompts=prompts
            )
            t1 = time.perf_counter()
            if cfg.train.packing:
                log(f"compiled {label} ({n} rollouts): rollout {t1 - t0:.1f} s")
                continue
            # shaped and placed as a real batch: rows split over the mesh
            batch = batch_spec(n, bucket, new, self.plan.rows)
            self.programs.compile_update(
                self.params, self.opt_state, batch, key, self.settings, self.ref_params, self.base
            )
            t2 = time.perf_counter()
            log(f"compiled {label} ({n} rollouts): rollout {t1 - t0:.1f} s, update {t2 - t1:.1f} s")
        if self.tail is not None:  # a tail step's rollout: more prompts, the exit test
            for g in self.controller.candidates:
                local, extra = self.tail.shape(prompts_for(cfg, g))
                started = (local + extra) * jax.process_count()
                t0 = time.perf_counter()
                self.sampler.compile(
                    self.sampling_params(),
                    started * g,
                    bucket,
                    max_new_tokens=new,
                    prompts=started,
                    keep_groups=local,
                )
                seconds = time.perf_counter() - t0
                log(f"compiled tail step G={g} ({started * g} rollouts): rollout {seconds:.1f} s")

    # ------------------------------------------------------------------ one step

    def _num_prompts(self, sizes: int | np.ndarray) -> int:
        """Prompts of the step (every process's) at G, or at the per-prompt ``sizes`` [P]."""
        return prompts_for(self.cfg, sizes) if np.ndim(sizes) == 0 else len(sizes)

    def _rollout(
        self, sizes: int | np.ndarray, key: jax.Array
    ) -> tuple[Rollouts, list[Rollouts], int]:
        """The step's training batch (P groups of G, or of the per-prompt ``sizes`` [P]), every
        round generated, and rounds used."""
        cfg = self.cfg
        num_prompts = self._num_prompts(sizes)
        s = cfg.sampling
        kwargs = dict(
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            buckets=self.source.prompt_buckets,  # sampling.prompt_buckets, 'auto' resolved
            reward_on_error=cfg.data.reward_on_error,
        )
        if self.source.rounds_per_step > 1:  # every round of the step gets one width
            kwargs["min_length"] = max(
                len(self.source.encode(p))
                for round_ in range(self.source.rounds_per_step)
                for p in self.source.batch(self.step, round_, num_prompts)
            )
        local_prompts = num_prompts // jax.process_count()  # this process's groups
        params = self.sampling_params()
        if self.tail is not None:  # one round: the first whole groups (or a long round's all)
            round_ = self.tail.next_round(self.source, self.step, num_prompts)
            r = generate(
                self.sampler,
                params,
                self.source,
                round_.prompts,
                sizes,
                key,
                keep_groups=round_.keep_groups,
                **kwargs,
            )
            kept = self.tail.settle(round_, r.cut_p, self.step)
            return r.select_groups(kept), [r], 1
        rounds = []
        kept: list[Rollouts] = []
        kept_groups = 0
        for round_ in range(self.source.rounds_per_step):
            prompts = self.source.batch(self.step, round_, num_prompts)
            r = generate(
                self.sampler,
                params,
                self.source,
                prompts,
                sizes,
                jax.random.fold_in(key, round_),
                **kwargs,
            )
            rounds.append(r)
            if not cfg.loss.dynamic_sampling:
                return r, rounds, 1
            informative = np.flatnonzero(informative_groups(self._shaped(r).reshape(-1, sizes)))
            take = informative[: local_prompts - kept_groups]
            if len(take):
                kept.append(r.select_groups(take))
                kept_groups += len(take)
            # Every process samples the same number of rounds (the sampler is one program).
            if not any_process(kept_groups < local_prompts):
                break
        if kept_groups < local_prompts:  # fill with zero-advantage groups to keep the shape
            first = rounds[0]
            spare = np.setdiff1d(
                np.arange(local_prompts),
                np.flatnonzero(informative_groups(self._shaped(first).reshape(-1, sizes))),
            )
            kept.append(first.select_groups(spare[: local_prompts - kept_groups]))
        return Rollouts.concat(kept), rounds, len(rounds)

    def _shaped(self, r: Rollouts) -> np.ndarray:
        """Rewards after DAPO overlong shaping, float32 [N]."""
        loss = self.cfg.loss
        return r.rewards + overlong_penalty(
            r.lengths,
            self.cfg.sampling.max_new_tokens,
            loss.overlong_buffer,
            loss.overlong_penalty,
        )

    def train_step(self) -> StepResult:
        """One GRPO/DAPO step, as its stages: choose G (or per-prompt sizes) -> sample (and
        score) -> shape rewards -> advantages -> update batch -> update -> observe. What it
        produced becomes the step's log line through :meth:`record`."""
        clock = {"start": time.perf_counter()}
        g = self._agreed_group_size()
        rollout_key, update_key = jax.random.split(jax.random.fold_in(self.root_key, self.step))
        crash_point("rollout", self.step)
        batch, rounds, used_rounds = self._rollout(g, rollout_key)
        clock["sampled"] = time.perf_counter()
        rewards = self._shaped(batch)
        adv, zero_variance_p = self._advantages(rewards, batch.group_sizes)
        update_batch = self._update_batch(batch, adv)
        clock["packed"] = time.perf_counter()
        crash_point("update", self.step)
        update_rows = len(update_batch["norm" if self.cfg.train.packing else "adv"])
        upd = self._update(update_batch, update_key)
        clock["updated"] = time.perf_counter()
        ctrl, lengths = self._observe(rounds)
        self.step += 1
        clock["end"] = time.perf_counter()
        return StepResult(
            g,
            batch,
            rounds,
            used_rounds,
            update_rows,
            rewards,
            zero_variance_p,
            upd,
            ctrl,
            lengths,
            clock,
        )

    def _advantages(
        self, rewards: np.ndarray, sizes_p: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(advantage float32 [N], zero-variance flag bool [P]) of this process's groups, of
        ``sizes_p`` [P] consecutive rows each (one G, or mixed sizes)."""
        group_ids = np.repeat(np.arange(len(sizes_p)), sizes_p)
        adv, stats = group_advantages(
            rewards, group_ids, len(sizes_p), scale_by_std=self.scale_by_std
        )
        return np.asarray(adv, np.float32), np.asarray(stats["zero_variance_p"])

    def _update_batch(self, batch: Rollouts, adv: np.ndarray) -> dict[str, jax.Array]:
        """The update's input as global arrays over the mesh: this process's rollouts packed
        into the row-count rung every process agrees on (``train.packing``), or one padded row
        per rollout."""
        mask = completion_mask(
            batch.lengths,
            batch.completion.shape[1],
            batch.truncated if self.cfg.loss.mask_truncated else None,
        )
        if not self.cfg.train.packing:
            padded = {
                "prompt_ids": batch.prompt_ids,
                "prompt_lens": batch.prompt_lens,
                "completion": batch.completion,
                "old_logp": batch.logprobs,
                "mask": mask,
                "adv": adv,
            }
            return self.plan.global_rows(padded)
        rows = packed_rows_needed(
            batch.prompt_lens,
            mask,
            pack_len=self.pack_len,
            multiple=self.row_multiple,
            max_rows=len(batch.lengths),
        )
        rows = int(gather_rows(np.array([rows])).max())  # one rung for every process
        packed = pack_update_batch(
            batch.prompt_ids,
            batch.prompt_lens,
            batch.completion,
            batch.logprobs,
            adv,
            mask,
            aggregation=self.settings.aggregation,
            max_new_tokens=self.cfg.sampling.max_new_tokens,
            pack_len=self.pack_len,
            rows=rows,
        )
        return self.plan.global_rows(packed)

    def _update(self, update_batch: dict, key: jax.Array) -> dict[str, float]:
        """``epochs x minibatches`` optimizer updates; their metrics averaged."""
        self.params, self.opt_state, upd = self.programs.update(
            self.params,
            self.opt_state,
            update_batch,
            key,
            self.settings,
            self.ref_params,
            self.base,
        )
        return {k: float(v) for k, v in jax.device_get(upd).items()}

    def _observe(self, rounds: list[Rollouts]) -> tuple[dict, np.ndarray]:
        """The controller sees every process's lengths of every round: (its stats, lengths);
        the hybrid also their groups' sizes, prompt ids and raw rewards."""
        every = Rollouts.concat(rounds)
        lengths = gather_rows(every.lengths)
        sizes_p = gather_rows(every.group_sizes)
        if not self.controller.prompt_aware:
            lengths_pg = lengths.reshape(len(sizes_p), -1)
            if every.cut is None:
                return self.controller.observe(lengths_pg), lengths
            # tail batching: a cut rollout's length is a lower bound
            finished_pg = ~gather_rows(every.cut).reshape(lengths_pg.shape)
            return self.controller.observe(lengths_pg, finished_pg=finished_pg), lengths
        ids_p = gather_rows(np.array([p.id for p in every.prompts], np.int64))
        ctrl = self.controller.observe(
            lengths, group_sizes=sizes_p, prompt_ids=ids_p, rewards=gather_rows(every.rewards)
        )
        return ctrl, lengths

    def record(self, step: StepResult) -> dict[str, Any]:
        """The step's metrics (one JSONL line, docs/metrics.md), over every process's rows (a
        collective: every process calls it)."""
        g, batch, rounds, used_rounds = step.group_size, step.batch, step.rounds, step.used_rounds
        rewards, zero_variance_p, upd, ctrl = (
            step.rewards,
            step.zero_variance_p,
            step.update,
            step.controller,
        )
        lengths, clock, update_rows = step.lengths, step.clock, step.update_rows
        all_rounds = Rollouts.concat(rounds)
        rewards = gather_rows(rewards)
        local_counts = np.array(
            [
                [
                    sum(len(r.failed_rows) for r in rounds),
                    sum(len(r.timed_out_rows) for r in rounds),
                    int(batch.prompt_lens.sum()),
                    int(batch.lengths.sum()),
                ]
            ]
        )
        failed, timed_out, prompt_tokens, trained_tokens = gather_rows(local_counts).sum(axis=0)
        t_rollout = clock["sampled"] - clock["start"]
        t_update = clock["updated"] - clock["packed"]
        total = clock["end"] - clock["start"]
        generated = int(lengths.sum())
        sizes_p = gather_rows(batch.group_sizes)
        record = {
            "reward": float(rewards.mean()),
            "reward_raw": float(gather_rows(batch.rewards).mean()),
            "accuracy": float(np.mean(gather_rows(all_rounds.rewards) >= 1.0)),
            "length/mean": float(lengths.mean()),
            "length/max": int(lengths.max()),
            "length/min": int(lengths.min()),
            "length/median": float(np.median(lengths)),
            "length/trained_mean": float(trained_tokens) / len(rewards),
            "truncated_frac": float(gather_rows(all_rounds.truncated).mean()),
            "group_size": g if np.ndim(g) == 0 else float(sizes_p.mean()),
            "prompts": len(sizes_p),
            "rounds": used_rounds,
            "zero_variance_frac": float(np.mean(gather_rows(zero_variance_p))),
            "reward_failed_rows": int(failed),
            "reward_timeouts": int(timed_out),
            "controller/lambda": ctrl.get("lambda", 0.0),
            "controller/s_t": ctrl["s_t"],
            "controller/straggler_rate": ctrl["straggler_rate"],
            "controller/max_ratio": ctrl["max_ratio"],
            "padding_waste": ctrl["padding_waste"],
            "decode_steps": all_rounds.decode_steps,
            "decode/rows_per_step": all_rounds.rows_decoded / max(all_rounds.decode_steps, 1),
            "decode/padding_share": 1.0
            - all_rounds.live_rows_decoded / max(all_rounds.rows_decoded, 1),
            "time/rollout_s": t_rollout,
            "time/update_s": t_update,
            "time/step_s": total,
            "throughput/rollout_tokens_per_s": generated / max(t_rollout, 1e-9),
            "throughput/tokens_per_s": generated / max(total, 1e-9),
            # real prompt + completion tokens of the update batch, per second of update
            "throughput/update_tokens_per_s": (prompt_tokens + trained_tokens)
            * self.cfg.train.epochs
            / max(t_update, 1e-9),
            "compiles/sampler": self.sampler.num_traces,
            "compiles/update": self.programs.compiled_programs()["update"],
            "update_rows": update_rows,  # packed rows (or one per rollout, unpacked)
            **{f"update/{k}": v for k, v in upd.items()},
            "group_ratios": ctrl["group_ratios"],
            "lengths": [  # group by group, every round
                group.tolist()
                for group in np.split(lengths, np.cumsum(gather_rows(all_rounds.group_sizes))[:-1])
            ],
            "prompt_tokens": int(prompt_tokens) // len(rewards),
        }
        if np.ndim(g):
            record["group_sizes"] = sizes_p
        if ctrl.get("posterior_mean") is not None:
            record["controller/posterior_mean"] = ctrl["posterior_mean"]
        if "slack" in ctrl:  # SAGC+: the budget slack that moves G between its two rungs
            record["controller/slack"] = ctrl["slack"]
        if self.controller.prompt_aware:
            # the step's mean predicted straggle (made before sampling) beside the observed
            # s_t, and the running calibration of every group so far
            calibration = self.controller.calibration()
            record["controller/predicted_s_t"] = ctrl.get("predicted_s_t", math.nan)
            record["controller/calibration_ece"] = calibration["ece"]
            record["controller/calibration_brier"] = calibration["brier"]
        if self.tail is not None:  # every process starts and defers as many prompts
            last, processes = self.tail.last, jax.process_count()
            record["tail/long_round"] = last["long"]
            record["tail/prompts_started"] = last["started"] * processes
            record["tail/deferred"] = last["deferred"] * processes
            record["tail/waited_max"] = int(gather_rows(np.array([last["waited"]])).max())
            record["tail/queue"] = len(self.tail.queue) * processes
            record["tail/queue_oldest"] = self.tail.oldest(self.step)
            record["tail/long_rounds"] = self.tail.long_rounds
            record["tail/censored_groups"] = ctrl.get("censored_groups", 0)
            record["tail/censored_stragglers"] = ctrl.get("censored_stragglers", 0)
        if upd.get("skipped", 0) > 0:
            record["warning"] = "non-finite loss or gradient: update skipped"
        return record

    def _agreed_group_size(self) -> int | np.ndarray:
        """The controller's G, or int64 [P] per-prompt sizes (hybrid ``per_prompt``), checked to
        be process 0's (the controllers of all processes see the same gathered statistics and
        prompts, so they must agree)."""
        if self.controller.prompt_aware:
            g = self.controller.propose_for(*self._step_prompts())
        else:
            g = self.controller.propose()
        leader_g = from_leader(np.asarray(g, np.int32))
        if any_process(not np.array_equal(leader_g, g)):  # all stop together, none waits alone
            raise RuntimeError(
                f"step {self.step}: the processes' controllers disagree (process "
                f"{jax.process_index()}: G = {g}, process 0: G = {leader_g}); their states diverged"
            )
        return g

    def _step_prompts(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 [P], prompt tokens int64 [P]) of the step's prompts, every process's, in
        the order of the global batch (``train.batch_mode: prompts``: they do not depend on G)."""
        prompts = self.source.batch(self.step, 0, self.cfg.train.prompts_per_step)
        ids = np.array([p.id for p in prompts], np.int64)
        tokens = np.array([len(self.source.encode(p)) for p in prompts], np.int64)
        return gather_rows(ids), gather_rows(tokens)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, num: int | None = None) -> dict[str, float]:
        """Greedy held-out accuracy and mean completion length of the current policy."""
        params = self.sampling_params()
        return evaluate_policy(self.eval_sampler, params, self.source, self.cfg, num)

    # ------------------------------------------------------------------ the run

    def run(self, progress: bool = True) -> dict[str, Any]:
        """Train until ``train.steps``; returns a summary of the run."""
        cfg = self.cfg
        total_steps = cfg.train.steps
        start_step = self.step
        # A stop signal before the step loop ends the run at once (see faults.phase).
        kept = ""
        if self.step:
            kept = (
                f"the checkpoint of step {self.step} in {self.run_dir} is kept; "
                f"{resume_hint(cfg, self.run_dir)}"
            )
        crash_point("startup", self.step)
        if self.step == 0:
            with phase("the step-0 evaluation"):
                crash_point("eval", 0)
                self.last_eval = self.evaluate()
            self.writer.write(0, self.last_eval)
        if cfg.train.compile_ahead:
            with phase("compilation", kept):
                crash_point("compile", self.step)
                self.compile_ahead(log=print if self.leader else lambda _: None)
        bar = None
        if progress and self.leader:

            def postfix(step: int, record: dict) -> dict:
                rate = self.controller.straggler_sum / max(self.controller.step, 1)
                return {
                    "G": record["group_size"],
                    "reward": f"{record['reward']:.2f}",
                    "strag": f"{rate:.2f}",
                }

            bar = ProgressBar("train", total_steps, self.step, postfix)
        try:
            with StopRequest() as stop:
                hooks = self._hooks(stop, bar)
                hooks.run(self.step, lambda _: self.record(self.train_step()))  # advances step
        finally:
            if bar is not None:
                bar.close()
        self.interrupted = hooks.stopped
        self.store.wait()
        return {
            **self.summary(),
            "steps_run": self.step - start_step,
            "interrupted": self.interrupted,
        }

    def summary(self) -> dict[str, Any]:
        """The whole run so far, every segment of it, from ``metrics.jsonl`` (process 0)."""
        steps, evals = read_metrics(self.run_dir) if self.leader else ([], [])
        return summarize(steps, evals)

    def _hooks(self, stop: StopRequest, bar: ProgressBar | None) -> Hooks:
        """What runs after each step, in order: evaluation, the log line and progress bar, the
        divergence check, sealing finished checkpoints, saving one (and stopping) when due."""
        t = self.cfg.train
        hooks = Hooks(t.steps)

        def evaluate(step, record):
            self.last_eval = self.evaluate()
            record.update(self.last_eval)

        def log(step, record):
            self.writer.write(step, record, self.controller.candidates)

        norms: collections.deque = collections.deque(maxlen=t.spike_window)

        def check_spike(step, record):
            """A gradient-norm spike holds checkpoints back for spike_window steps."""
            norm = record.get("update/grad_norm", math.nan)
            if not t.spike_factor or not math.isfinite(norm):
                return
            baseline = float(np.median(norms)) if len(norms) >= max(2, t.spike_window // 2) else 0
            norms.append(norm)
            if baseline > 0 and norm > t.spike_factor * baseline:
                if self.spike_step is None or step > self.quiet_until:
                    self.spike_step = step  # the first spike of this stretch
                    self._say(
                        f"step {step}: gradient norm {norm:.3g} is {norm / baseline:.0f}x the "
                        f"median of the last {len(norms) - 1} steps (train.spike_factor "
                        f"{t.spike_factor:g}); no checkpoint until {t.spike_window} steps pass "
                        f"without a spike"
                    )
                self.quiet_until = step + t.spike_window

        bad_updates = 0

        def check_divergence(step, record):
            nonlocal bad_updates
            bad_updates = bad_updates + 1 if record["update/skipped"] > 0 else 0
            if bad_updates >= t.max_nonfinite_steps:
                raise TrainingDiverged(
                    f"step {step}: the loss or gradient was not finite in {bad_updates} steps "
                    f"in a row (train.max_nonfinite_steps); {self._restart_point()}"
                )

        last_save = time.perf_counter()

        def checkpoint(step, record):
            nonlocal last_save
            self.store.seal_finished()
            stopping = stop.should_stop(step)
            minutes = t.checkpoint_minutes
            due = (
                itstime(step, t.checkpoint_every, t.steps)
                or stopping
                # clocks differ between processes: all save when any is due
                or any_process(minutes and time.perf_counter() - last_save >= 60 * minutes)
            )
            if due and step <= self.quiet_until and step < t.steps:  # the last is kept
                self._say(
                    f"step {step}: checkpoint held back after the gradient-norm spike of step "
                    f"{self.spike_step} (train.spike_factor); the last one is step "
                    f"{self.last_saved_step}"
                )
            elif due:
                self.save()
                last_save = time.perf_counter()
            if stopping:
                hooks.stop(stop.name)

        hooks.add(evaluate, every=t.eval_every)
        hooks.add(log)
        if bar is not None:
            hooks.add(bar)
        hooks.add(check_spike)
        hooks.add(check_divergence)
        hooks.add(checkpoint)
        return hooks

    def _restart_point(self) -> str:
        """Where to restart a diverged run from, for its message."""
        last, spike = self.last_saved_step, self.spike_step
        if last is None:
            return "no checkpoint was saved; lower train.learning_rate or check the rewards"
        before = ""
        if spike is not None and spike > last:
            before = f", from before the gradient-norm spike of step {spike},"
        return (
            f"checkpoint step {last}{before} is the last saved: start a new run from it with "
            f"a lower learning rate (--set train.init_checkpoint={self.run_dir} --set "
            f"train.learning_rate=... and a new logging.run_dir), or check the rewards"
        )

    def close(self) -> None:
        try:
            self.store.close()
            self.writer.close()
        finally:
            self.lock.release()
