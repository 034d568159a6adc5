"""The ``fa`` backend finds flash-attn by what the package exposes: FA2, FA3 and FA4 are called through their own
signatures (GQA native, the scale, causal, the LSE flag, ``deterministic``), and a package that imports but
lacks the entry points is unavailable with the reason, never "available" from an import alone."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from reference_impl.attention.backends import FlashAttnBackend, KernelRefused, MathBackend
from reference_impl.attention.flash_attn_api import FA2, FA3, FA4, FlashAttnApi, installed_api
from tests.planted_flash_attn import planted

APIS = {"fa2": ("FA2", "flash_attn"), "fa3": ("FA3", "flash_attn_interface"), "fa4": ("FA4", "flash_attn.cute")}


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("empty", "FA4: flash_attn.cute imports but has no flash_attn_func"),
        ("no_entry", "FA2: flash_attn imports but has no flash_attn_func"),
        ("broken", "FA2: flash_attn does not import (ImportError: undefined symbol"),
        ("not_flash_attn", "FA2: flash_attn.flash_attn_func takes no causal, softmax_scale: not a flash-attn API"),
    ],
)
def test_a_package_without_the_entry_points_is_unavailable_with_the_reason(
    tmp_path: Path, kind: str, reason: str
) -> None:
    with planted(tmp_path, kind):
        if kind != "broken":
            importlib.import_module("flash_attn")  # the import alone succeeds
        found = installed_api()
        assert isinstance(found, str) and reason in found
        assert reason in (FlashAttnBackend.unavailable_reason() or "")
        assert FlashAttnBackend.implementation() is None


def test_nothing_installed_names_every_api(tmp_path: Path) -> None:
    with planted(tmp_path):
        found = installed_api()
        if isinstance(found, FlashAttnApi):
            pytest.skip(f"a real flash-attn is installed here: {found.describe()}")
        assert all(f"{n}: {m} is not installed" in found for n, m in APIS.values())


def _inputs(causal_rows: int = 12, heads: int = 4, kv_heads: int = 2) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, causal_rows, heads, 16), (2, causal_rows, kv_heads, 16), (2, causal_rows, kv_heads, 16)]
    return tuple(torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes)


@pytest.mark.parametrize("kind", ["fa2", "fa3", "fa4"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_each_api_is_called_through_its_own_signature(tmp_path: Path, kind: str, causal: bool) -> None:
    name, module = APIS[kind]
    with planted(tmp_path, kind):
        backend = FlashAttnBackend()
        assert backend.api().spec.name == name and backend.implementation().startswith(f"{name}: {module}.")
        q, k, v = _inputs()
        out, lse = backend.forward(q, k, v, causal=causal, softmax_scale=0.3, return_lse=True)
        call = importlib.import_module(module).CALLS[-1]
        assert call == {"kv_heads": 2, "q_heads": 4, "deterministic": False, "lse_flag": True}  # GQA not expanded
        ref, ref_lse = MathBackend().forward(q, k, v, causal=causal, softmax_scale=0.3, return_lse=True)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (2, 4, 12)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
        torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=2**-7)
        assert isinstance(backend.forward(q, k, v, causal=causal), torch.Tensor)  # no LSE asked: the output alone


@pytest.mark.parametrize(("kind", "gradient"), [("fa2", False), ("fa3", False), ("fa4", True)])
def test_only_fa4s_lse_carries_a_gradient(tmp_path: Path, kind: str, gradient: bool) -> None:
    """FA2's and FA3's backward drop the LSE's gradient: a ring merged through it would be wrong."""
    with planted(tmp_path, kind):
        assert FlashAttnBackend().lse_has_gradient() is gradient
        q, k, v = (t.requires_grad_() for t in _inputs())
        _, lse = FlashAttnBackend().forward(q, k, v, return_lse=True)
        assert lse.requires_grad is gradient


@pytest.mark.parametrize("kind", ["fa2", "fa3", "fa4"])
def test_deterministic_follows_the_backend_option_and_torchs_mode(tmp_path: Path, kind: str) -> None:
    with planted(tmp_path, kind):
        calls = importlib.import_module(APIS[kind][1]).CALLS
        q, k, v = _inputs()
        FlashAttnBackend(deterministic=True).forward(q, k, v)
        assert calls[-1]["deterministic"] is True
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            FlashAttnBackend().forward(q, k, v)
        finally:
            torch.use_deterministic_algorithms(before)
        assert calls[-1]["deterministic"] is True
        FlashAttnBackend().forward(q, k, v)
        assert calls[-1]["deterministic"] is False


def test_what_flash_attn_cannot_express_is_refused_before_computing(tmp_path: Path) -> None:
    with planted(tmp_path, "fa4"):
        q, k, v = _inputs()
        with pytest.raises(KernelRefused, match="takes no dense attention mask"):
            FlashAttnBackend().forward(q, k, v, attn_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool))
        with pytest.raises(KernelRefused, match="takes no dense attention mask"):  # additive, not which keys
            FlashAttnBackend().forward(q, k, v, attn_mask=torch.zeros(2, 1, 1, 12))
        with pytest.raises(KernelRefused, match="no key mask together with causal"):
            FlashAttnBackend().forward(q, k, v, causal=True, attn_mask=torch.ones(2, 1, 1, 12, dtype=torch.bool))
        with pytest.raises(KernelRefused, match="bottom-right"):
            FlashAttnBackend().forward(q[:, :5], k, v, causal=True)
        assert importlib.import_module("flash_attn.cute").CALLS == []
    assert not FlashAttnBackend.supports_head_size(12) and FlashAttnBackend.supports_head_size(72)
    assert not FlashAttnBackend.supports_dtype(torch.float32)


def test_parity_fa_api_chooses_among_installed_apis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with planted(tmp_path, "fa3", "fa4"):
        assert FlashAttnBackend.api().spec is FA4  # the newest by default
    monkeypatch.setenv("PARITY_FA_API", "fa3")
    with planted(tmp_path, "fa3", "fa4"):
        assert FlashAttnBackend.api().spec is FA3
    monkeypatch.setenv("PARITY_FA_API", "fa9")
    with planted(tmp_path, "fa4"):
        assert "PARITY_FA_API=fa9 names no flash-attn API" in (FlashAttnBackend.unavailable_reason() or "")


@pytest.mark.parametrize(
    ("spec", "capability", "reason"),
    [
        (FA3, (8, 0), "FA3 runs on sm90 to sm90, this GPU is sm80"),
        (FA3, (10, 0), "FA3 runs on sm90 to sm90, this GPU is sm100"),
        (FA4, (8, 6), "FA4 runs on sm90 and later, this GPU is sm86"),
        (FA4, (9, 0), None),
        (FA2, (8, 0), None),
        (FA2, None, None),
    ],
)
def test_an_api_names_the_gpus_it_runs_on(spec, capability, reason) -> None:
    assert spec.cannot_run_on(capability) == reason


def test_fa4s_compile_warning_is_silenced_and_other_warnings_pass(tmp_path: Path) -> None:
    """FA4's CuTe DSL warns about one argument on every kernel compile, forward and backward (the backward in
    autograd's device thread on CUDA): dozens of lines above a check's table. Filtered once, when FA4 is found."""
    import warnings

    with planted(tmp_path, "fa4"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        FlashAttnBackend().forward(*_inputs())
        warnings.warn("Argument other cannot be converted to a JitArgument", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["Argument other cannot be converted to a JitArgument"]


def _key_mask() -> torch.Tensor:
    keep = torch.rand(2, 12, generator=torch.Generator().manual_seed(3)) > 0.4
    keep[0, 0] = True
    keep[1] = False  # an item with no key left: zeros and an LSE of -inf, as MATH gives
    return keep[:, None, None, :]


@pytest.mark.parametrize("kind", ["fa2", "fa3", "fa4"])
def test_a_key_padding_mask_runs_through_the_varlen_entry_like_math(tmp_path: Path, kind: str) -> None:
    """Each API's varlen entry called by keyword (FA4's takes ``qv`` fourth), with the LSE re-laid as ``[B, H, S]``;
    the gradients flow through the packing."""
    mask = _key_mask()
    with planted(tmp_path, kind):
        leaves = [t.requires_grad_() for t in _inputs()]
        out, lse = FlashAttnBackend().forward(*leaves, softmax_scale=0.3, return_lse=True, attn_mask=mask)
        assert importlib.import_module(APIS[kind][1]).CALLS[-1].get("varlen")
        out.float().square().sum().backward()
    exact = [t.detach().clone().requires_grad_() for t in leaves]
    ref, ref_lse = MathBackend().forward(*exact, softmax_scale=0.3, return_lse=True, attn_mask=mask)
    ref.float().square().sum().backward()
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse[0], ref_lse[0], atol=1e-3, rtol=1e-3)
    close = [torch.allclose(a.grad.float(), b.grad.float(), atol=3e-2, rtol=3e-2) for a, b in zip(leaves, exact)]
    assert close == [True, True, True]  # dq, dk, dv


def test_an_api_without_a_varlen_entry_refuses_a_key_mask(tmp_path: Path) -> None:
    with planted(tmp_path, "fa4_lse_log2"):  # a flash_attn_func alone
        with pytest.raises(KernelRefused, match="has no flash_attn_varlen_func"):
            FlashAttnBackend().forward(*_inputs(), attn_mask=_key_mask())
