"""Trainer and teacher parallelism on torch.distributed: the mesh (mesh.py), DTensor tensor
and sequence parallel by each family's plan (tensor_parallel.py, models/families/), vocab-parallel log-probs
(vocab_logprobs.py), context parallel (context_parallel.py), expert parallel for MoE
students (expert_parallel.py, expert_names.py) and the refit source layout read from the
live shards (shards.py)."""
