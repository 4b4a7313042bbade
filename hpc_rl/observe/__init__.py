"""What a run shows its people: one naming of the metrics (metrics.py), the experiment
loggers (loggers.py), PNG plots (plots.py), per-rank phase timing and the live view."""
