"""CUDA checks: each SDPA kernel by the FlashAttention rule, LSE paths, SP with ranks sharing a GPU.

Run on a GPU machine with ``pytest tests/gpu -s`` to see the figures each test prints.
"""

from __future__ import annotations

import pytest
import torch

from harness.contracts.case import make_case
from harness.contracts.runner import RunOptions, run_cases
from harness.ranks import PoolSet
from harness.results import PASSED, CaseResult
from reference_impl.attention.backends import SDPA_KERNELS, MathBackend, PinnedKernelRefused, TorchSDPABackend
from tests.reference.test_backends import fa_rule_bound

pytestmark = pytest.mark.gpu

SHAPES = [(1, 134, 30, 30, 128), (1, 1030, 24, 8, 64), (2, 257, 16, 16, 64)]


@pytest.mark.parametrize("kernel", SDPA_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sdpa_kernel_by_fa_rule(kernel, dtype, causal, shape):
    b, s, h, hkv, d = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, h, d, generator=gen).to("cuda", dtype)
    k, v = (torch.randn(b, s, hkv, d, generator=gen).to("cuda", dtype) for _ in range(2))
    backend = TorchSDPABackend(kernel=kernel)
    try:
        out = backend.forward(q, k, v, causal=causal)
        torch.cuda.synchronize()
    except RuntimeError as exc:
        pytest.skip(f"torch refuses kernel {kernel} for {dtype} {shape}: {str(exc).splitlines()[0][:160]}")
    ref64 = MathBackend().forward(q.double(), k.double(), v.double(), causal=causal)
    err = (out.double() - ref64).abs().max().item()
    bound = fa_rule_bound(q.cpu(), k.cpu(), v.cpu(), causal, dtype, ref64.cpu())
    print(f"FIGURE sdpa kernel={kernel} dtype={dtype} causal={causal} shape={shape} err={err:.3e} bound={bound:.3e}")
    assert torch.isfinite(out).all() and err <= bound


@pytest.mark.parametrize("kernel", [None, "flash", "efficient", "cudnn", "math"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lse_path_on_cuda(kernel, dtype):
    """Every kernel's LSE equals the MATH backend's, or the kernel is refused before computing (never NaN)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 200, 8, 64, generator=gen).to("cuda", dtype) for _ in range(3))
    try:
        out, lse = TorchSDPABackend(kernel=kernel).forward(q, k, v, return_lse=True)
    except PinnedKernelRefused as exc:
        print(f"FIGURE lse kernel={kernel} dtype={dtype} refused: {exc}")
        assert (kernel, dtype) == ("cudnn", torch.float32)
        return
    except RuntimeError as exc:  # torch's own refusal (flash has no fp32 kernel)
        pytest.skip(f"kernel {kernel} with LSE refused by torch for {dtype}: {str(exc).splitlines()[0][:160]}")
    ref_out, ref_lse = MathBackend().forward(q, k, v, return_lse=True)
    lse_err = (lse - ref_lse).abs().max().item()
    print(f"FIGURE lse kernel={kernel} dtype={dtype} lse_err={lse_err:.3e}")
    assert torch.isfinite(lse).all() and lse.shape == ref_lse.shape and lse_err < 2e-2


def test_the_raw_cudnn_op_is_why_fp32_is_refused():
    """What the refusal guards against: the aten cudnn op itself, fp32 in, a non-finite LSE out.

    If a torch release fixes it, this test fails and says so: the refusal can then go.
    """
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, 200, 64, generator=gen).to("cuda", torch.float32) for _ in range(3))
    try:
        lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False)[1]
    except RuntimeError as exc:
        pytest.skip(f"this torch refuses fp32 cudnn attention itself: {str(exc).splitlines()[0][:160]}")
    finite = bool(torch.isfinite(lse).all())
    print(f"FIGURE raw cudnn fp32 lse finite={finite}")
    assert not finite, "cudnn now returns a finite fp32 LSE: drop the refusal in TorchSDPABackend._forward_with_lse"


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn", "math"])
def test_head_count_invariance(kernel):
    """What makes the suffix contract bitwise: heads computed alone equal heads computed together."""
    results = []
    for s, h, d in [(134, 30, 128), (1030, 24, 64), (4608, 24, 128)]:
        gen = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(1, s, h, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
        backend = TorchSDPABackend(kernel=kernel)
        try:
            full = backend.forward(q, k, v)
            half = backend.forward(q[:, :, : h // 2], k[:, :, : h // 2], v[:, :, : h // 2])
        except RuntimeError as exc:
            pytest.skip(f"kernel {kernel} refused: {str(exc).splitlines()[0][:120]}")
        results.append((s, h, d, bool(torch.equal(full[:, :, : h // 2], half))))
    print(f"FIGURE head-invariance kernel={kernel} {results}")


@pytest.fixture(scope="module")
def cuda_pool2():
    with PoolSet(device="cuda") as pools:
        yield pools


def _contract_on_cuda(pools: PoolSet, contract_id: str, **params) -> CaseResult:
    """A contract on ranks sharing the GPU (gloo with host staging), through the same runner as the CLI."""
    case = make_case(contract_id, params, case_id=contract_id, source="tests/gpu")
    [verdict] = run_cases([case], RunOptions(device="cuda"), pools)
    print(f"FIGURE cuda {contract_id} {params} {verdict.status} {verdict.kernel} {verdict.figures}")
    return verdict


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_sglang_case_two_ranks_sharing_the_gpu(cuda_pool2, dtype):
    params = dict(world_size=2, batch=1, tokens_per_rank=64, heads=30, head_dim=128, replicated=6, dtype=dtype)
    suffix = _contract_on_cuda(cuda_pool2, "usp.replicated_suffix_bitwise", **params)
    assert suffix.status == PASSED and suffix.figures["bitwise"] is True
    assert _contract_on_cuda(cuda_pool2, "usp.replicated_prefix_drift", **params).status == PASSED


@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_and_ring_on_cuda(cuda_pool2, causal):
    params = dict(world_size=2, tokens_per_rank=64, heads=8, kv_heads=4, head_dim=64, dtype="bf16", causal=causal)
    assert _contract_on_cuda(cuda_pool2, "usp.ulysses_parity", **params).status == PASSED
    assert _contract_on_cuda(cuda_pool2, "usp.ring_parity", **params).status == PASSED
