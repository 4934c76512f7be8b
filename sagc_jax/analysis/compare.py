"""``sagc-jax compare``: the same task, warm start, seeds and step budget under each controller,
one run after the other on the same machine, summarised with 95% confidence intervals over seeds
and paired differences (``analysis.study``)."""

from __future__ import annotations

import csv
import dataclasses
import signal
from pathlib import Path

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
from sagc_jax.config import Config, from_dict, parse_controller_spec, to_dict
from sagc_jax.controller.registry import CONTROLLERS
from sagc_jax.planning.timing import step_timer
from sagc_jax.train.loop import Trainer
from sagc_jax.train.metrics import read_metrics
from sagc_jax.train.safety.faults import Interrupted, phase, resume_hint


def run_config(cfg: Config, spec: str, seed: int, steps: int | None) -> Config:
    """``cfg`` with the controller of ``spec``, seed offset ``seed`` and the step budget."""
    kind, arg = parse_controller_spec(spec)
    data = to_dict(cfg)
    data["controller"]["kind"] = kind
    if kind == "fixed":
        data["controller"]["group_size"] = arg
    elif kind == "hybrid" and arg is not None:
        data["controller"]["hybrid"]["mode"] = arg
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
) -> dict:
    """Run every (controller, seed); return the study (``study.study``: per-run measures,
    per-controller rows with 95% CIs, paired differences of each adaptive controller against
    the controllers before it), and under ``"also"`` the same study timed on each of
    ``also_hardware`` (``sim.hardware`` names) besides the config's own.

    Seed by seed, every controller in turn: a drift of the machine's speed over the study then
    falls on every controller alike rather than on the ones that ran last.

    Runs already in ``out_dir`` resume (or, finished, are only read). A stop signal ends the
    comparison (``Interrupted``): the run in progress saves a checkpoint when it is in its step
    loop, and the same command later continues from there.
    """
    per_run = {}
    hint = resume_hint(cfg, out_dir)
    for seed in range(seeds):
        for spec in controllers:
            name = f"{spec.replace(':', '')}-seed{seed}"
            run_dir = out_dir / name
            what = f"the {spec} run (seed {seed})"
            with phase(what, f"finished runs are kept in {out_dir}; {hint}"):
                with phase("start-up"):
                    trainer = Trainer(run_config(cfg, spec, seed, steps), run_dir)
                timed_cfg = trainer.cfg  # as resolved: "auto" buckets the data's
                try:
                    done = "already done, " if trainer.finished else ""
                    resumed = f"resuming from step {trainer.step}, " if trainer.step else ""
                    log(f"compare: {spec}, seed {seed}: {done or resumed}{run_dir}")
                    summary = {} if trainer.finished else trainer.run(progress=progress)
                finally:
                    trainer.close()
                if summary.get("interrupted"):
                    raise Interrupted(
                        getattr(signal, summary["interrupted"]),
                        f"{what}, after step {summary['steps']}",
                        f"its checkpoint is saved in {run_dir}; {hint}",
                    )
            per_run[(spec, seed)] = read_metrics(run_dir)
    length = max(timed_cfg.sampling.prompt_buckets) + cfg.sampling.max_new_tokens
    timer = step_timer(timed_cfg, length)
    result = study(per_run, controllers, seeds, timer)
    result["also"] = []
    for hw in also_hardware:
        sim = dataclasses.replace(timed_cfg.sim, hardware=hw)
        also_timer = step_timer(dataclasses.replace(timed_cfg, sim=sim), length)
        result["also"].append(study(per_run, controllers, seeds, also_timer))
    c = cfg.controller
    plot_study(per_run, controllers, seeds, timer, out_dir, candidates=c.candidates, delta=c.delta)
    write_tables(result, out_dir)
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
