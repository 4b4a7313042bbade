"""Pipelines: stages (each one het job, composed from a recipe) run as dependent Slurm jobs.

spec.py (the pipeline file, the DAG), compose.py (every stage composed and checked at once,
the ${stage:NAME} resolver), submit.py (afterok chains, resume), state.py (pipeline.json,
stage states), report.py (the status table), render.py (hand submission, the plan file),
cli.py (python -m hpc_rl.pipeline and python -m hpc_rl.launch +pipeline=NAME).
"""
