"""parity harness: launcher, contracts, metrics, baselines, gate, recalibration, sweep, CLI."""
