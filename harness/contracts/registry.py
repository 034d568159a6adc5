"""The contract registry: named checks with declared parameters, requirements and a bound.

A contract's ``body(ctx, params)`` runs on every rank (module-level, so the rank pool can pickle a
reference to it) and returns a :class:`RankOutcome`; :meth:`Contract.judge` merges the ranks'
outcomes into one :class:`~harness.results.CaseResult` (:mod:`.judging`). Adding one::

    register(Contract(id="usp.my_check", description="...", params=PARALLEL + SHAPE + NUMERIC,
                      body=my_body, requires=frozenset({Capability.ULYSSES}), bound=lambda p: Bitwise()))
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.contracts import collectives
from harness.contracts.bounds import AllChecks, Bound, FlashAttentionRule
from harness.contracts.judging import RankOutcome, verdict
from harness.contracts.memory import Footprint
from harness.contracts.params import Param, ParamError, Params, check_common, complete_tokens, resolve
from harness.results import CaseResult, Status
from harness.targets.base import Attention, AttentionSpec, Capability, Target, Unsupported
from harness.targets.interface import checked_attention


@dataclass
class RankContext:
    """What a contract body gets inside a rank: the target, this rank's place and device, the case's bound;
    ``collectives``: what the layer's calls under sequence parallelism exchanged (:mod:`.collectives`)."""

    target: Target
    rank: int
    world_size: int
    device: torch.device
    bound: Bound  # the contract's bound of this case: a body compares with float64 only where it needs it
    collectives: Counter[str] = field(default_factory=Counter)
    deterministic: bool = False  # the case asked for torch's deterministic algorithms in the target's computation

    @contextmanager
    def kernels(self) -> Iterator[None]:
        """The target's own computation (a call, a backward), under torch's deterministic algorithms where the
        case asked (:func:`deterministic_algorithms`); the oracles run outside it, as they are."""
        with deterministic_algorithms() if self.deterministic else nullcontext():
            yield

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
            softmax_scale=params.get("softmax_scale"),
            dtype=params.torch_dtype,
            backend=params.get("backend"),
            sdpa_kernel=params.get("sdpa_kernel"),
        )
        return spec.with_(**changes)

    def attention(self, params: Params, **changes: Any) -> Attention:
        attention = checked_attention(self.target.make_attention(self.spec(params, **changes)), self.target)
        return collectives.Counted(attention, self.kernels)  # type: ignore[return-value]

    def randn(self, params: Params, tokens: int, heads: int, seed: int) -> torch.Tensor:
        """Seeded on the CPU (identical on every rank and device), rounded to the dtype, then moved."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(params.batch, tokens, heads, params.head_dim, generator=gen).to(
            self.device, params.torch_dtype
        )


_CUBLAS = "CUBLAS_WORKSPACE_CONFIG"


@contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for the block, then the previous mode. Strict, not warn-only:
    torch's flash backward takes its deterministic path only then. An op with no deterministic implementation
    refuses (a RuntimeError naming determinism): the case is skipped with that reason (Refusal.UNSUPPORTED)."""
    before, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    cublas = os.environ.get(_CUBLAS)
    os.environ.setdefault(_CUBLAS, ":4096:8")  # cuBLAS's deterministic workspace, which the mode insists on
    torch.use_deterministic_algorithms(True)
    try:
        yield
    except RuntimeError as exc:
        if "determinis" not in str(exc):
            raise
        raise Unsupported(f"asked for deterministic algorithms, which this computation has none of: {exc}") from exc
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
        if cublas is None:
            os.environ.pop(_CUBLAS, None)


Body = Callable[[RankContext, Params], RankOutcome]
_REPLICATED_KINDS = frozenset(
    {Capability.REPLICATED_PREFIX, Capability.REPLICATED_SUFFIX, Capability.REPLICATED_KV_PREFIX}
)


@dataclass(frozen=True)
class Contract:
    id: str
    description: str
    params: tuple[Param, ...]
    body: Body
    requires: frozenset[Capability] = frozenset()
    bound: Callable[[Params], Bound] = field(default=lambda p: AllChecks())
    oracle: Callable[[Params], FlashAttentionRule] | None = None  # the rule for outputs against float64 attention
    checks: tuple[Callable[[Params], None], ...] = ()  # read the parameters; a ParamError names the bad one
    completions: tuple[Callable[[Params], None], ...] = ()  # fill parameters derived from others, before the checks
    min_world_size: int = 1
    timeout_s: float = 120.0
    memory: Callable[[Params, str], Footprint | None] | None = None  # (params, device): what a case will hold

    def resolve(self, raw: Mapping[str, Any]) -> Params:
        """Validated parameters, or ParamError naming the key."""
        checks = (check_common, self._check_world, *self.checks)
        params = resolve(self.params, raw, checks, (complete_tokens, *self.completions))
        if "bound" in params:
            try:
                self.bound(params)
            except ValueError as exc:
                raise ParamError("bound", str(exc)) from None
        return params

    def _check_world(self, params: Params) -> None:
        if params.get("world_size", 1) < self.min_world_size:
            raise ParamError("world_size", f"{self.id} needs world_size >= {self.min_world_size}")

    def requirements(self, params: Params) -> frozenset[Capability]:
        """Declared capabilities plus those the parameters imply (GQA, causal, ring, a named backend)."""
        needed = set(map(Capability, self.requires))
        if params.get("kv_heads", params.get("heads")) != params.get("heads"):
            needed.add(Capability.GQA)
        if params.get("causal"):
            needed.add(Capability.CAUSAL)
        if params.get("ring_degree", 1) > 1:
            needed.add(Capability.RING)
            if params.get("mask"):
                needed.add(Capability.RING_MASK)
            if needed & _REPLICATED_KINDS:
                needed.add(Capability.RING_REPLICATED)
        # Sharded contracts without explicit degrees (replicated, varlen, masks) are Ulysses over W.
        ulysses = params.get("ulysses_degree", params.get("world_size", 1) if "tokens_per_rank" in params else 1)
        if ulysses > 1:
            needed.add(Capability.ULYSSES)
        if params.get("backend") or params.get("sdpa_kernel"):
            needed.add(Capability.BACKEND_CHOICE)
        return frozenset(needed)

    def result(
        self, case_id: str, params: Params, status: Status, reason: str | None, target: str, **fields: Any
    ) -> CaseResult:
        """A result of this contract for ``case_id`` (its bound described from ``params``)."""
        return CaseResult(
            case_id,
            self.id,
            status,
            reason,
            bound=self.bound(params).describe(),
            params=dict(params),
            target=target,
            **fields,
        )

    def judge(
        self, case_id: str, params: Params, outcomes: Sequence[RankOutcome], duration_s: float, target: str
    ) -> CaseResult:
        """Every rank's outcome merged into the case's result (:func:`~harness.contracts.judging.verdict`)."""
        bound = self.bound(params)
        judged = verdict(bound, self.oracle(params) if self.oracle else None, outcomes)
        return CaseResult(
            case_id,
            self.id,
            judged.status,
            judged.reason,
            bound=judged.bound or bound.describe(),
            params=dict(params),
            target=target,
            figures=judged.figures,
            kernel=judged.kernel,
            duration_s=duration_s,
            refusal=judged.refused,
        )


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
