"""Experiment analysis over finished (or running) runs: ``compare`` trains controllers side by
side, ``study`` holds the statistics and plots across seeds, ``report`` one run's plots. The
trainer does not import this package."""
