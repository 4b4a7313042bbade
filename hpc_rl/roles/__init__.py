"""One module per role of the job. Each owns its backend or engine and, except the
trainer (whose ranks run the orchestration in hpc_rl/rl/loop.py), serves the messages its
producers send until told to stop."""
