"""Run safety: what keeps a run's work when something goes wrong. ``run_state`` (what an RL
run's checkpoints hold, saving one and the rules for resuming from one), ``checkpoint`` (sealed,
verified Orbax checkpoints, rotation, the disk-space checks), ``disk`` (free space, sizes,
whether an error was a full disk), ``runlock`` (one writer per run directory), ``preflight``
(room on the disk for a checkpoint, checked before anything is compiled; the devices' memory is
checked where the run is resolved, ``planning.resolve``), ``faults`` (stop signals, the one-line
messages of a phase that failed, fault injection for tests)."""
