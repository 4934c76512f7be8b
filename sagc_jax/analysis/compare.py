"""``sagc-jax compare``: the same task, warm start, seeds and step budget under each controller,
one run after the other on the same machine, summarised with 95% confidence intervals over seeds
and paired differences (``analysis.study``)."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from sagc_jax.analysis.records import (
    RecordError,
    check_record,
    make_record,
    note_segment,
    read_record,
    read_segments,
    run_name,
    write_record,
)
from sagc_jax.analysis.study import (
    CALIBRATION,
    DOMINANCE_REGIME,
    MEASURES,
    MODELED,
    format_accuracy_over_evals,
    format_dominance,
    format_paired,
    format_rows,
    plot_study,
    study,
)
from sagc_jax.config import Config, from_dict, to_dict
from sagc_jax.controller.registry import CONTROLLERS, parse_controller_spec
from sagc_jax.planning.timing import step_timer
from sagc_jax.tasks.source import data_identity
from sagc_jax.train.loop import Trainer
from sagc_jax.train.lora_base import base_identity
from sagc_jax.train.metrics import read_metrics
from sagc_jax.train.safety.faults import Interrupted, phase, resume_hint


def run_config(cfg: Config, spec: str, seed: int, steps: int | None) -> Config:
    """``cfg`` with the controller of ``spec``, seed offset ``seed`` and the step budget."""
    kind, arg = parse_controller_spec(spec)
    data = to_dict(cfg)
    data["controller"]["kind"] = kind
    CONTROLLERS[kind].configure(data["controller"], arg)
    for own in (e.seeded for e in CONTROLLERS.values() if e.seeded):  # a random generator's
        data["controller"][own]["seed"] = getattr(cfg.controller, own).seed + seed
    data["train"]["seed"] = cfg.train.seed + seed
    if steps is not None:
        data["train"]["steps"] = steps
    return from_dict(data)


def compare(
    cfg: Config,
    controllers: list[str],
    seeds: int,
    steps: int | None,
    out_dir: Path,
    progress: bool = True,
    log=print,
    also_hardware: tuple[str, ...] = (),
    records: Path | None = None,
    from_records: bool = False,
) -> dict:
    """Run every (controller, seed); return the study (``study.study``: per-run measures,
    per-controller rows with 95% CIs, paired differences of each adaptive controller against
    the controllers before it), and under ``"also"`` the same study timed on each of
    ``also_hardware`` (``sim.hardware`` names) besides the config's own.

    Seed by seed, every controller in turn: a drift of the machine's speed over the study then
    falls on every controller alike rather than on the ones that ran last. The step-0
    evaluation (the starting policy's) is the same for every run: the first run takes it, the
    others reuse it (their step-0 line names the run it came from, ``eval_from``).

    Runs already in ``out_dir`` resume (or, finished, are only read). A stop signal ends the
    comparison (``Interrupted``): the run in progress saves a checkpoint when it is in its step
    loop, and the same command later continues from there.

    ``records``: a folder of run records (``analysis.records``): a run whose record is there is
    not run again (the record is checked against the study's config and read), and each run
    that finishes writes its record there. ``from_records``: train nothing; every run's record
    must be there.
    """
    names = [(spec, seed, run_name(spec, seed)) for seed in range(seeds) for spec in controllers]
    if from_records:
        if records is None:
            raise ValueError("from_records needs the records' folder")
        missing = [records / f"{name}.json" for *_, name in names]
        missing = [p for p in missing if not p.is_file()]
        if missing:
            raise RecordError(
                f"{missing[0]}: missing ({len(names) - len(missing)} of {len(names)} runs "
                "recorded); run the study without --from-records to make the runs not recorded"
            )
    per_run, made, resolved_cfgs = {}, {}, {}
    hint = resume_hint(cfg, out_dir)
    start_eval = None  # the step-0 evaluation, taken by the first run, reused by the others
    for spec, seed, name in names:
        given = run_config(cfg, spec, seed, steps)
        path = records / f"{name}.json" if records is not None else None
        if path is not None and path.is_file():
            record = read_record(path)
            # the weights are not on a machine that only reads the records
            check_record(record, given, path, None if from_records else weights_identity(given))
            log(f"compare: {spec}, seed {seed}: recorded in {path}, not run again")
        else:
            record = None
            run_dir = out_dir / name
            resolved = _train(given, run_dir, spec, seed, out_dir, hint, progress, log, start_eval)
            resolved_cfgs[(spec, seed)] = resolved
            steps_logged, evals = read_metrics(run_dir)
            if path is not None:
                record = make_record(
                    name,
                    spec,
                    seed,
                    given,
                    resolved,
                    steps_logged,
                    evals,
                    segments=read_segments(run_dir),
                    weights=weights_identity(given),
                    data=data_identity(given),
                )
                write_record(path, record)
                log(f"compare: {spec}, seed {seed}: wrote its record {path}")
        if record is not None:
            steps_logged, evals = record["steps"], record["evals"]
            made[(spec, seed)] = record
        per_run[(spec, seed)] = (steps_logged, evals)
        if start_eval is None and evals and int(evals[0]["step"]) == 0:
            start_eval = {k: v for k, v in evals[0].items() if k.startswith("eval/")}
            start_eval.setdefault("eval_from", name)
    first = names[0][:2]
    with timing_config(cfg, made.get(first), resolved_cfgs.get(first)) as timed_cfg:
        result = _study(per_run, controllers, seeds, timed_cfg, also_hardware)
        c = cfg.controller
        plot_study(
            per_run,
            controllers,
            seeds,
            result["timer"],
            out_dir,
            candidates=c.candidates,
            delta=c.delta,
        )
    del result["timer"]
    write_tables(result, out_dir)
    return result


def _train(
    given: Config,
    run_dir: Path,
    spec: str,
    seed: int,
    out_dir: Path,
    hint: str,
    progress: bool,
    log,
    start_eval: dict | None,
) -> Config:
    """Run (or resume, or only open when finished) one run of the study; its config as
    resolved. A stop signal ends it with ``Interrupted`` once its checkpoint is saved."""
    what = f"the {spec} run (seed {seed})"
    with phase(what, f"finished runs are kept in {out_dir}; {hint}"):
        with phase("start-up"):
            trainer = Trainer(given, run_dir)
        try:
            done = "already done, " if trainer.finished else ""
            resumed = f"resuming from step {trainer.step}, " if trainer.step else ""
            log(f"compare: {spec}, seed {seed}: {done or resumed}{run_dir}")
            summary = {}
            if not trainer.finished:
                if trainer.leader:
                    note_segment(run_dir, trainer.step)
                summary = trainer.run(progress=progress, start_eval=start_eval)
        finally:
            trainer.close()
        if summary.get("interrupted"):
            raise Interrupted(
                getattr(signal, summary["interrupted"]),
                f"{what}, after step {summary['steps']}",
                f"its checkpoint is saved in {run_dir}; {hint}",
            )
    return trainer.cfg  # as resolved: "auto" buckets the data's


def weights_identity(cfg: Config) -> dict:
    """The starting weights' identity (``base_identity``) without their path on this machine."""
    return {
        k: v for k, v in base_identity(cfg).items() if k not in ("hf_checkpoint", "init_checkpoint")
    }


@contextlib.contextmanager
def timing_config(cfg: Config, record: dict | None, resolved: Config | None) -> Iterator[Config]:
    """The config the study's step-time model reads: the first run's as resolved ("auto" made
    concrete: ``resolved``, or its ``record``'s), with the study's own ``sim`` section. From a
    record on a machine without the HF model, the model's config.json comes from the record
    (``sim.model`` points at a copy named as the checkpoint, so that tables label it alike)."""
    if record is None:
        yield dataclasses.replace(resolved, sim=cfg.sim)
        return
    resolved = dataclasses.replace(from_dict(record["resolved"]), sim=cfg.sim)
    model = record["model"]
    checkpoint = resolved.model.hf_checkpoint
    if resolved.sim.model or model is None or (checkpoint and Path(checkpoint).is_dir()):
        yield resolved
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / model["name"]
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(model["config"]))
        yield dataclasses.replace(
            resolved, sim=dataclasses.replace(resolved.sim, model=str(folder))
        )


def _study(per_run, controllers, seeds, timed_cfg: Config, also_hardware) -> dict:
    """``study.study`` of the runs timed by ``timed_cfg``'s step-time model, and under "also"
    by each of ``also_hardware``'s; the timer under "timer"."""
    length = max(timed_cfg.sampling.prompt_buckets) + timed_cfg.sampling.max_new_tokens
    timer = step_timer(timed_cfg, length)
    result = study(per_run, controllers, seeds, timer)
    result["also"] = []
    for hw in also_hardware:
        sim = dataclasses.replace(timed_cfg.sim, hardware=hw)
        also_timer = step_timer(dataclasses.replace(timed_cfg, sim=sim), length)
        result["also"].append(study(per_run, controllers, seeds, also_timer))
    result["timer"] = timer
    return result


def format_tables(result: dict) -> str:
    """The study as markdown: the per-controller table, then the paired differences."""
    timed = result["timed"]
    text = (
        f"Mean over seeds ± 95% CI (Student t). Time to target: until held-out accuracy first "
        f"reaches {result['target']:.3f} (90% of the best fixed G's mean final accuracy). "
        f"Modeled: the logged lengths re-timed as {timed} (sim section) in three rollout "
        "regimes: compacting (this sampler: finished rows leave the batch, slots refill), "
        "synchronous (every row until the longest ends) and continuous batching (vLLM-style)."
        "\n\n" + format_rows(result["rows"], timed=timed)
    )
    if result["paired"]:
        text += "\n\nPaired differences on the same seeds (± 95% CI; x: ratio of the means):\n\n"
        text += format_paired(result["paired"], timed)
    if len(result["dominance"]) > 1:
        text += (
            "\n\nDominance: the controllers that reach a higher final held-out accuracy in less "
            f"modeled time ({timed}, {DOMINANCE_REGIME}), by the means and by paired differences "
            "on the same seeds; a controller no other dominates by the means is on the frontier:"
            "\n\n" + format_dominance(result["dominance"])
        )
    if result["accuracy_over_evals"]:
        text += (
            "\n\nHeld-out accuracy at each evaluation, the questions right over every seed "
            "[Wilson 95% interval] (right/asked):\n\n"
        )
        text += format_accuracy_over_evals(result["accuracy_over_evals"])
    modeled = [m for m in MEASURES if m[0] in MODELED]
    for also in result.get("also", []):
        text += f"\n\nThe same runs timed as {also['timed']}:\n\n"
        text += format_rows(also["rows"], modeled, timed=also["timed"])
        if also["paired"]:
            text += "\n\n" + format_paired(also["paired"], also["timed"], modeled_only=True)
    if result["calibration"]:
        text += (
            "\n\nThe prompt-aware controllers' straggle prediction: the share of each step's "
            "groups predicted to straggle (before sampling) and seen to, averaged over steps, "
            "and the final running calibration over every group (± 95% CI):\n\n"
        )
        text += format_rows(result["calibration"], CALIBRATION)
    return text


def write_tables(result: dict, out_dir: Path) -> None:
    """compare.md (the tables), compare.csv (one row per controller), runs.csv (one per run)."""
    (out_dir / "compare.md").write_text(format_tables(result) + "\n")
    _write_csv(out_dir / "compare.csv", result["rows"])
    _write_csv(
        out_dir / "runs.csv",
        [{"controller": c, "seed": s, **m} for (c, s), m in result["runs"].items()],
    )


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
