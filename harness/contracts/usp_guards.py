"""Guard contracts: what a target must refuse before any collective, and where it must not communicate.

Each checks a typed refusal (:class:`~harness.targets.base.Refusal`) raised identically on every
rank (ring without an LSE, ring under autograd without an LSE gradient, a mask with replicated
tokens), or a rank-local path (``skip_sequence_parallel``) that must make no collective; a final
``all_reduce`` completes only if no rank is stuck in, or skipped, another collective; the Ulysses path must
make exactly its two all-to-alls (:mod:`.collectives` counts them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.contracts import collectives, determinism, layouts
from harness.contracts.bounds import Bitwise
from harness.contracts.judging import OUTPUT, Against, Comparison, RankOutcome
from harness.contracts.layouts import qkv
from harness.contracts.oracles import Asked
from harness.contracts.outputs import judge_output
from harness.contracts.params import Param, ParamError, Params
from harness.contracts.registry import RankContext, register
from harness.contracts.stats import compare, magnitude_floor
from harness.contracts.usp import REPLICATED, RING, ULYSSES, Family, attention_contract, replicated_positive
from harness.targets.base import Capability, Refusal, Unsupported


def all_ranks_alive(world_size: int) -> list[str]:
    """A collective after the checks: it completes only if no rank is stuck in (or skipped) another one."""
    flag = torch.ones(1)
    dist.all_reduce(flag)
    return (
        [] if int(flag.item()) == world_size else [f"all_reduce after the checks gave {flag.item()}, not {world_size}"]
    )


def ring_admission(ctx: RankContext, p: Params) -> RankOutcome:
    """ring > 1 with a backend lacking the LSE: refused at construction (RING_NEEDS_LSE), unless skip_sequence_parallel."""
    problems: list[str] = []
    figures: dict[str, Any] = {}
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        try:
            ctx.attention(p, backend=p.no_lse_backend)
            problems.append(f"{p.no_lse_backend} was admitted under ring degree {p.ring_degree}")
        except Unsupported as exc:
            if exc.kind is not Refusal.RING_NEEDS_LSE:
                raise  # e.g. the backend is not installed here: the case cannot run
            figures["refusal"] = exc.reason
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{p.no_lse_backend}: {type(exc).__name__} instead of a ring_needs_lse refusal: {exc}")
        for label, changes in (
            (
                f"{p.no_lse_backend} with skip_sequence_parallel=True",
                {"backend": p.no_lse_backend, "skip_sequence_parallel": True},
            ),
            (f"control backend {p.backend or '(default)'}", {}),
        ):
            try:
                ctx.attention(p, **changes)
            except Unsupported as exc:
                if not changes and exc.kind is Refusal.RING_NEEDS_LSE:  # nothing here can rotate: no control, no case
                    raise Unsupported(
                        f"no ring-capable backend to serve as the control: {exc.reason}", exc.kind
                    ) from exc
                problems.append(f"{label} was refused: {exc.kind}: {exc.reason}")
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{label} was refused: {type(exc).__name__}: {exc}")
        problems += all_ranks_alive(p.world_size)
    return RankOutcome(problems=problems, checks=4, figures=figures)


register(
    attention_contract(
        "usp.ring_admission",
        "ring degree > 1 with a backend that returns no LSE is refused at construction (ring_needs_lse), "
        "admitted with skip_sequence_parallel=True; a ring-capable control backend is admitted",
        ring_admission,
        RING.adding(
            extra=(Param("no_lse_backend", "str", "sage_attn", "a backend whose supports_ring_rotation() is False"),),
            requires=(Capability.RING, Capability.BACKEND_CHOICE),
        ),
    )
)


def ring_backward_admission(ctx: RankContext, p: Params) -> RankOutcome:
    """Ring attention asked for gradients with a kernel whose LSE has none is refused (NO_BACKWARD) on every
    rank before any collective; the target's own choice differentiates the same call; the group still answers."""
    chosen = f"{p.no_grad_backend}[{p.no_grad_kernel}]" if p.no_grad_kernel else p.no_grad_backend
    problems: list[str] = []
    figures: dict[str, Any] = {}
    inputs = [t.requires_grad_() for t in qkv(ctx, p, p.tokens_per_rank)]
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        refused = ctx.attention(
            p, backend=p.no_grad_backend, sdpa_kernel=p.no_grad_kernel or None
        )  # unavailable: a skip
        try:
            refused(*inputs)
            problems.append(f"{chosen} ran ring attention under autograd instead of refusing it")
        except Unsupported as exc:
            if exc.kind is not Refusal.NO_BACKWARD:
                problems.append(f"{chosen} was refused as {exc.kind}, not no_backward: {exc.reason}")
            figures["refusal"] = exc.reason
        except Exception as exc:  # noqa: BLE001 - any other outcome is the finding
            problems.append(f"{chosen}: {type(exc).__name__} instead of a no_backward refusal: {exc}")
        out = ctx.attention(p)(*inputs)
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)
        if any(g is None or not torch.isfinite(g).all() for g in grads):
            problems.append(f"the control ({p.backend or 'the target default'}) gave no or non-finite gradients")
        problems += all_ranks_alive(p.world_size)
    return RankOutcome(problems=problems, checks=3, figures=figures)


register(
    attention_contract(
        "usp.ring_backward_admission",
        "ring attention under autograd with a kernel whose log-sum-exp has no gradient is refused (no_backward) on every "
        "rank before any collective; the target's own choice gives finite gradients",
        ring_backward_admission,
        RING.adding(
            extra=(
                Param(
                    "no_grad_backend", "str", "torch_sdpa", "a backend whose LSE has no gradient (with no_grad_kernel)"
                ),
                Param("no_grad_kernel", "str", "flash", "its pinned torch SDPA kernel (empty: none)"),
            ),
            requires=(Capability.RING, Capability.BACKWARD, Capability.BACKEND_CHOICE),
        ),
    )
)


def skip_sequence_parallel_local(ctx: RankContext, p: Params) -> RankOutcome:
    """skip_sequence_parallel=True under SP: rank-local, no collective, equal to local attention on own data.

    Ranks hold different data of different lengths and call the layer a different number of
    times: any hidden collective would mismatch or hang, and the final all_reduce would not complete.
    """
    tokens = p.tokens_per_rank + 3 * ctx.rank
    q, k, v = qkv(ctx, p, tokens, seed=p.seed + 1000 * (ctx.rank + 1))
    ref = ctx.attention(p, skip_sequence_parallel=True)(q, k, v)
    runs = determinism.extra_runs(ctx, p, lambda attention: [attention(q, k, v)], 1)
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        attn = ctx.attention(p, skip_sequence_parallel=True)
        outcome = judge_output(
            ctx.bound, p, Asked(q, k, v, p.causal, scale=p.softmax_scale), attn(q, k, v), ref, None, attn.kernel, runs
        )
        for _ in range(ctx.rank):
            again = compare(attn(q, k, v), ref, ulps_above=magnitude_floor(ref))
            outcome.comparisons.append(Comparison(Against.REFERENCE, OUTPUT, again))
        outcome.problems += all_ranks_alive(p.world_size)
    made = collectives.made(ctx.collectives)
    outcome.problems += [f"its calls made {_said(made)}: a rank-local call makes none"] if made else []
    outcome.checks += 1
    return outcome


def _said(made: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(made.items())) or "no collective"


#: A Ulysses call exchanges four tensors (Q, K, V, the output): at most one collective each; sglang packs Q, K, V.
MOST_EXCHANGES = 4


def ulysses_collectives(ctx: RankContext, p: Params) -> RankOutcome:
    """One Ulysses call sends no more than a Ulysses exchange needs, in at most four collectives: each rank keeps
    1/U of its Q, K, V and output shards and sends the rest to the ranks owning those heads. Whether Q, K and V go
    in one exchange (sglang) or three (diffusers) is the stack's choice; a layer that gathers K/V instead of
    exchanging heads sends U times the bytes, one that exchanges head by head makes H calls: both compute the
    same output, so only what the layer sent tells."""
    case = layouts.sharded(ctx, p)
    with ctx.parallel(p.ulysses_degree, 1):
        attn = ctx.attention(p)
        attn(*case.local, **case.kwargs)
    q = case.local[0]  # the output is a Q-shaped tensor in Q's dtype: sized from what was asked, not what came back
    tensors = (*case.local, q)
    needed = sum(t.numel() * t.element_size() for t in tensors) * (p.ulysses_degree - 1) // p.ulysses_degree
    made, sent = collectives.made(ctx.collectives), ctx.collectives[collectives.SENT]
    problems = []
    if sent > needed:
        problems.append(
            f"one call sent {sent} bytes from this rank, {sent / needed:.2f}x what a Ulysses exchange of Q, K, V "
            f"and the output needs ({needed}: {p.ulysses_degree - 1}/{p.ulysses_degree} of each shard)"
        )
    if sum(made.values()) > MOST_EXCHANGES:
        problems.append(
            f"one call made {_said(made)}; a Ulysses call needs at most {MOST_EXCHANGES} collectives (one per tensor "
            "of Q, K, V and the output)"
        )
    return RankOutcome(problems=problems, checks=2, kernel=attn.kernel, figures={"needed_bytes": needed})


register(
    attention_contract(
        "usp.ulysses_collectives",
        "one Ulysses call sends no more bytes than exchanging (U-1)/U of its Q, K, V and output shards needs, in at "
        "most four collectives (one per tensor), counted at the dispatcher",
        ulysses_collectives,
        ULYSSES.adding(min_world_size=2),
    )
)


register(
    attention_contract(
        "usp.skip_sequence_parallel_local",
        "skip_sequence_parallel=True under an SP group (default Ulysses over W, which every sequence-parallel "
        "target has; ring_degree for ring) constructs, runs rank-locally with no collective and equals local "
        "attention on the rank's own data, bitwise",
        skip_sequence_parallel_local,
        Family(ring=1, min_world_size=2),
        bound=Bitwise(),
    )
)


# A mask with replicated tokens under SP: until sglang PR #36735 (0.5.20) every kind was refused (the all-to-all
# would shard the replicated rows too); since then a [B, n + S_local] key mask with a replicated prefix runs
# rank-locally over the whole sequence (usp.masked_replicated_prefix_parity judges its values).
_REPLICATED_KWARGS = {
    "prefix": "num_replicated_prefix",
    "suffix": "num_replicated_suffix",
    "kv_prefix": "num_replicated_kv_prefix",
}


def _check_refused(p: Params) -> None:
    if not p.refused or set(p.refused) - set(_REPLICATED_KWARGS):
        raise ParamError("refused", f"{p.refused}: a non-empty subset of {', '.join(_REPLICATED_KWARGS)}")


def masked_rejects_replicated(ctx: RankContext, p: Params) -> RankOutcome:
    """mask + replicated tokens under SP: the ``refused`` kinds are refused (MASK_WITH_REPLICATED) on every rank, the
    others run. A prefix left out of ``refused`` needs ``masked_replicated_prefix``; the group must still answer."""
    if "prefix" not in p.refused and Capability.MASKED_REPLICATED_PREFIX not in ctx.target.capabilities():
        raise Unsupported(
            "a masked replicated prefix is expected to run; this target does not declare masked_replicated_prefix",
            Refusal.LACKS,
            frozenset({Capability.MASKED_REPLICATED_PREFIX}),
        )
    q, k, v = qkv(ctx, p, p.tokens_per_rank + p.replicated)
    mask = torch.ones(p.batch, q.shape[1], dtype=torch.bool, device=ctx.device)
    problems: list[str] = []
    with ctx.parallel(p.ulysses_degree, p.ring_degree):
        attn = ctx.attention(p)
        for kind, kwarg in _REPLICATED_KWARGS.items():
            call, refused = f"attn_mask with {kwarg}={p.replicated}", kind in p.refused
            try:
                out = attn(q, k, v, attn_mask=mask, **{kwarg: p.replicated})
                if refused:
                    problems.append(f"{call} ran instead of being refused")
                elif out.shape != q.shape or not torch.isfinite(out).all():
                    problems.append(
                        f"{call} gave shape {tuple(out.shape)} (expected {tuple(q.shape)}) or non-finite values"
                    )
            except Unsupported as exc:
                if exc.kind is not Refusal.MASK_WITH_REPLICATED:
                    problems.append(f"{call}: refused as {exc.kind}, not mask_with_replicated: {exc.reason}")
                elif not refused:
                    problems.append(f"{call} was refused, but it is legal here: {exc.reason}")
            except Exception as exc:  # noqa: BLE001 - any other outcome is the finding
                problems.append(
                    f"{call}: {type(exc).__name__} instead of {'a mask_with_replicated refusal' if refused else 'running'}: {exc}"
                )
        problems += all_ranks_alive(p.world_size)
    return RankOutcome(problems=problems, checks=len(_REPLICATED_KWARGS) + 1, kernel=attn.kernel)


register(
    attention_contract(
        "usp.masked_rejects_replicated",
        "attn_mask with replicated tokens under SP (Ulysses, ring or both): each kind in `refused` is refused "
        "(mask_with_replicated) on every rank, before any collective; the others run",
        masked_rejects_replicated,
        Family(
            ring=1,
            extra=REPLICATED
            + (
                Param(
                    "refused",
                    "str_list",
                    list(_REPLICATED_KWARGS),
                    "replicated kinds refused with a mask: prefix, suffix, kv_prefix",
                ),
            ),
            requires=(
                Capability.MASK,
                Capability.REPLICATED_PREFIX,
                Capability.REPLICATED_SUFFIX,
                Capability.REPLICATED_KV_PREFIX,
            ),
            checks=(replicated_positive, _check_refused),
            min_world_size=2,
        ),
        timeout_s=60.0,
    )
)
