"""Parallel layouts of the torch backend beyond 1-D FSDP2."""
