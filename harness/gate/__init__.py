"""The CI gate: stages (contracts, images, perf) run in shared rank pools, judged into one results document."""

from harness.gate.run import run_gate, stages
from harness.gate.stage import GateContext, GateOptions, PerfOptions, Stage

__all__ = ["GateContext", "GateOptions", "PerfOptions", "Stage", "run_gate", "stages"]
