"""flash-attn packages planted on ``sys.path``, for the CPU: the three real APIs' entry points with their real
signatures and return shapes (computed in float64 torch), and packages that import but are not flash-attn.

Each planted ``flash_attn_func`` records its keyword arguments and the KV head count it was given in the
module's ``CALLS`` list, so a test sees what the backend passed (GQA not expanded, ``deterministic``, the
LSE flag). FA2's and FA3's LSE are detached, as their backward drops the LSE's gradient; FA4's is not.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from reference_impl.attention.flash_attn_api import installed_api

_MATH = """
import math
import torch

CALLS = []


def _attention(q, k, v, softmax_scale, causal):
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype, (
        "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2"  # as the real kernels assert
    )
    CALLS.append({"kv_heads": k.shape[2], "q_heads": q.shape[2]})
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if causal:  # bottom-right aligned, as flash-attn's
        sq, sk = scores.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v.double())
    return out.to(q.dtype), lse.float()


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal):
    # packed [total, H, D] sequences; the LSE [H, total_q], as the real varlen entries return it
    outs, lses = [], []
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]))
        out, lse = _attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], softmax_scale, causal)
        outs.append(out[0])
        lses.append(lse[0])
    CALLS[-1]["varlen"] = True
    return torch.cat(outs), torch.cat(lses, dim=-1)
"""

_SOURCES = {
    "fa2": {
        "flash_attn/__init__.py": _MATH
        + """
__version__ = "2.8.3"


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    out, lse = _attention(q, k, v, softmax_scale, causal)
    CALLS[-1].update(deterministic=deterministic, lse_flag=return_attn_probs)
    return (out, lse.detach(), None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return (out, lse.detach(), None) if return_attn_probs else out
""",
    },
    "fa3": {
        "flash_attn_interface.py": _MATH
        + """

def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    out, lse = _attention(q, k, v, softmax_scale, causal)
    CALLS[-1].update(deterministic=deterministic, lse_flag=return_attn_probs)
    return (out, lse.detach()) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return (out, lse.detach()) if return_attn_probs else out
""",
    },
    "fa4": {
        "flash_attn/cute/__init__.py": "from .interface import flash_attn_func, flash_attn_varlen_func, CALLS\n",
        "flash_attn/cute/interface.py": _MATH
        + """

def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, return_lse=False):
    import warnings  # what FA4 4.0.0b36's CuTe DSL says on every kernel compile

    warnings.warn("Argument aux_data (position 17) cannot be converted to a JitArgument for function 'f'.", UserWarning)
    out, lse = _attention(q, k, v, softmax_scale, causal)
    CALLS[-1].update(deterministic=deterministic, lse_flag=return_lse)
    return out, (lse if return_lse else None)


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, return_lse=False):
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    CALLS[-1].update(deterministic=deterministic, lse_flag=return_lse)
    return out, (lse if return_lse else None)
""",
    },
    # FA4 with the LSE in base 2 (the kernels' internal unit) instead of the natural log: ring merges go wrong.
    "fa4_lse_log2": {
        "flash_attn/cute/__init__.py": "from .interface import flash_attn_func, CALLS\n",
        "flash_attn/cute/interface.py": _MATH
        + """

def flash_attn_func(q, k, v, softmax_scale=None, causal=False, deterministic=False, return_lse=False):
    out, lse = _attention(q, k, v, softmax_scale, causal)
    return out, (lse / math.log(2) if return_lse else None)
""",
    },
    # FA4's layout without its entry points: `import flash_attn` works (a namespace package), nothing else.
    "empty": {"flash_attn/cute/__init__.py": '"""No entry points."""\n'},
    "no_entry": {"flash_attn/__init__.py": '__version__ = "2.8.3"\n'},
    "broken": {"flash_attn/__init__.py": 'raise ImportError("undefined symbol: _ZN3c104cuda9SetDevice")\n'},
    "not_flash_attn": {"flash_attn/__init__.py": "def flash_attn_func(q, k, v):\n    return q\n"},
}
KINDS = tuple(_SOURCES)


def write(root: Path, kind: str) -> Path:
    """``kind``'s files under ``root/kind``; the folder to put on ``sys.path`` (or PYTHONPATH, for rank processes)."""
    for relative, text in _SOURCES[kind].items():
        path = root / kind / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / kind


def _forget() -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in ("flash_attn", "flash_attn_interface")]:
        del sys.modules[name]
    installed_api.cache_clear()


@contextmanager
def planted(root: Path, *kinds: str) -> Iterator[None]:
    """``kinds`` importable from ``root`` for the block (flash-attn's resolution forgotten before and after)."""
    folders = [write(root, kind) for kind in kinds]
    with pytest.MonkeyPatch.context() as patch:
        for folder in folders:
            patch.syspath_prepend(str(folder))
        _forget()
        try:
            yield
        finally:
            _forget()
