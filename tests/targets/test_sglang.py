"""The sglang target on real 2-rank gloo groups: sglang's own USPAttention, no mock of it.

Tests that run sglang skip with the reason when it does not import here (install it with
scripts/install-sglang-cpu.sh); the version, argument and case-file tests need no sglang.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version

from harness.cases import load_cases
from harness.cases.overlays import apply_target_overlay
from harness.contracts.case import Case
from harness.contracts.runner import RunOptions, run_cases
from harness.errors import ConfigError
from harness.paths import default_cases_dir
from harness.results import CaseResult
from harness.targets import CAPABILITIES, load_target
from harness.targets import sglang as sglang_target
from harness.targets.base import REFUSALS
from harness.targets.loader import BUILTIN_TARGETS
from harness.targets.spec import TargetSpec
from tests.targets import sglang_workers

ROTATED = (("layer", "tests.targets.sglang_rotated_suffix:RotatedSuffixUSPAttention"),)
OVERLAY = Path(default_cases_dir()) / "contracts" / "targets" / "sglang.toml"


@pytest.fixture(scope="session")
def sglang_ready() -> None:
    if sglang_target.installed_version() is None:
        pytest.skip(f"sglang is not installed ({sglang_target.INSTALL_HINT})")
    reason = sglang_target.import_error()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def cases() -> dict[str, Case]:
    return {case.id: case for case in load_cases(default_cases_dir())}


def _run(cases: dict[str, Case], ids: list[str], rank_pools, target_args=()) -> dict[str, CaseResult]:
    results = run_cases(
        [cases[i] for i in ids], RunOptions(TargetSpec("sglang", target_args), allow_new_skips=True), rank_pools
    )
    return {r.case_id: r for r in results}


# ------------------------------------------------------------------ no sglang needed


@pytest.mark.parametrize(
    "version,has_varlen,has_0_5_20",
    [
        ("0.5.17", False, False),
        ("0.5.18", True, False),
        ("0.5.19", True, False),
        ("0.5.20", True, True),
        ("0.5.23", True, True),
    ],
)
def test_capabilities_follow_the_installed_version(monkeypatch, version, has_varlen, has_0_5_20):
    monkeypatch.setattr(sglang_target, "installed_version", lambda: Version(version))
    caps = sglang_target.SglangTarget().capabilities()
    assert caps <= set(CAPABILITIES)
    assert ("varlen" in caps) is has_varlen and ("ring_replicated" in caps) is has_varlen  # both from 0.5.18
    assert ("masked_replicated_prefix" in caps) is has_0_5_20 and ("backend_choice" in caps) is has_0_5_20
    assert {"ulysses", "ring", "gqa", "causal", "mask", "replicated_suffix"} <= caps
    assert sglang_target.SglangTarget().version() == version


def test_unavailable_reasons(monkeypatch):
    target = sglang_target.SglangTarget()
    monkeypatch.setattr(sglang_target, "installed_version", lambda: None)
    assert target.unavailable_reason("cpu") == f"sglang is not installed ({sglang_target.INSTALL_HINT})"
    assert "scripts/install-sglang-cpu.sh" in sglang_target.INSTALL_HINT
    assert target.capabilities() == frozenset()
    monkeypatch.setattr(sglang_target, "installed_version", lambda: Version("0.5.15"))
    assert (
        target.unavailable_reason("cpu")
        == "sglang 0.5.15 is older than 0.5.16, the oldest USPAttention this adapter is written for"
    )
    monkeypatch.setattr(sglang_target, "installed_version", lambda: Version("0.5.23"))
    assert target.unavailable_reason("mps") == "the sglang target runs on cpu or cuda, not mps"
    monkeypatch.setattr(sglang_target, "import_error", lambda: "sglang 0.5.23 is installed but ... does not import: X")
    assert target.unavailable_reason("cpu") == "sglang 0.5.23 is installed but ... does not import: X"
    monkeypatch.setattr(sglang_target, "import_error", lambda: None)
    assert target.unavailable_reason("cpu") is None


def test_registered_as_builtin():
    assert BUILTIN_TARGETS["sglang"][:2] == ("harness.targets.sglang", "factory")
    assert isinstance(load_target(TargetSpec("sglang")), sglang_target.SglangTarget)


@pytest.mark.parametrize(
    "layer,message",
    [
        ("no_colon", "'no_colon' must be MODULE:CLASS"),
        ("nosuch_module_xyz:Layer", "cannot import module 'nosuch_module_xyz'"),
        ("harness.targets.sglang:not_there", "module 'harness.targets.sglang' has no class 'not_there'"),
        (
            "harness.targets.sglang:SglangAttention",
            "does not look like sglang's USPAttention: its constructor lacks num_heads, head_size",
        ),
    ],
)
def test_layer_argument_errors_name_the_argument(layer, message):
    with pytest.raises(ConfigError) as info:
        load_target(TargetSpec("sglang", (("layer", layer),)))
    assert message in str(info.value) and info.value.key == "--target-arg layer"


def test_unknown_target_argument():
    with pytest.raises(ConfigError, match=r"does not take \['flavour'\]"):
        load_target(TargetSpec("sglang", (("flavour", "x"),)))


def _overlaid(cases: dict[str, Case], version: str) -> dict[str, Case]:
    return {c.id: c for c in apply_target_overlay(list(cases.values()), OVERLAY, Version(version))}


def test_overlay_carries_the_version_facts(cases):
    """cases/contracts/targets/sglang.toml, read by parity's own loader, at three installed versions."""
    guard = "masked_rejects_replicated[world_size=2]"
    divergences = ("masked_gqa", "masked_causal", "masked_causal_gqa[mask=dense,dtype=bf16]")
    now = _overlaid(cases, "0.5.23")
    assert now[guard].params["refused"] == ["suffix", "kv_prefix"]  # PR #36735
    assert all("sglang 0.5.23" in now[i].expected_failure.describe() for i in divergences)
    assert (
        now["sglang_suffix_w2"].expected_failure is None
        and now["masked_rejects_replicated_legal_prefix"].expected_failure is None
    )
    old = _overlaid(cases, "0.5.17")
    assert old[guard].params["refused"] == ["prefix", "suffix", "kv_prefix"]
    assert (
        "PR #33923" in old["sglang_suffix_w2"].expected_failure.describe()
        and "PR #33923" in old["suffix[world_size=4,causal=true]"].expected_failure.describe()
    )
    assert old["suffix[world_size=1,causal=false]"].expected_failure is None  # one rank: nothing to rotate
    # before PR #36735 the legal prefix cannot be expressed: pinned skips there, never an expected failure that cannot fire
    legal_prefix = ("masked_rejects_replicated_legal_prefix", "masked_prefix[world_size=2]")
    assert {
        c: (old[c].expected_failure, "PR #36735" in old[c].expected_skip.because, now[c].expected_skip)
        for c in legal_prefix
    } == (dict.fromkeys(legal_prefix, (None, True, None)))
    assert "PR #33923" in old["varlen[world_size=2,causal=false]"].expected_skip.because
    # 0.5.17's own divergences, fixed in 0.5.18 (measured: docs/targets/versions.md)
    fixed = (guard, "skip_sequence_parallel_local_ring")
    then = _overlaid(cases, "0.5.18")
    assert {
        c: ("before 0.5.18" in old[c].expected_failure.describe(), then[c].expected_failure) for c in fixed
    } == dict.fromkeys(fixed, (True, None))
    assert _overlaid(cases, "0.5.18")["varlen[world_size=2,causal=false]"].expected_skip is None
    later = _overlaid(cases, "0.5.24")  # unknown yet: judged as any case, so a fix or a regression shows
    assert all(later[i].expected_failure is None for i in divergences)


# ------------------------------------------------------------------ sglang on 2 gloo ranks


def test_parity_case_passes(sglang_ready, cases, rank_pools):
    verdicts = _run(cases, ["sglang_suffix_w2", "sglang_prefix_w2"], rank_pools)
    suffix, prefix = verdicts["sglang_suffix_w2"], verdicts["sglang_prefix_w2"]
    assert suffix.passed and suffix.figures["bitwise"] and suffix.figures["elements"] == 537_600, suffix.reason
    assert suffix.kernel.startswith(f"sglang {sglang_target.installed_version()} USPAttention: TORCH_SDPA")
    assert prefix.passed and 0 < prefix.figures["max_abs"] <= 1e-2, prefix.reason


def test_rotated_suffix_layer_fails_suffix_bitwise_not_prefix_drift(sglang_ready, cases, rank_pools):
    verdicts = _run(cases, ["sglang_suffix_w2", "sglang_prefix_w2"], rank_pools, ROTATED)
    suffix, prefix = verdicts["sglang_suffix_w2"], verdicts["sglang_prefix_w2"]
    assert suffix.status == "failed" and "RotatedSuffixUSPAttention" in suffix.kernel
    assert 0 < suffix.figures["mismatched"] < suffix.figures["elements"] == 537_600
    assert 0 < suffix.figures["max_abs"] <= 1e-2  # a reordered reduction, not a wrong result
    assert suffix.reason.startswith(f"not bitwise: {suffix.figures['mismatched']} of 537600 elements differ")
    assert prefix.passed, prefix.reason
    version = load_target(TargetSpec("sglang", ROTATED)).version()
    assert version == f"{sglang_target.installed_version()}, layer {ROTATED[0][1]}"  # results name the layer that ran


@pytest.mark.parametrize(
    ("layer", "status"),
    [(None, "passed"), ("tests.targets.sglang_masked_scale:MaskedScaleDroppedUSPAttention", "failed")],
)
def test_a_masked_sp_path_dropping_the_scale_fails_the_scale_case(sglang_ready, cases, rank_pools, layer, status):
    case = "scale_masked[world_size=2,mask=key_padding]"
    result = _run(cases, [case], rank_pools, (("layer", layer),) if layer else ())[case]
    assert result.status == status, result.reason
    assert ("it ignores the softmax scale 0.3" in (result.reason or "")) == (status == "failed"), result.reason


def test_refusals_carry_sglangs_text_and_a_kind(sglang_ready, rank_pool):
    found, other = rank_pool(2).run(sglang_workers.refusals)
    assert found == other  # identical on every rank
    assert {kind for kind, _ in filter(None, found.values())} <= set(REFUSALS)
    assert (
        found["ring"][0] == "ring_needs_lse"
        and "Ring Attention requires a backend whose kernel exposes the softmax LSE" in found["ring"][1]
    )
    replicated = ("num_replicated_suffix", "num_replicated_kv_prefix")
    said = "masked path does not support replicated prefix/suffix tokens"
    assert {k: (found[k][0], said in found[k][1]) for k in replicated} == dict.fromkeys(
        replicated, ("mask_with_replicated", True)
    ), found
    assert found["num_replicated_prefix"] is None  # legal since PR #36735 (0.5.20)
    assert found["dense_mask"][0] == "unsupported" and "expects a [B, S_local] key mask" in found["dense_mask"][1]
    assert found["sdpa_kernel"][0] == "backend_unavailable"


def test_a_layer_that_crashes_under_ring_fails_instead_of_passing_for_a_refusal(sglang_ready, rank_pool):
    assert rank_pool(2).run(sglang_workers.crash_under_ring) == ["RuntimeError", "RuntimeError"]


@pytest.mark.parametrize(
    ("params", "key", "words"),
    [
        ({"backend": "no_such_backend"}, "backend", "no attention backend 'no_such_backend'"),
        ({"sdpa_kernel": "math"}, "sdpa_kernel", "cannot pin torch SDPA"),
    ],
    ids=["backend", "sdpa_kernel"],
)
def test_a_backend_name_sglang_lacks_is_refused_before_any_rank_starts(sglang_ready, params, key, words):
    from harness.contracts.case import make_case
    from harness.contracts.runner import validate_for_target
    from harness.errors import ConfigError
    from harness.targets.sglang import SglangTarget

    case = make_case("usp.ulysses_parity", {"world_size": 2, **params}, case_id="u", source="f.toml")
    with pytest.raises(ConfigError, match=words) as info:
        validate_for_target([case], SglangTarget())
    assert info.value.key == f"cases.u.{key}"


def test_refusals_become_skips_and_checked_refusals(sglang_ready, cases, rank_pools):
    ring, dense, stock, legal, masked_prefix = (
        "ring[dtype=bf16,causal=false]",
        "masked[world_size=2,mask=dense]",
        "masked_rejects_replicated[world_size=2]",
        "masked_rejects_replicated_legal_prefix",
        "masked_prefix[world_size=2]",
    )
    verdicts = _run(cases, [ring, dense, stock, legal, masked_prefix], rank_pools)
    assert verdicts[ring].status == "skipped" and "Ring Attention requires a backend" in verdicts[ring].reason
    assert verdicts[dense].status == "skipped" and "expects a [B, S_local] key mask" in verdicts[dense].reason
    # the stock guard expects the prefix refused too: out of date for sglang >= 0.5.20 (targets/sglang.toml overrides it)
    assert verdicts[stock].status == "failed"
    assert verdicts[stock].reason == "every rank: attn_mask with num_replicated_prefix=4 ran instead of being refused"
    assert verdicts[legal].passed and verdicts[legal].figures["failed_checks"] == 0, verdicts[legal].reason
    assert verdicts[masked_prefix].passed and verdicts[masked_prefix].figures["bitwise"], verdicts[masked_prefix].reason


def test_masked_gqa_is_a_bug_not_a_refusal(sglang_ready, cases, rank_pools):
    verdicts = _run(cases, ["masked_gqa", "masked_causal_gqa[mask=key_padding,dtype=bf16]"], rank_pools)
    reason = "rank 0 raised: RuntimeError: The size of tensor a (8) must match the size of tensor b (2) at non-singleton dimension 1"
    got = {c: (v.status, v.reason, "scaled_dot_product_attention" in v.traceback) for c, v in verdicts.items()}
    assert got == dict.fromkeys(verdicts, ("failed", reason, True))


def test_causal_with_a_mask_passes_self_comparison_and_fails_the_oracle(sglang_ready, cases, rank_pools):
    result = _run(cases, ["masked_causal"], rank_pools)["masked_causal"]
    assert result.status == "failed" and result.figures["bitwise"]  # one rank and SP agree: both non-causal
    outputs = ("sharded", "single-rank")
    oracle = result.figures["oracle"]
    assert {o: oracle[o]["err_ref64"] > 10 * oracle[o]["allowed"] for o in outputs} == dict.fromkeys(outputs, True), (
        oracle
    )
    assert [o for o in outputs if f"{o} output vs float64 attention" not in result.reason] == [], result.reason
    assert "(it ignores causal: it matches non-causal attention)" in result.reason


def test_causal_with_any_mask_is_not_causal(sglang_ready, rank_pool):
    """sglang's causal layer ignores causality once a mask is given, even an all-true one, on one rank and under SP."""
    ranks = rank_pool(2).run(sglang_workers.causal_with_mask)
    labels = ("one_rank_mask", "sp_mask")
    seen = [
        (
            f["one_rank_no_mask_vs_causal"] < 1e-5,
            {lab: (f[f"{lab}_vs_causal"] > 0.1, f[f"{lab}_vs_non_causal"] < 1e-5) for lab in labels},
        )
        for f in ranks
    ]
    assert seen == [(True, dict.fromkeys(labels, (True, True)))] * 2, ranks


def test_the_ulysses_exchange_is_what_drops_the_autograd_graph(sglang_ready, rank_pool):
    """Why the overlay pins every gradient case (`*_grad*`): sglang's all-to-all (usp.py `_usp_all_to_all_single`) is a
    c10d collective into a preallocated buffer, which autograd does not record; one rank, with no exchange,
    differentiates. When a release makes the exchange differentiable this fails: declare `backward` then."""
    seen = rank_pool(2).run(sglang_workers.autograd_graphs)
    assert seen == [{"one_rank": True, "ulysses": False, "exchange": False}] * 2
