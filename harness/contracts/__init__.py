"""Named parity contracts: checks with parameters that return a verdict with figures.

Importing this package registers every built-in contract: ``usp.*``, ``backend.*`` and the
model-level ``model.*`` / ``encoder.*`` / ``vae.*`` and the pipeline-level ``pipeline.*``.
"""

from harness.contracts import backend, models, pipeline, usp, usp_masked_prefix  # noqa: F401  (registration)
from harness.contracts.registry import Contract, RankContext, all_contracts, get_contract, register
from harness.contracts.verdict import FAILED, PASSED, SKIPPED, RankOutcome, Stats, Verdict, compare

__all__ = [
    "FAILED",
    "PASSED",
    "SKIPPED",
    "Contract",
    "RankContext",
    "RankOutcome",
    "Stats",
    "Verdict",
    "all_contracts",
    "compare",
    "get_contract",
    "register",
]
