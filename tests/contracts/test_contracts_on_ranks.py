"""Contracts on real gloo groups through the plugin's session pools: they pass on the reference
and fail, with their figures, on deliberately broken targets."""

from __future__ import annotations

import importlib.util

import pytest

from harness.contracts.bounds import fp32_ulp
from harness.contracts.case import make_case
from harness.contracts.runner import NotRun, RunOptions, precheck, run_cases
from harness.errors import ConfigError
from harness.ranks import PoolSet
from harness.results import FAILED, NOT_APPLICABLE, PASSED, SKIPPED
from harness.targets.base import Refusal, Refused, Target
from harness.targets.spec import TargetSpec
from harness.targets.yunchang import CUDA_ONLY, NOT_INSTALLED, YunchangTarget

pytestmark = pytest.mark.timeout(300)

SGLANG = dict(world_size=2, batch=1, tokens_per_rank=64, heads=30, head_dim=128, replicated=6, dtype="bf16")
ROTATING = "tests.targets.rotating_suffix:factory"


def _run(rank_pools, contract_id, target="reference", **params):
    [verdict] = run_cases(
        [make_case(contract_id, params, case_id=contract_id, source="test")],
        RunOptions(TargetSpec(target), allow_new_skips=True),
        rank_pools,
    )
    return verdict


def test_sglang_case_on_the_reference(assert_contract):
    suffix = assert_contract("usp.replicated_suffix_bitwise", **SGLANG)
    assert suffix.figures["bitwise"] is True and suffix.figures["max_abs"] == 0.0
    assert suffix.figures["elements"] == 2 * (64 + 6) * 30 * 128  # both ranks: shard and suffix
    assert suffix.kernel.startswith("torch_sdpa")
    prefix = assert_contract("usp.replicated_prefix_drift", **SGLANG)
    assert 0.0 < prefix.figures["max_abs"] <= 1e-2  # bf16 reordering drifts, within sglang's bound
    assert prefix.bound == "max|out − ref| ≤ 0.01"


def test_rotating_the_suffix_to_the_front_is_caught(rank_pools):
    suffix = _run(rank_pools, "usp.replicated_suffix_bitwise", ROTATING, **SGLANG)
    assert suffix.status == FAILED
    assert suffix.figures["bitwise"] is False
    assert suffix.figures["mismatched"] > 0 and suffix.figures["max_abs"] > 0
    assert suffix.reason.startswith("not bitwise:")
    assert "suffix rotated to the front" in suffix.kernel
    assert _run(rank_pools, "usp.replicated_prefix_drift", ROTATING, **SGLANG).status == PASSED


@pytest.mark.parametrize(
    ("contract_id", "params"),
    [
        ("usp.ulysses_parity", dict(heads=8, kv_heads=2, causal=True, dtype="bf16")),
        ("usp.ring_parity", dict(causal=True, dtype="bf16")),
        ("usp.replicated_kv_prefix", dict(heads=4, replicated=3, dtype="bf16")),
        ("usp.varlen_parity", dict(seq_lens=[16, 5], causal=True)),
        ("usp.masked_parity", dict(mask="dense", heads=4, kv_heads=2)),
        ("usp.masked_rejects_replicated", dict(replicated=2)),
        ("usp.skip_sequence_parallel_local", {}),
    ],
    ids=[
        "ulysses-gqa-causal-bf16",
        "ring-causal-bf16",
        "kv_prefix-3-bf16",
        "varlen-16+5-causal",
        "masked-dense-gqa",
        "masked-rejects-replicated-2",
        "skip-sp-local",
    ],
)
def test_sp_paths_pass_on_the_reference(assert_contract, contract_id, params):
    verdict = assert_contract(contract_id, world_size=2, **params)
    assert verdict.status == PASSED


def test_ring_bf16_is_judged_against_the_naive_bf16_error(assert_contract):
    ring = assert_contract("usp.ring_parity", world_size=2, dtype="bf16")
    scaled_floor = 16 * fp32_ulp(ring.figures["ref64_max"])
    assert (
        ring.figures["err_ref64"]
        <= ring.figures["allowed"]
        == 2 * ring.figures["naive_err_ref64"] + 1e-6 + scaled_floor
    )
    assert ring.figures["naive_err_ref64"] > 1e-3  # the naive bf16 reference really is low precision


def test_backend_precedence_on_one_rank(assert_contract):
    verdict = assert_contract("backend.selection_precedence")
    assert verdict.figures == {"checks": 16, "failed_checks": 0}


def test_perturbed_sp_output_fails_bitwise_and_the_fa_rule(rank_pools):
    target = "tests.targets.broken:perturbed"
    ulysses = _run(rank_pools, "usp.ulysses_parity", target, world_size=2)
    assert ulysses.status == FAILED and ulysses.reason.startswith("not bitwise")
    ring = _run(rank_pools, "usp.ring_parity", target, world_size=2)
    assert ring.status == FAILED and "max|out − ref64| = 5.0" in ring.reason
    assert ring.figures["err_ref64"] > ring.figures["allowed"]


def test_nan_fails_even_a_loose_bound(rank_pools):
    verdict = _run(
        rank_pools, "usp.replicated_prefix_drift", "tests.targets.broken:nan_output", world_size=2, bound="abs:1e9"
    )
    assert verdict.status == FAILED
    assert verdict.reason.startswith("non-finite values: 2 in the output, 0 in the reference")  # one per rank
    assert "sharded output vs float64 attention: non-finite values" in verdict.reason  # the oracle sees it too


def test_a_swallowed_guard_is_caught(rank_pools):
    verdict = _run(rank_pools, "usp.masked_rejects_replicated", "tests.targets.broken:swallows_guard", world_size=2)
    assert verdict.status == FAILED
    assert "every rank: attn_mask with num_replicated_suffix=6 ran instead of being refused" in verdict.reason
    assert verdict.figures["failed_checks"] == 3


@pytest.mark.parametrize(
    ("target", "rule"),
    [
        (
            "no_kernel",
            "make_attention() returned _NoKernel, whose .kernel has none: an attention names its kernel as a str",
        ),
        ("returns_with_lse", "whose call returned a tuple of 2: attention(q, k, v) returns the output tensor alone"),
    ],
)
def test_a_target_that_breaks_the_attention_interface_is_told_which_rule(rank_pools, target, rule):
    verdict = _run(rank_pools, "usp.ulysses_parity", f"tests.targets.broken:{target}", world_size=2)
    assert verdict.status == FAILED
    raised = f" raised: harness.targets.interface.InterfaceError: target '{target}': "
    # every rank raises it; whichever the launcher hears first is named (rank 1 under load)
    assert verdict.reason.startswith((f"rank 0{raised}", f"rank 1{raised}")) and rule in verdict.reason


def test_capabilities_that_are_not_a_set_are_refused_before_any_rank_starts():
    from harness.targets.loader import load_target

    with pytest.raises(ConfigError, match="capabilities\\(\\) must return a frozenset of capability names, not str"):
        load_target(TargetSpec("tests.targets.broken:string_capabilities"))


def test_ring_admission_exercises_the_layer_check(rank_pools):
    verdict = _run(rank_pools, "usp.ring_admission", "tests.targets.no_lse_backend:factory", world_size=2)
    assert verdict.status == PASSED, verdict.reason
    assert "needs a backend that returns the log-sum-exp; sage_attn does not" in verdict.figures["refusal"]
    on_cpu = _run(rank_pools, "usp.ring_admission", world_size=2)
    assert on_cpu.status == SKIPPED and "sageattention package is not installed" in on_cpu.reason


def test_unavailable_backend_skips_and_unknown_backend_is_a_configuration_error(rank_pools):
    skipped = _run(rank_pools, "usp.ulysses_parity", world_size=2, backend="fa")
    assert skipped.status == SKIPPED and "no usable flash-attn: FA4: flash_attn.cute is not installed" in skipped.reason
    pids = rank_pools.get(2).pids
    with pytest.raises(ConfigError) as info:  # refused before any rank runs it (was: a failed case with a traceback)
        _run(rank_pools, "usp.ulysses_parity", world_size=2, backend="nope")
    assert (info.value.path, info.value.key) == ("test", "cases.usp.ulysses_parity.backend")
    assert "unknown attention backend 'nope'; valid names: torch_sdpa, fa, sage_attn, math" in str(info.value)
    assert rank_pools.get(2).pids == pids


def test_a_pinned_sdpa_kernel_that_cannot_run_here_skips(rank_pools):
    verdict = _run(rank_pools, "usp.ulysses_parity", world_size=2, sdpa_kernel="cudnn")  # no cudnn kernel on the CPU
    assert verdict.status == SKIPPED and verdict.reason.startswith("torch SDPA kernel cudnn cannot run this case here")


def test_a_dead_rank_fails_its_case_and_the_pool_recovers(rank_pools):
    dead = _run(rank_pools, "backend.selection_precedence", "tests.targets.broken:dies")
    assert dead.status == FAILED and "rank 0 (pid" in dead.reason and "exited with code 3" in dead.reason
    assert _run(rank_pools, "backend.selection_precedence").status == PASSED  # a fresh group, transparently


def test_one_persistent_pool_per_world_size(rank_pools):
    pids = rank_pools.get(2).pids
    _run(rank_pools, "usp.ulysses_parity", world_size=2)
    _run(rank_pools, "usp.ring_parity", world_size=2)
    assert rank_pools.get(2).pids == pids and len(pids) == 2


class _NoPools(PoolSet):
    def get(self, world: int):
        raise AssertionError("a skipped target must not start ranks")

    def prestart(self, world_sizes):
        assert not list(world_sizes), "a skipped target must not start ranks"


def test_yunchang_is_skipped_with_the_reason_without_starting_ranks():
    cases = [make_case("usp.ulysses_parity", {"world_size": 2}, case_id="u", source="test")]
    [verdict] = run_cases(cases, RunOptions(TargetSpec("yunchang"), allow_new_skips=True), _NoPools())
    said = NOT_INSTALLED if importlib.util.find_spec("yunchang") is None else CUDA_ONLY  # installed: not on a CPU
    assert verdict.status == SKIPPED and verdict.reason.startswith(f"target yunchang: {said}")


class _InstalledYunchang(YunchangTarget):
    """yunchang as if installed: what remains is what it declares."""

    def unavailable_reason(self, device: str) -> str | None:
        return None if device == "cuda" else CUDA_ONLY


def _prechecked(contract_id: str, world_size: int, target: Target, name: str, device: str = "cuda") -> NotRun | None:
    case = make_case(contract_id, {"world_size": world_size}, case_id="c", source="test")
    return precheck(case, target, RunOptions(TargetSpec(name), device=device))


def _lacking(not_run: NotRun | None) -> frozenset[str]:
    """The capabilities a precheck says the target lacks, in its words and in its typed cause alike."""
    assert not_run is not None and not_run.refused is not None and not_run.refused.kind == Refusal.LACKS
    assert f"does not support {', '.join(sorted(not_run.refused.lacks))} (" in not_run.reason
    return not_run.refused.lacks


def test_yunchang_declares_no_replicated_tokens_varlen_or_mask():
    target = _InstalledYunchang()
    assert _lacking(_prechecked("usp.replicated_suffix_bitwise", 2, target, "yunchang")) == {"replicated_suffix"}
    assert _lacking(_prechecked("usp.varlen_parity", 2, target, "yunchang")) == {"varlen"}
    assert _lacking(_prechecked("usp.masked_parity", 2, target, "yunchang")) == {"mask"}
    assert _prechecked("usp.hybrid_parity", 4, target, "yunchang") is None
    ulysses_only = _InstalledYunchang("ulysses")
    assert "ring" in _lacking(_prechecked("usp.hybrid_parity", 4, ulysses_only, "yunchang-ulysses"))
    on_cpu = _prechecked("usp.hybrid_parity", 4, target, "yunchang", device="cpu")
    assert on_cpu == NotRun(f"target yunchang: {CUDA_ONLY}", Refused(Refusal.UNAVAILABLE))


def test_assert_contract_fails_and_skips_the_test(assert_contract, request, monkeypatch):
    with pytest.raises(pytest.fail.Exception, match=r"(?s)not bitwise.*figures: \{'bitwise': False"):
        assert_contract("usp.replicated_suffix_bitwise", target=ROTATING, **SGLANG)
    monkeypatch.setattr(request.config.option, "parity_no_skip", False)  # a user's suite: what cannot run skips
    with pytest.raises(pytest.skip.Exception, match="sageattention package is not installed"):
        assert_contract("usp.ring_admission", world_size=2)
    monkeypatch.setattr(request.config.option, "parity_no_skip", True)  # parity's own suite: it fails
    with pytest.raises(pytest.fail.Exception, match="skipped, and this target was expected to run it: .*sageattention"):
        assert_contract("usp.ring_admission", world_size=2)


def test_model_contracts_judge_the_measured_paths(rank_pools):
    zimage = _run(rank_pools, "model.zimage_sp_parity", world_size=2, dtype="bf16")
    assert zimage.status == PASSED, zimage.reason
    assert set(zimage.figures["bounds"]) == {"block.image", "block.caption", "transformer", "transformer.masked"}
    assert "control.block.caption_as_prefix.image" in zimage.figures["paths"]  # reported, not judged
    assert zimage.figures["paths"]["control.block.caption_as_prefix.image"]["bitwise"] is False
    # The sharded-text path reorders keys: held to bitwise it must fail, naming the paths.
    hunyuan = _run(rank_pools, "model.hunyuan_sp_parity", world_size=2, dtype="bf16", varlen_bound="bitwise")
    assert hunyuan.status == FAILED
    assert "single.varlen.image: not bitwise" in hunyuan.reason and "transformer.varlen: not bitwise" in hunyuan.reason
    assert "suffix" not in hunyuan.reason and "masked" not in hunyuan.reason
    encoder = _run(rank_pools, "encoder.masked_causal_lengths", world_size=1)
    assert encoder.status == PASSED and encoder.figures["max_abs"] <= encoder.figures["bound"]
    on_a_test_target = _run(rank_pools, "encoder.fp8_parity", ROTATING)
    assert on_a_test_target.status == NOT_APPLICABLE and "reference_models" in on_a_test_target.reason
