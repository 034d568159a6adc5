"""A mask together with replicated tokens under SP: which kinds are refused, and the legal prefix's values.

Until sglang PR #36735 (first released in 0.5.20) every replicated kind with a mask was refused:
the all-to-all would shard the replicated rows too. Since then a ``[B, n + S_local]`` key mask with
a replicated prefix runs through the replicated-prefix path, where the attention is rank-local over
the whole sequence, so the mask (replicated columns identical on every rank, sharded columns
gathered) applies as on one rank. ``usp.masked_rejects_replicated`` takes the kinds a target must
refuse (``refused``); ``usp.masked_replicated_prefix_parity`` judges the legal prefix's output.
"""

from __future__ import annotations

from functools import partial

import torch

from harness.contracts import layouts
from harness.contracts.layouts import qkv
from harness.contracts.params import Param, ParamError, Params
from harness.contracts.registry import RankContext
from harness.contracts.stats import RankOutcome
from harness.contracts.usp import (
    PREFIX_NOT_CAUSAL, REPLICATED, _all_ranks_alive, _attention_contract, _replicated_positive, output_parity,
)
from harness.targets.base import Unsupported

_REPLICATED_KWARGS = {"prefix": "num_replicated_prefix", "suffix": "num_replicated_suffix", "kv_prefix": "num_replicated_kv_prefix"}


def _check_refused(p: Params) -> None:
    if not p.refused or set(p.refused) - set(_REPLICATED_KWARGS):
        raise ParamError("refused", f"{p.refused}: a non-empty subset of {', '.join(_REPLICATED_KWARGS)}")


def masked_rejects_replicated(ctx: RankContext, p: Params) -> RankOutcome:
    """mask + replicated tokens under SP: the ``refused`` kinds are refused (mask_with_replicated) on every rank, the others run.

    A prefix left out of ``refused`` (legal in sglang since PR #36735) needs ``masked_replicated_prefix``;
    usp.masked_replicated_prefix_parity judges its values. The group must still answer afterwards.
    """
    if "prefix" not in p.refused and "masked_replicated_prefix" not in ctx.target.capabilities():
        raise Unsupported("a masked replicated prefix is expected to run; this target does not declare masked_replicated_prefix")
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
                    problems.append(f"{call} gave shape {tuple(out.shape)} (expected {tuple(q.shape)}) or non-finite values")
            except Unsupported as exc:
                if exc.kind != "mask_with_replicated":
                    problems.append(f"{call}: refused as {exc.kind}, not mask_with_replicated: {exc.reason}")
                elif not refused:
                    problems.append(f"{call} was refused, but it is legal here: {exc.reason}")
            except Exception as exc:  # noqa: BLE001 - any other outcome is the finding
                problems.append(f"{call}: {type(exc).__name__} instead of {'a mask_with_replicated refusal' if refused else 'running'}: {exc}")
        problem = _all_ranks_alive(p.world_size)
    return RankOutcome(problems=problems + ([problem] if problem else []), checks=len(_REPLICATED_KWARGS) + 1, kernel=attn.kernel)


_attention_contract(
    "usp.masked_rejects_replicated",
    "attn_mask with replicated tokens under SP (Ulysses, ring or both): each kind in `refused` is refused "
    "(mask_with_replicated) on every rank, before any collective; the others run",
    masked_rejects_replicated, ring=1,
    extra=REPLICATED + (Param("refused", "str_list", list(_REPLICATED_KWARGS), "replicated kinds refused with a mask: prefix, suffix, kv_prefix"),),
    requires=("mask", "replicated_prefix", "replicated_suffix", "replicated_kv_prefix"), checks=(_replicated_positive, _check_refused),
    min_world_size=2, timeout_s=60.0,
)


_attention_contract(
    "usp.masked_replicated_prefix_parity",
    "a [B, n + S_local] key mask with a replicated prefix under SP equals the masked single-rank output bitwise",
    partial(output_parity, layouts.masked_replicated_prefix), bound="bitwise", extra=REPLICATED,
    requires=("mask", "replicated_prefix", "masked_replicated_prefix"), checks=(_replicated_positive, PREFIX_NOT_CAUSAL),
)
