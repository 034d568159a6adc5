"""Named parity contracts: checks with parameters, run on every rank, judged into a CaseResult with figures.

Importing this package registers every built-in contract: ``usp.*`` (outputs and gradients), ``backend.*``, the
model-level ``model.*`` / ``encoder.*`` / ``vae.*`` and the pipeline-level ``pipeline.*``.
Nothing here imports an implementation: contracts reach one through ``harness.targets``.
"""

from harness.contracts import backend, model_checks, models, perf, pipeline, usp, usp_grad, usp_guards  # noqa: F401  (registration)
from harness.contracts.case import Case, make_case, with_overrides
from harness.contracts.judging import RankOutcome
from harness.contracts.registry import Contract, RankContext, all_contracts, get_contract, register
from harness.contracts.stats import Stats, compare

__all__ = [
    "Case",
    "Contract",
    "RankContext",
    "RankOutcome",
    "Stats",
    "all_contracts",
    "compare",
    "get_contract",
    "make_case",
    "register",
    "with_overrides",
]
