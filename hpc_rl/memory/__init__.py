"""The plan-time memory model (docs/memory.md): a model's shape (shape.py) and each role's bytes
per GPU from it and the role's settings (model.py). Pure arithmetic: no torch, no config; the
config side is hpc_rl/config/memory_inputs.py."""
