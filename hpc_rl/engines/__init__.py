"""Inference engines the generator role samples with (`generator.backend`)."""
