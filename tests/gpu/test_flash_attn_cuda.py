"""The installed flash-attn kernel itself, through the ``fa`` backend, on a CUDA GPU: forward by the FlashAttention
rule against float64, its own LSE against the exact one (natural log), GQA passed without expansion, and the
backward: dQ, dK, dV against float64 autograd, bitwise across runs with ``deterministic``.

Needs a GPU and flash-attn (``../shared/tools/flash-attn-wheels`` on the H200): skipped otherwise, with the reason.
"""

from __future__ import annotations

import pytest
import torch

from reference_impl.attention.backends import FlashAttnBackend, MathBackend
from tests.reference.test_backends import fa_rule_bound

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        FlashAttnBackend.unavailable_reason() is not None, reason=f"fa: {FlashAttnBackend.unavailable_reason()}"
    ),
]

# (batch, tokens, heads, kv heads, head dim): odd lengths, GQA, Z-Image's 30 heads of 128, HunyuanVideo's 24.
SHAPES = [(1, 1030, 24, 8, 64), (2, 257, 16, 16, 128), (1, 4608, 30, 30, 128)]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    b, s, h, hkv, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=gen).to("cuda", dtype)
    k, v = (torch.randn(b, s, hkv, d, generator=gen).to("cuda", dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_lse_against_float64(shape, causal, dtype) -> None:
    q, k, v = _inputs(shape, dtype)
    out, lse = FlashAttnBackend().forward(q, k, v, causal=causal, softmax_scale=0.1, return_lse=True)
    ref64, lse64 = MathBackend().forward(
        q.double(), k.double(), v.double(), causal=causal, softmax_scale=0.1, return_lse=True
    )
    err = (out.double() - ref64).abs().max().item()
    bound = fa_rule_bound(q.cpu(), k.cpu(), v.cpu(), causal, dtype, ref64.cpu())
    lse_err = (lse.double() - lse64.double()).abs().max().item()
    print(
        f"FIGURE fa {FlashAttnBackend.implementation()} {shape} causal={causal} {dtype} err={err:.3e} bound={bound:.3e} lse_err={lse_err:.3e}"
    )
    assert err <= bound
    assert lse.shape == (shape[0], shape[2], shape[1]) and lse_err <= 1e-3 * max(1.0, lse64.abs().max().item())


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_deterministic_backward_is_bitwise_and_right(shape) -> None:
    q, k, v = _inputs(shape, torch.bfloat16, seed=1)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)

    def grads(backend, dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        backend.forward(*leaves, causal=True).backward(grad.to(dtype))
        return [t.grad for t in leaves]

    first, second = (
        grads(FlashAttnBackend(deterministic=True), torch.bfloat16),
        grads(FlashAttnBackend(deterministic=True), torch.bfloat16),
    )
    exact = grads(MathBackend(), torch.float64)
    naive = grads(MathBackend(), torch.bfloat16)  # fp32 softmax of bf16 inputs: the precision a bf16 kernel has
    errors = {
        f"d{name}": (
            (a.double() - ref).abs().max().item(),
            (low.double() - ref).abs().max().item(),
            ref.abs().max().item(),
        )
        for name, a, ref, low in zip("qkv", first, exact, naive)
    }
    print(f"FIGURE fa {shape} (err, math_bf16_err, max|ref|): {errors}")
    assert [torch.equal(a, b) for a, b in zip(first, second)] == [True] * 3, "a gradient differs between two runs"
    assert {n: err <= 2 * low + 1e-4 * top for n, (err, low, top) in errors.items()} == dict.fromkeys(errors, True)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_a_key_padding_mask_through_the_varlen_entry(shape) -> None:
    """Z-Image's text padding as flash-attn runs it: each item's kept keys packed, against float64 with the mask."""
    q, k, v = _inputs(shape, torch.bfloat16, seed=3)
    keep = torch.rand(shape[0], shape[1], generator=torch.Generator().manual_seed(4)) > 0.3
    mask = keep[:, None, None, :].cuda()
    out, lse = FlashAttnBackend().forward(q, k, v, softmax_scale=0.1, return_lse=True, attn_mask=mask)
    ref64, lse64 = MathBackend().forward(
        q.double(), k.double(), v.double(), softmax_scale=0.1, return_lse=True, attn_mask=mask
    )
    naive = MathBackend().forward(q, k, v, softmax_scale=0.1, attn_mask=mask)  # fp32 softmax, bf16 in and out
    err, naive_err = ((t.double() - ref64).abs().max().item() for t in (out, naive))
    lse_err = (lse.double() - lse64.double()).abs().max().item()
    print(f"FIGURE fa key mask {shape} err={err:.3e} math_bf16_err={naive_err:.3e} lse_err={lse_err:.3e}")
    assert err <= 2 * naive_err + 1e-4 and lse_err <= 1e-3 * max(1.0, lse64.abs().max().item())
