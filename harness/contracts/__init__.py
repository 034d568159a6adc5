"""Named parity contracts: checks with parameters that return a verdict with figures."""
