"""Timing pipelines: BASE and HEAD side by side with a statistical verdict (``ab``), or raw runs against a stored baseline (``absolute``)."""
