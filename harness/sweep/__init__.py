"""Hardware-matrix sweeps (contracts × backend × dtype × world size on one machine) and their merged matrix."""

from harness.sweep.sweep import BackendColumn, SweepOptions, default_backends, expand_matrix, run_sweep

__all__ = ["BackendColumn", "SweepOptions", "default_backends", "expand_matrix", "run_sweep"]
