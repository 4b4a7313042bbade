"""Launchers: hand a planned run to processes on this machine or to Slurm."""
