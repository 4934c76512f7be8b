"""The synchronous GRPO/DAPO loop with SAGC in it.

Every step: ``G = controller.propose()`` -> rollout of ``prompts x G`` completions (more rounds
with DAPO dynamic sampling) -> rewards and shaping -> group advantages -> policy update ->
``controller.observe(obs)`` (the step's ``StepObservation``) -> metrics, checkpoint. The
prompt-aware hybrid controller decides from the step's prompts (ids and token lengths): one G
(``step`` mode) or a group size per prompt summing to a rollout budget (``per_prompt``).
Per-step randomness comes from ``fold_in(root_key, step)``, prompts from the step counter and G
from the controller, whose state is checkpointed, so a resumed run continues exactly as an
uninterrupted one would.

The stages live beside the loop: sampling in ``rollout``, the controller's calls in
``control``, the step's metrics in ``metrics``, what runs after each step in ``hooks``, and the
checkpoints with their resume rules in ``safety.run_state``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from sagc_jax.config import Config
from sagc_jax.parallel import ShardingPlan, any_process, gather_rows, is_leader
from sagc_jax.planning.host_memory import trim_after_compiles
from sagc_jax.planning.resolve import device_memory, resolve_run
from sagc_jax.programs.compile_cache import CompileClock, use_compilation_cache
from sagc_jax.programs.packing import row_ladder
from sagc_jax.programs.policy import (
    build_sharded_policy,
    source_tokenizer,
)
from sagc_jax.programs.state import build_run
from sagc_jax.programs.tail import TailBatcher
from sagc_jax.programs.update import batch_spec, packed_batch_spec
from sagc_jax.rl import ALGORITHMS, group_advantages
from sagc_jax.sampling.padding import bucket_length
from sagc_jax.sampling.sampler import policy_sampler
from sagc_jax.tasks.source import data_identity, make_source
from sagc_jax.train.completions import CompletionLog
from sagc_jax.train.control import agreed_group_size, observe
from sagc_jax.train.evaluate import evaluate_policy, heldout_shape
from sagc_jax.train.hooks import (
    Checkpointing,
    DivergenceCheck,
    Evaluation,
    Hooks,
    ProgressBar,
    RewardStallNotice,
    SpikeGuard,
    StepLog,
)
from sagc_jax.train.lora_base import base_identity
from sagc_jax.train.metrics import (
    MetricsWriter,
    StepResult,
    read_metrics,
    step_counts,
    step_record,
    summarize,
)
from sagc_jax.train.rollout import StepPrompts, sample_step
from sagc_jax.train.safety.faults import StopRequest, crash_point, phase, resume_hint
from sagc_jax.train.safety.preflight import check_free_space
from sagc_jax.train.safety.run_state import RunState
from sagc_jax.train.safety.runlock import RunLock
from sagc_jax.train.update_batch import UpdateBatcher
from sagc_jax.train.warm_start import load_run_params


class Trainer:
    """Owns the policy, optimizer, controller, programs and run directory of one RL run."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, log: bool = True):
        self.cfg = cfg  # as given; resolved (``self.shape.cfg``) once the data is read
        self.run_dir = Path(run_dir)
        self.leader = is_leader()  # only process 0 writes logs and prints
        # The run directory first: writable and free, before anything is built or compiled.
        self.lock = RunLock(self.run_dir, "train", report=self._say)
        self.lock.acquire_for_all()
        try:
            self._build(cfg, log)
        except BaseException:
            self.lock.release()  # a refused start leaves the directory as it was
            raise

    def _build(self, cfg: Config, log: bool) -> None:
        """Everything after the lock, stage by stage: the compilation cache, the run resolved
        against its data and the device, its policy and programs, the samplers, its checkpoints
        and a resume from them, the logs."""
        use_compilation_cache(cfg.train.compilation_cache_dir, report=self._say)
        self.compile_clock = CompileClock()  # each metrics line: the seconds compiling before it
        trim_after_compiles()
        data_id = self._resolve(cfg)
        self._build_policy_and_programs(self.cfg)
        self._build_samplers(self.cfg)
        self._resume(self.cfg, data_id)
        self._open_logs(self.cfg, log)

    def _resolve(self, cfg: Config) -> dict:
        """The mesh, the prompt source and the run resolved once (``self.shape``, whose config
        is the run's from here on), the controller and tail batching; returns what checkpoints
        record of the data files as read."""
        self.plan = ShardingPlan.from_config(cfg.mesh)
        tokenizer = source_tokenizer(cfg)  # None: the source has its own
        self.source = make_source(
            cfg, tokenizer, shard_index=jax.process_index(), num_shards=jax.process_count()
        )
        self.tokenizer = self.source.tokenizer
        data_id = data_identity(cfg)  # the files as read: checkpoints record it
        available, what = device_memory()
        self.shape = resolve_run(
            cfg,
            self.plan,
            processes=jax.process_count(),
            source=self.source,
            device_bytes=available,
            memory_check=what if cfg.train.memory_check else None,
            report=self._say,
        )
        self.cfg = cfg = self.shape.cfg  # every "auto" concrete from here on
        self.controller = self.shape.controller
        self.tail = None  # on-policy tail batching: its deferred queue and data cursor
        if cfg.tail_batching.enabled:
            self.tail = TailBatcher(cfg.tail_batching, jax.process_count())
        return data_id

    def _build_policy_and_programs(self, cfg: Config) -> None:
        """The policy (warm-started from ``train.init_checkpoint`` if set), the run's state and
        programs, the free-space check and the update batcher."""
        policy = build_sharded_policy(self.shape.policy, cfg.model.hf_checkpoint, cfg.train.seed)
        if cfg.train.init_checkpoint:
            params = load_run_params(cfg.train.init_checkpoint, policy.params)
            policy = policy._replace(params=params)
        self.model_config = policy.arch
        self.programs, self.state = build_run(self.shape.training, self.plan, policy)
        check_free_space(self.run_dir, (self.state.params, self.state.opt_state))
        self.scale_by_std = ALGORITHMS[cfg.loss.algorithm].scale_by_std
        self.batcher = UpdateBatcher(self.shape, self.plan)
        if cfg.train.drop_no_signal and not self.batcher.drops:
            self._say(
                "loss.kl_beta > 0: every rollout is trained, those of advantage 0 too (the KL "
                "term gives them a gradient; train.drop_no_signal applies without it)"
            )

    def _build_samplers(self, cfg: Config) -> None:
        """Two samplers, so that compiles/sampler counts the rollout programs only; held-out
        prompts decode one row each, through as many rows as the memory check counted."""
        on_mesh = dict(
            plan=self.plan,
            state_shardings=self.programs.sampling_shardings,
            sampling=cfg.sampling,
        )
        self.sampler, self.eval_sampler = (
            policy_sampler(
                self.programs.sampling_graphdef,
                self.model_config,
                self.tokenizer,
                slots=rows,
                **on_mesh,
            )
            for rows in (self.shape.slots, self.shape.eval_slots)
        )

    def _resume(self, cfg: Config, data_id: dict) -> None:
        """The run's checkpoints (recording ``data_id``, the data files as read, and with LoRA
        the identity of the weights under the adapters), and the newest one's step, state and
        controller if there is one (else step 0)."""
        base_id = base_identity(cfg) if cfg.model.lora_rank else None
        self.root_key = jax.random.key(cfg.train.seed)
        self.step = 0
        self.run_state = RunState(
            cfg,
            self.run_dir,
            self.controller,
            self.tail,
            data_id=data_id,
            base_id=base_id,
            report=self._say,
        )
        resumed = self.run_state.resume(self.state.params, self.state.opt_state)
        if resumed is not None:
            self.step, params, opt_state = resumed
            self.state = self.state._replace(params=params, opt_state=opt_state)

    def _open_logs(self, cfg: Config, log: bool) -> None:
        """The metrics writer and the completion log; a finished run is left exactly as it is:
        no log is opened, nothing is rewritten."""
        self.writer = MetricsWriter(
            self.run_dir,
            enabled=log and self.leader and not self.finished,
            tensorboard=cfg.logging.tensorboard,
            resume_step=self.step,
            report=self._say,
        )
        # every process writes its own share of a step's completions
        self.completions = CompletionLog(
            self.run_dir,
            cfg.logging,
            seed=cfg.train.seed,
            process=jax.process_index(),
            processes=jax.process_count(),
            resume_step=self.step,
            enabled=log and not self.finished,
            text=self.writer.text if self.writer.enabled else None,
            report=lambda line: print(f"train: {line}", flush=True),
        )

    def sampling_params(self):
        """What the samplers decode now (``RunPrograms.sampling_params``)."""
        return self.programs.sampling_params(self.state)

    @property
    def finished(self) -> bool:
        return self.step >= self.cfg.train.steps

    def _say(self, line: str) -> None:
        if self.leader:
            print(f"train: {line}", flush=True)

    def save(self) -> None:
        """Checkpoint the run at its current step (a collective)."""
        self.completions.flush()  # the rows of the steps it holds are on disk first
        self.run_state.save(self.step, self.state.params, self.state.opt_state)

    # ------------------------------------------------------------------ compilation

    def compile_ahead(self, log=print) -> None:
        """Compile now what the run will run, one line each: every candidate G's rollout, the
        update of every row count its steps can take (packed: each rung of the row ladder up to
        the largest G's rollouts, since the rung follows the step's lengths; padded: the same
        rungs when ``train.drop_no_signal`` leaves rows out, else each G's whole batch), a tail
        step's rollout, and the held-out evaluation.

        Rollouts and padded updates use the prompt bucket of the step's first batch; other
        buckets compile on first use.
        """
        cfg = self.cfg
        first = self.source.batch(self.step, 0, jax.process_count())  # one prompt per process
        width = int(gather_rows(np.array([len(self.source.encode(first[0]))])).max())
        bucket = bucket_length(width, self.shape.buckets)
        new = cfg.sampling.max_new_tokens
        params = self.sampling_params()
        for label, (n, prompts) in self.shape.rollouts.items():
            t0 = time.perf_counter()
            self.sampler.compile(params, n, bucket, max_new_tokens=new, prompts=prompts)
            log(f"compiled {label} ({n} rollouts): rollout {time.perf_counter() - t0:.1f} s")
        rows = sorted({r for n, _ in self.shape.rollouts.values() for r in self._update_rows(n)})
        t0 = time.perf_counter()
        for r in rows:  # shaped and placed as a real batch: rows split over the mesh
            spec = (
                packed_batch_spec(r, self.shape.pack_len, self.plan.rows)
                if cfg.train.packing
                else batch_spec(r, bucket, new, self.plan.rows)
            )
            self.programs.compile_update(self.state, spec, jax.random.key(0))
        seconds = time.perf_counter() - t0
        log(f"compiled the update at {', '.join(map(str, rows))} rows: {seconds:.1f} s")
        # a tail step's rollout: more prompts, the exit test
        for g, (started, keep) in self.shape.tail_rollouts.items():
            t0 = time.perf_counter()
            self.sampler.compile(
                params, started * g, bucket, max_new_tokens=new, prompts=started, keep_groups=keep
            )
            seconds = time.perf_counter() - t0
            log(f"compiled tail step G={g} ({started * g} rollouts): rollout {seconds:.1f} s")
        t0 = time.perf_counter()
        n, prompt_len = heldout_shape(self.eval_sampler, self.source, cfg)
        self.eval_sampler.compile(params, n, prompt_len, max_new_tokens=new, prompts=n)
        log(f"compiled the evaluation ({n} prompts): {time.perf_counter() - t0:.1f} s")

    def _update_rows(self, rollouts: int) -> tuple[int, ...]:
        """The global row counts an update of a step of ``rollouts`` rollouts can have (see
        ``UpdateBatcher``: every process takes the rung the fullest one needs)."""
        processes = jax.process_count()
        local = rollouts // processes
        ladder = row_ladder(self.shape.row_multiple, local)
        if not (self.cfg.train.packing or self.batcher.drops):
            ladder = ladder[-1:]  # one padded row per rollout, every rollout trained
        return tuple(r * processes for r in ladder)

    # ------------------------------------------------------------------ one step

    def train_step(self) -> StepResult:
        """One GRPO/DAPO step, as its stages: choose G (or per-prompt sizes) -> sample (and
        score) -> shape rewards -> advantages -> update batch -> update -> observe. What it
        produced becomes the step's log line through :meth:`record`."""
        clock = {"start": time.perf_counter()}
        prompts = StepPrompts(self.source, self.step)  # fetched and encoded once
        g = agreed_group_size(self.controller, prompts, self.cfg.train.prompts_per_step)
        rollout_key, update_key = jax.random.split(jax.random.fold_in(self.root_key, self.step))
        crash_point("rollout", self.step)
        batch, rounds = sample_step(
            self.sampler,
            self.sampling_params(),
            prompts,
            g,
            rollout_key,
            cfg=self.cfg,
            tail=self.tail,
        )
        clock["sampled"] = time.perf_counter()
        rewards = batch.shaped
        adv, zero_variance_p = self._advantages(rewards, batch.group_sizes)
        trained = self.batcher.trained(adv)
        update_batch = self.batcher(batch, adv, trained)
        clock["packed"] = time.perf_counter()
        crash_point("update", self.step)
        update = self._update(update_batch, update_key, has_signal=self._has_signal(adv))
        clock["updated"] = time.perf_counter()
        ctrl, observation = observe(self.controller, rounds)
        self.step += 1
        clock["end"] = time.perf_counter()
        return StepResult(
            step=self.step,
            group_size=g,
            batch=batch,
            rounds=rounds,
            update_rows=len(update_batch["norm"]),
            trained=trained,
            advantages=adv,
            rewards=rewards,
            zero_variance_p=zero_variance_p,
            update=update,
            controller=ctrl,
            observation=observation,
            clock=clock,
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

    def _has_signal(self, adv: np.ndarray) -> bool:
        """Whether the step's update runs: some rollout of some process has a non-zero
        advantage, or the KL term pulls toward the reference, or ``train.skip_no_signal`` is
        off (a collective: every process calls it and gets the same answer)."""
        if not self.cfg.train.skip_no_signal or not self.programs.settings.zero_advantage_is_inert:
            return True
        return any_process(bool(np.any(adv != 0)))

    def _update(self, update_batch: dict, key: jax.Array, has_signal: bool) -> dict[str, float]:
        """``epochs x minibatches`` optimizer updates; their metrics averaged. A step without
        learning signal (every advantage zero, no KL term: the loss and its gradient are exactly
        0) skips them: no program runs, the weights and optimizer state stay as they are (Adam's
        momentum is not applied either, as optax's ``apply_if_finite`` skips a step), and
        ``no_signal`` counts it."""
        if not has_signal:
            return {"loss": 0.0, "grad_norm": 0.0, "skipped": 0.0, "no_signal": 1.0}
        self.state, upd = self.programs.update(self.state, update_batch, key)
        return {**{k: float(v) for k, v in jax.device_get(upd).items()}, "no_signal": 0.0}

    def step_log(self, result: StepResult) -> StepLog:
        """The step as its hooks see it: its result, its counts over every process and its
        metrics line (``metrics.step_record``; collectives: every process calls this)."""
        counts = step_counts(result)
        compiles = {
            "sampler": self.sampler.num_traces,
            "update": self.programs.compiled_programs()["update"],
        }
        record = step_record(
            result,
            counts,
            self.controller,
            self.tail,
            epochs=self.cfg.train.epochs,
            compiles=compiles,
        )
        return StepLog(result, counts, record)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, num: int | None = None) -> dict[str, float]:
        """Greedy held-out accuracy and mean completion length of the current policy."""
        params = self.sampling_params()
        return evaluate_policy(self.eval_sampler, params, self.source, self.cfg, num)

    # ------------------------------------------------------------------ the run

    def run(self, progress: bool = True, start_eval: dict | None = None) -> dict[str, Any]:
        """Train until ``train.steps``; returns a summary of the run. ``start_eval``: the
        step-0 evaluation's values when another run of the same starting policy, config and
        held-out questions took it already (``compare``); None: this run takes its own."""
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
                self.run_state.last_eval = start_eval or self.evaluate()
            compiled = {"time/compile_s": self.compile_clock.take()}
            self.writer.write(0, {**self.run_state.last_eval, **compiled})
        if cfg.train.compile_ahead:
            with phase("compilation", kept):
                crash_point("compile", self.step)
                self.compile_ahead(log=print if self.leader else lambda _: None)
        bar = None
        if progress and self.leader:
            bar = ProgressBar("train", total_steps, self.step, self._progress_postfix)
        try:
            with StopRequest() as stop:
                hooks = self._hooks(stop, bar)
                hooks.run(self.step, lambda _: self.step_log(self.train_step()))  # advances step
        finally:
            if bar is not None:
                bar.close()
        self.run_state.store.wait()
        return {
            **self.summary(),
            "steps_run": self.step - start_step,
            "interrupted": hooks.stopped,  # the signal that stopped the run, if one did
        }

    def _progress_postfix(self, step: int, log: StepLog) -> dict[str, Any]:
        """What the progress bar shows beside the count: G, the reward, the straggler rate."""
        rate = self.controller.straggler_sum / max(self.controller.step, 1)
        return {
            "G": log.metrics["group_size"],
            "reward": f"{log.metrics['reward']:.2f}",
            "strag": f"{rate:.2f}",
        }

    def summary(self) -> dict[str, Any]:
        """The whole run so far, every segment of it, from ``metrics.jsonl`` (process 0)."""
        steps, evals = read_metrics(self.run_dir) if self.leader else ([], [])
        return summarize(steps, evals)

    def _hooks(self, stop: StopRequest, bar: ProgressBar | None) -> Hooks:
        """What runs after each step, in order: evaluation, the log line, the completions, the
        progress bar, the spike check, the reward-stall notice, the divergence check, sealing
        finished checkpoints, saving one (and stopping) when due."""
        t = self.cfg.train
        hooks = Hooks(t.steps)
        spikes = SpikeGuard(t.spike_factor, t.spike_window, report=self._say)
        hooks.add(Evaluation(self.evaluate, self.run_state), every=t.eval_every)
        hooks.add(
            lambda step, log: self.writer.write(
                step,
                {**log.metrics, "time/compile_s": self.compile_clock.take()},
                self.controller.candidates,
            )
        )
        hooks.add(self.completions, every=self.cfg.logging.completions_every)
        if bar is not None:
            hooks.add(bar)
        hooks.add(spikes)
        hooks.add(
            RewardStallNotice(self.cfg.data.reward, self.cfg.data.reward_timeout_s, self._say)
        )
        hooks.add(DivergenceCheck(t.max_nonfinite_steps, self.run_state, spikes))
        hooks.add(Checkpointing(t, self.run_state, self.save, spikes, stop, hooks))
        return hooks

    def close(self) -> None:
        try:
            self.completions.close()  # before the writer: its TensorBoard text goes through it
            self.run_state.store.close()
            self.writer.close()
        finally:
            self.lock.release()
