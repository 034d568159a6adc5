"""Gradient contracts (``usp.*_grad``): dq, dk, dv of the N-rank layer against one rank and float64.

Each mirrors a forward contract of :mod:`.usp` on the same :mod:`.layouts`: every rank builds the
whole sequence and a seeded upstream gradient dO of the whole output, differentiates the
single-rank layer for dO, then its own shard under SP for its share of dO, and compares the
gradient of each of its inputs with its share of the single-rank one (the case's bound: bitwise
where the reduction order is unchanged, the FlashAttention rule where the ring changes it) and,
dtype and shape first, both with the gradients of float64 attention (the ``oracle`` rule). A
replicated token's gradient, like its value, must be whole and the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from harness.contracts import determinism, layouts
from harness.contracts.bounds import Bitwise, Bound, judge
from harness.contracts.judging import Against, Comparison, RankOutcome, Role
from harness.contracts.layouts import Layout, LayoutFn
from harness.contracts.oracles import diagnose_gradient, gradients_ref64, naive_gradients, take
from harness.contracts.outputs import judge_runs, oracle_rule
from harness.contracts.params import Params
from harness.contracts.registry import Contract, RankContext, register
from harness.contracts.stats import compare, digest, magnitude_floor
from harness.contracts.usp import (
    HYBRID,
    KV_PREFIX,
    MASKED,
    PREFIX,
    RING,
    SUFFIX,
    ULYSSES,
    VARLEN,
    Family,
    attention_contract,
    bitwise_unless_ring,
)
from harness.targets.base import Capability

Tensor = torch.Tensor
NAMES = ("dq", "dk", "dv")
_DOUT_SEED = 4099  # the upstream gradient's seed offset: dO is not q, k or v


def _grads(
    ctx: RankContext, out: Tensor, inputs: list[Tensor], dout: Tensor, what: str
) -> tuple[list[Tensor | None], list[str]]:
    """The inputs' gradients for ``dout`` (the target's backward, in the case's kernel mode), or the problems that
    prevent them (no graph, an input not reached)."""
    if not out.requires_grad:
        return [None] * 3, [f"the {what} output has no autograd graph: it cannot be differentiated"]
    with ctx.kernels():
        grads = list(torch.autograd.grad(out, inputs, dout, allow_unused=True))
    return grads, [f"no gradient reached the {what} {n[1]}" for n, g in zip(NAMES, grads) if g is None]


def _single_rank(
    ctx: RankContext, attn: Callable[..., Tensor], case: Layout, dout: Tensor
) -> tuple[list[Tensor | None], list[str]]:
    """dq, dk, dv of the single-rank layer on the whole sequence for ``dout``."""
    whole = [t.detach().clone().requires_grad_() for t in (case.asked.q, case.asked.k, case.asked.v)]
    return _grads(ctx, attn(*whole, **case.single_kwargs), whole, dout, "single-rank")


def gradient_parity(layout: LayoutFn, ctx: RankContext, p: Params) -> RankOutcome:
    """This rank's dq, dk, dv of the case's layout against the single-rank ones and float64's.

    Under a bitwise bound the single-rank backward runs again and in the Ulysses head groups, to learn
    whether the kernel allows a bitwise claim at this shape (:mod:`.determinism`)."""
    case = layout(ctx, p)
    dout = ctx.randn(p, case.asked.q.shape[1], p.heads, p.seed + _DOUT_SEED)
    single, problems = _single_rank(ctx, ctx.attention(p, skip_sequence_parallel=True), case, dout)
    runs = determinism.Runs()
    if not problems:
        replicated = case.replicated_q is not None or case.replicated_kv is not None
        runs = determinism.extra_runs(
            ctx, p, lambda attn: _single_rank(ctx, attn, case, dout)[0], case.degrees[0], replicated
        )
    mine = [t.detach().clone().requires_grad_() for t in case.local]
    with ctx.parallel(*case.degrees):
        attn = ctx.attention(p)
        out = attn(*mine, **case.kwargs)
        sharded, sharded_problems = _grads(ctx, out, mine, case.pick_q(dout), "sharded")
    problems += sharded_problems
    if problems:
        return RankOutcome(problems=problems, checks=1, kernel=attn.kernel)
    outcome = judge_gradients(ctx.bound, p, case, dout, sharded, single, attn.kernel, runs)  # type: ignore[arg-type]
    for name, grad, rows in zip(NAMES, sharded, (case.replicated_q, case.replicated_kv, case.replicated_kv)):
        if rows is not None:
            outcome.replicated[name] = digest(grad[:, rows])  # type: ignore[index]
    return outcome


def judge_gradients(
    bound: Bound,
    p: Params,
    case: Layout,
    dout: Tensor,
    sharded: list[Tensor],
    single: list[Tensor],
    kernel: str,
    runs: determinism.Runs,
) -> RankOutcome:
    """Each gradient: dtype and shape, then against its share of the single-rank one (the case's bound, per name)
    and against float64 attention's (the ``oracle`` rule), with a diagnosis where the oracle is missed. Each rank
    judges the single-rank gradients on the rows it holds, so the ranks together judge all of them; the extra
    single-rank runs of a bitwise case likewise (:func:`~harness.contracts.outputs.judge_runs`)."""
    asked = case.asked
    problems = []
    for name, grad, whole, local, full in zip(NAMES, sharded, single, case.local, (asked.q, asked.k, asked.v)):
        for what, g, t in ((Role.SHARDED, grad, local), (Role.SINGLE_RANK, whole, full)):
            if g.dtype != t.dtype or g.shape != t.shape:
                problems.append(f"{what} {name} is {g.dtype} {tuple(g.shape)}, its input {t.dtype} {tuple(t.shape)}")
    if problems:
        return RankOutcome(problems=problems, checks=1, kernel=kernel)
    ref64, naive = gradients_ref64(*asked.args, dout=dout), naive_gradients(*asked.args, dout=dout)
    rule = oracle_rule(p)
    outcome = RankOutcome(kernel=kernel, unmeasured=runs.unmeasured)
    for i, (name, grad, whole, g64, gnaive, rows) in enumerate(
        zip(NAMES, sharded, single, ref64, naive, (case.q_rows, case.kv_rows, case.kv_rows))
    ):
        mine64, mine_naive = take(g64, rows), take(gnaive, rows)
        floor = magnitude_floor(whole) if isinstance(bound, Bitwise) else None
        oracle_args = (mine64, mine_naive) if bound.needs_ref64 else ()
        against_single = compare(grad, take(whole, rows), *oracle_args, ulps_above=floor)
        outcome.comparisons.append(Comparison(Against.REFERENCE, name, against_single))
        valid = rows[rows >= 0]
        valid64, valid_naive = take(g64, valid), take(gnaive, valid)
        judged = {
            Role.SHARDED: (grad, mine64, mine_naive),
            Role.SINGLE_RANK: (take(whole, valid), valid64, valid_naive),
        }
        for role, (g, ref, low) in judged.items():
            float64 = compare(g, ref, ref, low)
            hint = diagnose_gradient(g, ref, low, rule) if judge(rule, float64) else None
            outcome.comparisons.append(Comparison(Against.FLOAT64, name, float64, role, hint))
        extra = {role: results[i] for role, results in runs.results.items()}
        judge_runs(outcome, name, extra, whole, floor, valid, valid64, valid_naive)
    return outcome


def gradient_contract(
    contract_id: str, description: str, layout: LayoutFn, family: Family, bound: str | Callable[[Params], str]
) -> Contract:
    """A contract comparing dq, dk, dv of ``layout`` under sequence parallelism with one rank's."""
    body = partial(gradient_parity, layout)
    needs = family.adding(requires=(Capability.BACKWARD,))
    return attention_contract(contract_id, description, body, needs, bound=bound, gradient=True)


register(
    gradient_contract(
        "usp.ulysses_grad",
        "Ulysses dq, dk, dv equal one rank's bitwise (the adjoint all-to-all keeps the order)",
        layouts.sharded,
        ULYSSES,
        bound="bitwise",
    )
)
register(
    gradient_contract(
        "usp.ring_grad",
        "ring attention's dq, dk, dv (the ring shifted back) within the FlashAttention rule",
        layouts.sharded,
        RING,
        bound="fa:2",
    )
)
register(
    gradient_contract(
        "usp.hybrid_grad",
        "Ulysses × ring dq, dk, dv within the FlashAttention rule",
        layouts.sharded,
        HYBRID,
        bound="fa:2",
    )
)
register(
    gradient_contract(
        "usp.varlen_grad",
        "varlen dq, dk, dv equal one rank's bitwise on valid tokens, zeros on padding",
        layouts.varlen,
        VARLEN,
        bound="bitwise",
    )
)
register(
    gradient_contract(
        "usp.masked_grad",
        "masked dq, dk, dv under SP equal one rank's bitwise",
        layouts.masked,
        MASKED,
        bound=bitwise_unless_ring,
    )
)
register(
    gradient_contract(
        "usp.replicated_suffix_grad",
        "replicated-suffix dq, dk, dv equal one rank's (bitwise without ring), the suffix's whole and alike on every rank",
        layouts.replicated_suffix,
        SUFFIX,
        bound=bitwise_unless_ring,
    )
)
register(
    gradient_contract(
        "usp.replicated_prefix_grad",
        "replicated-prefix dq, dk, dv against one rank in suffix order (the FlashAttention rule), the prefix's whole and "
        "alike on every rank",
        layouts.replicated_prefix,
        PREFIX,
        bound="fa:2",
    )
)
register(
    gradient_contract(
        "usp.replicated_kv_prefix_grad",
        "dq, dk, dv of cross attention on a replicated K/V prefix equal one rank's (bitwise without ring), the prefix's "
        "dk, dv whole and alike on every rank",
        layouts.replicated_kv_prefix,
        KV_PREFIX,
        bound=bitwise_unless_ring,
    )
)
