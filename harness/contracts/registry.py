"""The contract registry: named checks with declared parameters, requirements and a bound.

A contract's ``body(ctx, params)`` runs on every rank of a live group (module-level, so the
rank pool can pickle a reference to it) and returns a :class:`RankOutcome`; :meth:`Contract.judge`
merges the ranks' outcomes into one :class:`~harness.results.CaseResult`. Adding a contract::

    register(Contract(
        id="usp.my_check", description="...",
        params=PARALLEL + SHAPE + NUMERIC + (Param("extra", "int", 3),),
        body=my_body,                        # (RankContext, Params) -> RankOutcome
        requires=frozenset({"ulysses"}),     # capabilities the target must declare
        bound=lambda p: Bitwise(),           # or AbsBound / FlashAttentionRule / AllChecks
    ))
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.contracts import collectives
from harness.contracts.bounds import AllChecks, Bound, FlashAttentionRule, judge
from harness.contracts.params import Param, ParamError, Params, check_common, resolve
from harness.contracts.stats import RankOutcome, Stats
from harness.results import FAILED, PASSED, SKIPPED, CaseResult, Status
from harness.targets.base import Attention, AttentionSpec, Target
from harness.targets.interface import checked_attention


@dataclass
class RankContext:
    """What a contract body gets inside a rank: the target, this rank's place and device; ``collectives``: what
    the layer's calls under sequence parallelism exchanged (:mod:`.collectives`)."""

    target: Target
    rank: int
    world_size: int
    device: torch.device
    collectives: Counter[str] = field(default_factory=Counter)

    @contextmanager
    def parallel(self, ulysses_degree: int, ring_degree: int) -> Iterator[None]:
        """Sequence parallelism for the block; the runner also destroys it after every case."""
        self.target.init_parallel(ulysses_degree, ring_degree)
        try:
            with collectives.recording(self.collectives):
                yield
        finally:
            self.target.destroy_parallel()

    def spec(self, params: Params, **changes: Any) -> AttentionSpec:
        """The AttentionSpec the standard shape/numeric parameters describe."""
        spec = AttentionSpec(
            num_heads=params.heads,
            head_dim=params.head_dim,
            num_kv_heads=params.kv_heads,
            causal=params.get("causal", False),
            dtype=params.torch_dtype,
            backend=params.get("backend"),
            sdpa_kernel=params.get("sdpa_kernel"),
        )
        return spec.with_(**changes)

    def attention(self, params: Params, **changes: Any) -> Attention:
        return collectives.Counted(checked_attention(self.target.make_attention(self.spec(params, **changes)), self.target))  # type: ignore[return-value]

    def randn(self, params: Params, tokens: int, heads: int, seed: int) -> torch.Tensor:
        """Seeded on the CPU (identical on every rank and device), rounded to the dtype, then moved."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(params.batch, tokens, heads, params.head_dim, generator=gen).to(self.device, params.torch_dtype)


Body = Callable[[RankContext, Params], RankOutcome]
_REPLICATED_KINDS = frozenset({"replicated_prefix", "replicated_suffix", "replicated_kv_prefix"})


@dataclass(frozen=True)
class Contract:
    id: str
    description: str
    params: tuple[Param, ...]
    body: Body
    requires: frozenset[str] = frozenset()
    bound: Callable[[Params], Bound] = field(default=lambda p: AllChecks())
    checks: tuple[Callable[[Params], None], ...] = ()
    min_world_size: int = 1
    timeout_s: float = 120.0

    def resolve(self, raw: Mapping[str, Any]) -> Params:
        """Validated parameters, or ParamError naming the key."""
        params = resolve(self.params, raw, (check_common, self._check_world, *self.checks))
        if "bound" in params:
            try:
                self.bound(params)
            except ValueError as exc:
                raise ParamError("bound", str(exc)) from None
        return params

    def _check_world(self, params: Params) -> None:
        if params.get("world_size", 1) < self.min_world_size:
            raise ParamError("world_size", f"{self.id} needs world_size >= {self.min_world_size}")

    def requirements(self, params: Params) -> frozenset[str]:
        """Declared capabilities plus those the parameters imply (GQA, causal, ring, a named backend)."""
        needed = set(self.requires)
        if params.get("kv_heads", params.get("heads")) != params.get("heads"):
            needed.add("gqa")
        if params.get("causal"):
            needed.add("causal")
        if params.get("ring_degree", 1) > 1:
            needed.add("ring")
            if params.get("mask"):
                needed.add("ring_mask")
            if needed & _REPLICATED_KINDS:
                needed.add("ring_replicated")
        # Sharded contracts without explicit degrees (replicated, varlen, masks) are Ulysses over W.
        ulysses = params.get("ulysses_degree", params.get("world_size", 1) if "tokens_per_rank" in params else 1)
        if ulysses > 1:
            needed.add("ulysses")
        if params.get("backend") or params.get("sdpa_kernel"):
            needed.add("backend_choice")
        return frozenset(needed)

    def result(self, case_id: str, params: Params, status: Status, reason: str | None, target: str, **fields: Any) -> CaseResult:
        """A result of this contract for ``case_id`` (its bound described from ``params``)."""
        return CaseResult(case_id, self.id, status, reason, bound=self.bound(params).describe(), params=dict(params),
                          target=target, **fields)

    def judge(self, case_id: str, params: Params, outcomes: Sequence[RankOutcome], duration_s: float, target: str) -> CaseResult:
        """Merge every rank's outcome into the case's result."""
        bound = self.bound(params)
        kernel = next((o.kernel for o in outcomes if o.kernel), None)

        def verdict(status: Status, reason: str | None, figures: dict[str, Any]) -> CaseResult:
            return self.result(case_id, params, status, reason, target, figures=figures, kernel=kernel, duration_s=duration_s)

        # A rank that raised never answers here: the launcher ended the group and the runner reported it.
        skips = {o.skip for o in outcomes if o.skip}
        if skips:
            if len(skips) == 1 and all(o.skip for o in outcomes):
                return verdict(SKIPPED, skips.pop(), {})
            return verdict(FAILED, f"ranks disagree on whether this case can run: {sorted(skips)}", {})
        problems = _merge_problems([o.problems for o in outcomes])
        figures: dict[str, Any] = {}
        stats_list = [o.stats for o in outcomes if o.stats is not None]
        reason = None
        if stats_list:
            stats = functools.reduce(Stats.merge, stats_list)
            figures.update(stats.figures())
            if isinstance(bound, FlashAttentionRule) and stats.naive_err_ref64 is not None:
                figures["allowed"] = bound.allowed(stats)
            reason = judge(bound, stats)
        if any(o.parts for o in outcomes):
            part_reasons, part_figures = _judge_parts(bound, outcomes)
            figures.update(part_figures)
            reason = "; ".join(([reason] if reason else []) + part_reasons) or None
        problems += _not_alike(outcomes)
        if outcomes and outcomes[0].checks:
            figures["checks"] = outcomes[0].checks
            figures["failed_checks"] = len(problems)
        if outcomes:  # extra figures are global (every rank computes the same), rank 0 speaks for all
            figures.update(outcomes[0].extra)
        if any(o.oracle for o in outcomes):
            oracle_problems, figures["oracle"] = _judge_oracle(params, outcomes, bound)
            problems += oracle_problems
        if problems:  # the case's own bound speaks first, then the checks and the oracle
            reason = "; ".join(([reason] if reason else []) + problems)
        return verdict(FAILED if reason else PASSED, reason, figures)


_OUTPUTS = {"sharded": "sharded output", "single-rank": "single-rank output"}  # the forward contracts' oracle names


def _judge_oracle(params: Params, outcomes: Sequence[RankOutcome], bound: Bound) -> tuple[list[str], dict[str, Any]]:
    """Each output's distance to float64 attention, merged over ranks and judged by the case's ``oracle`` rule.

    Where the case's own bound is that same rule, it has judged the sharded output against float64
    already: that failure is not said twice (only the oracle's hint about it is added)."""
    from harness.contracts.outputs import oracle_rule

    rule = oracle_rule(params)
    problems: list[str] = []
    figures: dict[str, Any] = {"bound": rule.describe()}
    for name, merged in _merged([o.oracle for o in outcomes]).items():
        figures[name] = {"err_ref64": merged.err_ref64, "naive_err_ref64": merged.naive_err_ref64,
                         "allowed": rule.allowed(merged)}
        reason = judge(rule, merged)
        if reason:
            hints = sorted({o.hints[name] for o in outcomes if name in o.hints})
            label = _OUTPUTS.get(name, name)
            if name.startswith("sharded") and bound == rule:
                problems += [f"{label}: {'; '.join(hints)}"] if hints else []
            else:
                problems.append(f"{label} vs float64 attention: {reason}" + (f" ({'; '.join(hints)})" if hints else ""))
    return problems, figures


def _merged(per_rank: Sequence[Mapping[str, Stats]]) -> dict[str, Stats]:
    """Each name's Stats merged over the ranks that report it, in first-seen order."""
    merged: dict[str, Stats] = {}
    for named in per_rank:
        for name, stats in named.items():
            merged[name] = merged[name].merge(stats) if name in merged else stats
    return merged


def _judge_parts(bound: Bound, outcomes: Sequence[RankOutcome]) -> tuple[list[str], dict[str, Any]]:
    """Every named comparison (dq, dk, dv) judged by the case's bound on its own, and the worst of them as the
    headline figures (bitwise: all of them; max_abs: the largest)."""
    parts = _merged([o.parts for o in outcomes])
    reasons, figures = [], {}
    for name, stats in parts.items():
        figures[name] = stats.figures()
        if isinstance(bound, FlashAttentionRule) and stats.naive_err_ref64 is not None:
            figures[name]["allowed"] = bound.allowed(stats)
        reason = judge(bound, stats)
        if reason:
            reasons.append(f"{name}: {reason}")
    worst = functools.reduce(Stats.merge, parts.values())
    figures.update({k: v for k, v in worst.figures().items() if k in ("bitwise", "max_abs", "mean_abs", "elements")})
    return reasons, figures


def _not_alike(outcomes: Sequence[RankOutcome]) -> list[str]:
    """What every rank must hold alike (replicated outputs and gradients), compared by digest."""
    problems = []
    for name in dict.fromkeys(n for o in outcomes for n in o.replicated):
        differ = [rank for rank, o in enumerate(outcomes) if o.replicated.get(name) != outcomes[0].replicated.get(name)]
        if differ:
            problems.append(f"the replicated {name} is not the same on every rank: rank{'s' if len(differ) > 1 else ''} "
                            f"{', '.join(map(str, differ))} differ{'' if len(differ) > 1 else 's'} from rank 0")
    return problems


def _merge_problems(per_rank: Sequence[Sequence[str]]) -> list[str]:
    """A problem every rank reports is said once; others are attributed to their rank."""
    everyone = set(per_rank[0]).intersection(*per_rank[1:]) if per_rank else set()
    merged = [f"every rank: {p}" if len(per_rank) > 1 else p for p in per_rank[0] if p in everyone] if per_rank else []
    for rank, problems in enumerate(per_rank):
        merged += [f"rank {rank}: {p}" for p in problems if p not in everyone]
    return merged


_REGISTRY: dict[str, Contract] = {}


def register(contract: Contract) -> Contract:
    if contract.id in _REGISTRY and _REGISTRY[contract.id] is not contract:
        raise ValueError(f"contract {contract.id!r} is registered twice")
    _REGISTRY[contract.id] = contract
    return contract


def get_contract(contract_id: str) -> Contract:
    try:
        return _REGISTRY[contract_id]
    except KeyError:
        raise KeyError(f"unknown contract {contract_id!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def all_contracts() -> list[Contract]:
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]
