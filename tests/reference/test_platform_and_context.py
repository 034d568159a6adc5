"""Forced platforms and the forward context."""

from __future__ import annotations

import pytest
import torch

from reference_impl import LocalAttention, USPAttention, current_platform, set_forward_context
from reference_impl.forward_context import get_forward_context
from reference_impl.platform import parse_platform_spec


def test_unforced_platform_is_the_hardware(monkeypatch):
    monkeypatch.delenv("PARITY_PLATFORM", raising=False)
    assert not current_platform.simulated
    if torch.cuda.is_available():
        assert current_platform.is_cuda_alike() and current_platform.device_type == "cuda"
    else:
        assert current_platform.kind in ("cpu", "mps")


@pytest.mark.parametrize(
    "spec, kind, arch, checks",
    [
        ("cuda", "cuda", None, ("is_cuda", "is_cuda_alike")),
        ("rocm:gfx950", "rocm", "gfx950", ("is_rocm", "is_cuda_alike")),
        ("mps", "mps", None, ("is_mps",)),
    ],
)
def test_forced_platform(monkeypatch, spec, kind, arch, checks):
    monkeypatch.setenv("PARITY_PLATFORM", spec)
    assert current_platform.kind == kind and current_platform.gcn_arch == arch
    really_here = kind == ("cuda" if torch.cuda.is_available() else "cpu")
    assert current_platform.simulated is not really_here
    assert {check: getattr(current_platform, check)() for check in checks} == dict.fromkeys(checks, True)
    assert ("simulated" in current_platform.label()) is not really_here
    if not torch.cuda.is_available():
        assert current_platform.device_type == "cpu"  # tensors stay on the real hardware


def test_rocm_is_not_cuda(monkeypatch):
    monkeypatch.setenv("PARITY_PLATFORM", "rocm:gfx942")
    assert not current_platform.is_cuda()


def test_bad_platform_spec():
    with pytest.raises(ValueError, match="unknown platform 'tpu'"):
        parse_platform_spec("tpu")
    with pytest.raises(ValueError, match="only rocm takes an arch"):
        parse_platform_spec("cuda:sm90")


@pytest.mark.parametrize("layer_type", [LocalAttention, USPAttention], ids=["local", "usp"])
def test_layers_need_a_forward_context(layer_type):
    q = torch.randn(1, 4, 2, 8)
    layer = layer_type(2, 8)
    with pytest.raises(RuntimeError, match=f"{layer_type.__name__} needs a forward context"):
        layer(q, q, q)
    with set_forward_context(current_timestep=3):
        assert layer(q, q, q).shape == q.shape


def test_forward_context_nests_and_restores():
    with set_forward_context(current_timestep=1):
        with set_forward_context(current_timestep=2, attn_metadata="m"):
            assert get_forward_context().current_timestep == 2
        assert get_forward_context().current_timestep == 1
    with pytest.raises(RuntimeError):
        get_forward_context()
