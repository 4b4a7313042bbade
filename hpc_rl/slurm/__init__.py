"""Slurm: het sbatch rendering, the submitit-based executor, job watching, preflight checks."""
