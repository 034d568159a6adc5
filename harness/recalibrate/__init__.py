"""Recalibration: new thresholds and perf baselines proposed from N gate results, shown as a diff, written on request."""

from harness.recalibrate.perf import (
    PERF_PROPOSAL_HEADER,
    NoiseRefused,
    PerfProposal,
    apply_perf_proposals,
    merge_into_perf_overlay,
    perf_proposal_rows,
    propose_perf,
    refuse_inside_noise,
)
from harness.recalibrate.policy import DEFAULT_POLICY, Policy, Rule, load_policy
from harness.recalibrate.proposals import MIN_RUNS, FailedRunsRefused, LooseningRefused, check_runs, refuse_loosening
from harness.recalibrate.thresholds import (
    PROPOSAL_HEADER,
    Proposal,
    apply_proposals,
    merge_into_overlay,
    proposal_rows,
    propose_thresholds,
)

__all__ = [
    "DEFAULT_POLICY",
    "MIN_RUNS",
    "PERF_PROPOSAL_HEADER",
    "PROPOSAL_HEADER",
    "FailedRunsRefused",
    "LooseningRefused",
    "NoiseRefused",
    "PerfProposal",
    "Policy",
    "Proposal",
    "refuse_inside_noise",
    "Rule",
    "apply_perf_proposals",
    "apply_proposals",
    "check_runs",
    "load_policy",
    "merge_into_overlay",
    "merge_into_perf_overlay",
    "perf_proposal_rows",
    "proposal_rows",
    "propose_perf",
    "propose_thresholds",
    "refuse_loosening",
]
