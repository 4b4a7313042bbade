"""The per-rank side: identity from the launcher's environment, rendezvous, process groups."""
