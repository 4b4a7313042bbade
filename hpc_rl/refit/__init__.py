"""Refit: moving trainer weights into the generators' vLLM engines."""
