"""The Megatron-core training backend (GPU only) and what it needs on any machine: the
config mapping, the Hugging Face <-> Megatron conversion, Megatron's sharding and the refit
layouts it implies. Only backend.py imports megatron, and only when the backend is built."""
