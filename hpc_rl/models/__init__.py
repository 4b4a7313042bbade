"""Training/inference backends and the tiny model assets built on this machine."""
