"""hpc_rl: Slurm-native RL post-training and multi-teacher on-policy distillation for LLMs."""

__version__ = "0.1.0"
