"""Recalibration policy against hand-computed numbers; loosening is never silent."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.baselines.perf import PerfBaselines, Tolerances
from harness.baselines.thresholds import ThresholdSet
from harness.errors import ConfigError
from harness.recalibrate import (
    DEFAULT_POLICY,
    LooseningRefused,
    NoiseRefused,
    Rule,
    apply_perf_proposals,
    apply_proposals,
    load_policy,
    merge_into_overlay,
    perf_proposal_rows,
    proposal_rows,
    propose_perf,
    propose_thresholds,
)
from harness.results import load_results, parse_results

BASE = Path(__file__).resolve().parents[1] / "data" / "sglang" / "consistency_threshold.json"


@pytest.mark.parametrize(
    ("metric", "worst", "expected"),
    [
        ("clip", 0.9931, 0.9731),  # worst - 0.02
        ("clip", 0.9999, 0.9799),  # worst - 0.02 is already below the 0.98 cap
        ("clip", 1.0, 0.98),  # identical images: the cap binds
        ("ssim", 0.97, 0.93),  # worst - 0.04
        ("ssim", 0.999, 0.95),  # 0.959 capped at 0.95
        ("psnr", 28.4, 25.4),  # worst - 3 dB
        ("psnr", 40.0, 30.0),  # 37 capped at 30
        ("psnr", math.inf, 30.0),  # identical images: inf - 3 = inf, capped
        ("mean_abs_diff", 0.5, 4.0),  # 3.5 floored at 4
        ("mean_abs_diff", 2.2, 5.2),  # worst + 3
    ],
)
def test_default_policy_by_hand(metric: str, worst: float, expected: float) -> None:
    assert DEFAULT_POLICY.threshold(metric, worst) == expected


def test_rounding_is_on_the_safe_side() -> None:
    # 4 decimals, down for lower bounds and up for mean_abs_diff: the worst run still passes
    assert DEFAULT_POLICY.threshold("psnr", 31.23456) == 28.2345
    assert DEFAULT_POLICY.threshold("mean_abs_diff", 4.00001) == 7.0001


def _results(*runs: dict[str, dict[str, float | str | None]], kind: str = "image") -> list[dict]:
    """Parsed results documents, one per run: {case_id: metrics}."""
    docs = []
    for run in runs:
        cases = {cid: {"kind": kind, "passed": True, "metrics": m} for cid, m in run.items()}
        docs.append(parse_results({"cases": cases}))
    return docs


def _m(clip: float | None, ssim: float | None, psnr: float | str | None, mad: float | None) -> dict:
    return {"clip": clip, "ssim": ssim, "psnr": psnr, "mean_abs_diff": mad}


def test_propose_uses_worst_over_runs_and_flags_loosening() -> None:
    current = ThresholdSet.load(BASE)  # flux_image_t2i: clip 0.92, ssim 0.95, psnr 24, mad 8
    results = _results(
        {"flux_image_t2i": _m(0.9931, 0.97, 28.4, 2.2)},
        {"flux_image_t2i": _m(0.9990, 0.99, "inf", 0.5)},
        {"flux_image_t2i": _m(None, 0.98, 35.0, 1.0)},  # clip skipped in this run: ignored
    )
    proposals = {p.metric: p for p in propose_thresholds(current, results)}
    clip, ssim, psnr, mad = (proposals[m] for m in ("clip", "ssim", "psnr", "mean_abs_diff"))
    assert (clip.old, clip.worst, clip.new, clip.loosens) == (0.92, 0.9931, 0.9731, False)
    assert (ssim.old, ssim.worst, ssim.new, ssim.loosens) == (0.95, 0.97, 0.93, True)  # 0.93 < 0.95
    assert (psnr.old, psnr.worst, psnr.new, psnr.loosens) == (24.0, 28.4, 25.4, False)
    assert (mad.old, mad.worst, mad.new, mad.loosens) == (8.0, 2.2, 5.2, False)
    rows = proposal_rows([ssim, psnr])
    assert rows == [
        ("flux_image_t2i", "ssim", "0.95", "0.97", "0.93", "LOOSENS"),
        ("flux_image_t2i", "psnr", "24", "28.4", "25.4", "tightens"),
    ]


def test_unknown_case_starts_from_kind_defaults_and_skipped_metrics_give_no_proposal() -> None:
    current = ThresholdSet.load(BASE)
    results = _results({"new_video": _m(None, 0.999, "inf", 0.5)}, kind="video")
    proposals = {p.metric: p for p in propose_thresholds(current, results)}
    assert "clip" not in proposals
    assert (proposals["psnr"].old, proposals["psnr"].new) == (24.0, 30.0)  # default_psnr_threshold_video
    assert (proposals["ssim"].old, proposals["ssim"].new) == (0.92, 0.95)


def test_apply_refuses_to_loosen_unless_allowed() -> None:
    current = ThresholdSet.load(BASE)
    results = _results({"flux_image_t2i": _m(0.9931, 0.97, 28.4, 9.5)})
    proposals = propose_thresholds(current, results)
    with pytest.raises(LooseningRefused) as info:
        apply_proposals(current, proposals)
    message = str(info.value)
    assert "flux_image_t2i.ssim: 0.95 -> 0.93" in message
    assert "flux_image_t2i.mean_abs_diff: 8 -> 12.5" in message
    assert "psnr" not in message  # tightening is not an offence
    assert isinstance(info.value, ConfigError)  # the CLI exits 2
    updated = apply_proposals(current, proposals, allow_loosen=True)
    t = updated.for_case("flux_image_t2i")
    assert (t.clip, t.ssim, t.psnr, t.mean_abs_diff) == (0.9731, 0.93, 25.4, 12.5)
    only_tightening = [p for p in proposals if not p.loosens]
    assert apply_proposals(current, only_tightening).for_case("flux_image_t2i").ssim == 0.95


def test_merge_into_overlay_writes_only_changes_and_keeps_backup(tmp_path: Path) -> None:
    overlay = tmp_path / "platforms" / "h100.json"
    current = ThresholdSet.load(BASE)
    results = _results({"flux_image_t2i": _m(0.9931, 0.999, 28.4, 5.0)})
    proposals = propose_thresholds(current, results)  # ssim 0.95 -> 0.95 and mad 8 -> 8: unchanged
    written = merge_into_overlay(overlay, proposals)
    assert written == {"cases": {"flux_image_t2i": {"clip_threshold": 0.9731, "psnr_threshold": 25.4}}}
    assert not overlay.with_name("h100.json.bak").exists()
    chain = ThresholdSet.load(BASE, [overlay]).for_case("flux_image_t2i")
    assert (chain.clip, chain.ssim, chain.psnr) == (0.9731, 0.95, 25.4)
    # a second machine's results for another case merge into the same overlay
    second_results = _results({"qwen_image_t2i": _m(0.995, 0.8, 20.0, 9.0)})  # ssim 0.83 -> 0.76 loosens
    second = propose_thresholds(ThresholdSet.load(BASE, [overlay]), second_results)
    merge_into_overlay(overlay, second, allow_loosen=True)
    doc = json.loads(overlay.read_text())
    assert set(doc["cases"]) == {"flux_image_t2i", "qwen_image_t2i"}
    assert json.loads(overlay.with_name("h100.json.bak").read_text()) == written
    with pytest.raises(LooseningRefused):
        merge_into_overlay(overlay, [p for p in second if p.loosens])


def test_policy_files(tmp_path: Path) -> None:
    toml = tmp_path / "policy.toml"
    toml.write_text("[psnr]\nmargin = 2\ncap = 35\n[mean_abs_diff]\nfloor = 1\n")
    policy = load_policy(toml)
    assert policy.psnr == Rule(2.0, 35.0) and policy.mean_abs_diff == Rule(3.0, 1.0)
    assert policy.clip == DEFAULT_POLICY.clip
    assert policy.threshold("psnr", 40.0) == 35.0 and policy.threshold("mean_abs_diff", 0.5) == 3.5
    js = tmp_path / "policy.json"
    js.write_text(json.dumps({"clip": {"margin": 0.01, "cap": 0.99}}))
    assert load_policy(js).threshold("clip", 0.9999) == 0.9899
    toml.write_text("[psnr\nmargin = 2\n")
    with pytest.raises(ConfigError, match="invalid TOML.*line 1") as info:
        load_policy(toml)
    assert info.value.path == str(toml)


GOOD_RESULTS = {
    "platform": "h100",
    "cases": {"c": {"kind": "image", "passed": False, "metrics": _m(0.99, 0.9, "inf", 1.0)}},
    "perf": {"s": {"expected_e2e_ms": 100.0}},
}


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        ({"pnsr": {"margin": 1}}, "pnsr"),
        ({"psnr": {"margin": 1, "floor": 3}}, "psnr.floor"),  # psnr has a cap, not a floor
        ({"clip": {"cap": 1.5}}, "clip.cap"),
        ({"ssim": {"margin": -0.1}}, "ssim.margin"),
        ({"ssim": {"margin": "0.1"}}, "ssim.margin"),
        ({"ssim": 0.04}, "ssim"),
    ],
    ids=["misspelt-metric", "psnr-floor", "clip-cap-past-1", "negative-margin", "string-margin", "not-a-table"],
)
def test_a_bad_policy_is_refused_naming_its_key(tmp_path: Path, doc: dict, key: str) -> None:
    js = tmp_path / "policy.json"
    js.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as info:
        load_policy(js)
    assert (info.value.path, info.value.key) == (str(js), key)


def test_load_results_decodes_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(GOOD_RESULTS))
    doc = load_results(path)
    assert doc["cases"]["c"]["metrics"]["psnr"] == math.inf
    assert parse_results(doc) == doc  # idempotent
    path.write_text('{"cases": {')
    with pytest.raises(ConfigError, match="malformed JSON at line 1") as info:
        load_results(path)
    assert info.value.path == str(path)


BROKEN_RESULTS = [
    (lambda d: d.pop("cases"), "cases"),
    (lambda d: d["cases"]["c"].__setitem__("kind", "audio"), "cases.c.kind"),
    (lambda d: d["cases"]["c"].__setitem__("passed", "yes"), "cases.c.passed"),
    (lambda d: d["cases"]["c"]["metrics"].pop("ssim"), "cases.c.metrics.ssim"),
    (lambda d: d["cases"]["c"]["metrics"].__setitem__("clip", "high"), "cases.c.metrics.clip"),
    (lambda d: d["perf"]["s"].__setitem__("expected_e2e_ms", "slow"), "perf.s.expected_e2e_ms"),
    (lambda d: d.__setitem__("platform", 3), "platform"),
]


@pytest.mark.parametrize(("mutate", "key"), BROKEN_RESULTS, ids=[key for _, key in BROKEN_RESULTS])
def test_a_broken_results_file_is_refused_naming_its_key(
    tmp_path: Path, mutate: Callable[[dict], object], key: str
) -> None:
    path = tmp_path / "results.json"
    doc = copy.deepcopy(GOOD_RESULTS)
    mutate(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as info:
        load_results(path)
    assert (info.value.path, info.value.key) == (str(path), key)


def test_conflicting_kinds_across_runs_are_refused_naming_both_files() -> None:
    runs = _results({"c": _m(0.99, 0.9, 30.0, 1.0)}) + _results({"c": _m(0.99, 0.9, 30.0, 1.0)}, kind="video")
    with pytest.raises(ConfigError) as info:
        propose_thresholds(ThresholdSet.load(BASE), runs, paths=["main/results.json", "pr/results.json"])
    assert str(info.value) == (
        "pr/results.json: key 'cases.c.kind': case 'c' is recorded as video here but as image in main/results.json"
    )


# ------------------------------------------------------------------------------------- perf

TOL = Tolerances(e2e=0.3, denoise_stage=0.15, non_denoise_stage=0.6, denoise_step=0.3, denoise_agg=0.3)
PERF = PerfBaselines.from_json(
    {
        "tolerances": {"pr_test": {"e2e": 0.3}},
        "scenarios": {
            "s": {
                "stages_ms": {"TextEncodingStage": 50.0, "DenoisingStage": 1000.0},
                "denoise_step_ms": {"0": 100.0},
                "expected_e2e_ms": 1200.0,
                "expected_avg_denoise_ms": 100.0,
                "estimated_full_test_time_s": 133.1,  # sglang's, kept through a rewrite
            }
        },
    }
)


def _perf_runs(*measured: dict) -> list[dict]:
    return [parse_results({"cases": {}, "perf": {"s": m}}) for m in measured]


def test_perf_median_margin_and_rounding_by_hand() -> None:
    runs = _perf_runs(
        {
            "expected_e2e_ms": 1290.0,
            "stages_ms": {"TextEncodingStage": 55.0, "DenoisingStage": 1111.11},
            "denoise_step_ms": {"0": 95.0, "1": 97.0},
            "expected_avg_denoise_ms": 96.0,
        },
        {
            "expected_e2e_ms": 1300.0,
            "stages_ms": {"TextEncodingStage": 58.0, "DenoisingStage": 1123.456},
            "denoise_step_ms": {"0": 89.0},
            "expected_avg_denoise_ms": 92.0,
        },
        {
            "expected_e2e_ms": 1000.0,
            "stages_ms": {"TextEncodingStage": 40.0, "DenoisingStage": 900.0},
            "denoise_step_ms": {"0": 91.0},
            "expected_avg_denoise_ms": 94.0,
        },
    )
    got = {p.metric: p for p in propose_perf(PERF, runs, TOL)}
    # e2e: median 1290, |1290 - 1200| / 1200 = 0.075 <= 0.3 / 3 = 0.1: unchanged
    e2e = got["expected_e2e_ms"]
    assert (e2e.median, e2e.new, e2e.changed, e2e.loosens) == (1290.0, 1200.0, False, False)
    # non-denoise stage: median 55, 0.1 <= 0.6 / 3 = 0.2: unchanged
    assert not got["stages_ms.TextEncodingStage"].changed
    # denoise stage: median 1111.11, 0.111 > 0.15 / 3 = 0.05: changed, 4 significant figures
    den = got["stages_ms.DenoisingStage"]
    assert (den.median, den.new, den.changed, den.loosens) == (1111.11, 1111.0, True, True)
    # step 0: median 91, 0.09 <= 0.1: unchanged; step 1: new value (one run), not a loosening
    assert not got["denoise_step_ms.0"].changed
    step1 = got["denoise_step_ms.1"]
    assert (step1.old, step1.new, step1.changed, step1.loosens) == (None, 97.0, True, False)
    # aggregate: median 94, 0.06 <= 0.1: unchanged
    assert not got["expected_avg_denoise_ms"].changed
    with pytest.raises(LooseningRefused, match=r"s\.stages_ms\.DenoisingStage: 1000 -> 1111"):
        apply_perf_proposals(PERF, list(got.values()))
    # the denoising stage's runs spread (1111.11 - 900) / 1111.11 = 19.0 % from their median: its 15 % is inside the noise
    assert den.spread == pytest.approx(211.11 / 1111.11) and den.inside_noise
    assert perf_proposal_rows([den]) == [
        ("s", "stages_ms.DenoisingStage", "1000", "1111.11", "1111", "±19.0% ≥ tol 15%", "LOOSENS")
    ]
    with pytest.raises(
        NoiseRefused,
        match=r"s\.stages_ms\.DenoisingStage: 1000 -> 1111 \(median 1111\.11\): runs spread "
        r"±19\.0%, tolerance 15\.0%",
    ):
        apply_perf_proposals(PERF, list(got.values()), allow_loosen=True)
    wider = {p.metric: p for p in propose_perf(PERF, runs, dataclasses.replace(TOL, denoise_stage=0.25))}
    updated = apply_perf_proposals(PERF, list(wider.values()), allow_loosen=True).scenario("s")
    assert updated is not None
    assert updated["stages_ms"] == {"TextEncodingStage": 50.0, "DenoisingStage": 1111.0}
    assert updated["denoise_step_ms"] == {"0": 100.0, "1": 97.0}
    assert updated["estimated_full_test_time_s"] == 133.1
    # every value's spread is written beside the values: e2e (1290 - 1000) / 1290, step 0 (95 - 91) / 91, step 1 one run
    assert updated["dispersion"]["expected_e2e_ms"] == round(290 / 1290, 3)
    assert (
        updated["dispersion"]["denoise_step_ms.0"] == round(4 / 91, 3)
        and updated["dispersion"]["denoise_step_ms.1"] == 0.0
    )


def test_perf_speedup_tightens_without_permission_and_new_scenarios_are_added() -> None:
    runs = [
        parse_results({"cases": {}, "perf": {"s": {"expected_e2e_ms": 601.234}, "fresh": {"expected_e2e_ms": 12345.6}}})
    ]
    got = {(p.scenario_id, p.metric): p for p in propose_perf(PERF, runs, TOL)}
    faster = got[("s", "expected_e2e_ms")]
    assert (faster.new, faster.changed, faster.loosens) == (601.2, True, False)
    fresh = got[("fresh", "expected_e2e_ms")]
    assert (fresh.old, fresh.new, fresh.loosens) == (None, 12350.0, False)
    updated = apply_perf_proposals(PERF, list(got.values()))
    assert updated.scenario("fresh") == {"expected_e2e_ms": 12350.0, "dispersion": {"expected_e2e_ms": 0.0}}
    assert updated.scenario("s")["expected_e2e_ms"] == 601.2  # type: ignore[index]


def test_runs_are_taken_raw_and_a_quiet_runner_writes() -> None:
    """Three gates whose e2e moved with the host (63.7 / 51.3 / 50.7 ms on one H200 host in an hour): the
    median is the middle gate's raw value, and their ±24 % spread is inside pr_test's 25 % only barely."""
    runs = _perf_runs({"expected_e2e_ms": 63.7}, {"expected_e2e_ms": 51.3}, {"expected_e2e_ms": 50.7})
    base = PerfBaselines.from_json({"tolerances": {}, "scenarios": {}})
    e2e = {p.metric: p for p in propose_perf(base, runs, TOL)}["expected_e2e_ms"]
    assert (e2e.median, e2e.spread, e2e.inside_noise) == (51.3, pytest.approx(12.4 / 51.3), False)
    assert apply_perf_proposals(base, [e2e]).scenario("s") == {
        "expected_e2e_ms": 51.3,
        "dispersion": {"expected_e2e_ms": 0.242},
    }
    tight = {p.metric: p for p in propose_perf(base, runs, dataclasses.replace(TOL, e2e=0.2))}["expected_e2e_ms"]
    with pytest.raises(NoiseRefused, match="inside the measured noise"):
        apply_perf_proposals(base, [tight])
