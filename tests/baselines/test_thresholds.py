"""sglang's consistency-threshold files load unchanged, merge as overlays, round-trip, and bad
files fail with the file and the key path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.baselines.thresholds import Thresholds, ThresholdSet
from harness.errors import ConfigError

DATA = Path(__file__).resolve().parents[1] / "data" / "sglang"
BASE = DATA / "consistency_threshold.json"
H100 = DATA / "consistency_thresholds" / "h100.json"
GFX1250 = DATA / "consistency_thresholds" / "gfx1250.json"


def test_base_file_loads_unchanged_with_counts_and_values() -> None:
    ts = ThresholdSet.load(BASE)
    assert len(ts.case_ids) == 42
    assert ts.for_case("flux_image_t2i") == Thresholds(clip=0.92, ssim=0.95, psnr=24.0, mean_abs_diff=8.0)
    assert ts.for_case("qwen_image_t2i").psnr == 16.0
    # the integer psnr_threshold (19) is accepted and read as a float
    t = ts.for_case("flux_2_image_t2i_2_gpus")
    assert t.psnr == 19.0 and isinstance(t.psnr, float)
    assert t.source["psnr"] == f"{BASE}:cases.flux_2_image_t2i_2_gpus.psnr_threshold"


def test_unknown_case_falls_back_to_kind_defaults() -> None:
    ts = ThresholdSet.load(BASE)
    assert ts.for_case("not_a_case", "image") == Thresholds(0.92, 0.95, 28.0, 8.0)
    video = ts.for_case("not_a_case", "video")
    assert video == Thresholds(0.9, 0.92, 24.0, 10.0)
    assert video.source["ssim"] == f"{BASE}:default_ssim_threshold_video"


def test_h100_platform_file_with_extra_keys() -> None:
    ts = ThresholdSet.load(H100)
    assert len(ts.case_ids) == 45
    assert ts.for_case("flux_image_t2i") == Thresholds(0.97, 0.95, 24.0, 5.5)
    assert ts.for_case("ltx_2_3_hq_pipeline", "video") == Thresholds(0.995, 0.995, 50.0, 0.5)
    doc = ts.to_json()
    assert doc["default_audio_spectral_similarity_threshold"] == 0.95  # kept, not refused
    assert doc["default_audio_duration_diff_threshold"] == 0.1


def test_gfx1250_overlay_on_h100_keeps_every_h100_value() -> None:
    h100 = ThresholdSet.load(H100)
    chain = ThresholdSet.load(H100, [GFX1250])
    assert chain.case_ids == h100.case_ids
    every = [(case_id, kind) for case_id in h100.case_ids for kind in ("image", "video")]
    assert {key: chain.for_case(*key) for key in every} == {key: h100.for_case(*key) for key in every}
    merged = chain.to_json()
    assert merged["_comment"].startswith("MI455x / gfx1250")  # the overlay's comment wins
    assert merged["cases"] == json.loads(H100.read_text())["cases"]


def test_h100_as_overlay_on_base_merges_key_by_key(tmp_path: Path) -> None:
    chain = ThresholdSet.load(BASE, [H100])
    assert len(chain.case_ids) == 42 + 6  # h100 adds six cases, keeps three it lacks
    assert chain.for_case("flux_image_t2i").clip == 0.97  # from h100
    assert chain.for_case("layerwise_offload").source["clip"].startswith(str(BASE))  # only in base
    # a partial overlay: one key of one case; the other keys keep the base value
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"cases": {"flux_image_t2i": {"psnr_threshold": 30}}}))
    t = ThresholdSet.load(BASE, [partial]).for_case("flux_image_t2i")
    assert (t.clip, t.ssim, t.psnr, t.mean_abs_diff) == (0.92, 0.95, 30.0, 8.0)
    assert t.source["psnr"] == f"{partial}:cases.flux_image_t2i.psnr_threshold"
    assert t.source["ssim"] == f"{BASE}:cases.flux_image_t2i.ssim_threshold"


@pytest.mark.parametrize("path", [BASE, H100, GFX1250], ids=lambda p: p.name)
def test_round_trip_is_byte_identical(path: Path, tmp_path: Path) -> None:
    ts = ThresholdSet.load(path)
    assert ts.to_json() == json.loads(path.read_text())
    out = tmp_path / path.name
    ts.save(out)
    assert out.read_bytes() == path.read_bytes()
    assert ThresholdSet.load(out).to_json() == ts.to_json()


def test_with_values_writes_into_top_layer_and_save_keeps_backup(tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    base.write_bytes(BASE.read_bytes())
    ts = ThresholdSet.load(base).with_values({("flux_image_t2i", "psnr"): 25.5, ("new_case", "clip"): 0.9})
    assert ts.for_case("flux_image_t2i").psnr == 25.5
    assert ts.for_case("new_case").clip == 0.9 and ts.for_case("new_case").ssim == 0.95  # rest: defaults
    ts.save(base)
    assert (tmp_path / "base.json.bak").read_bytes() == BASE.read_bytes()
    reloaded = json.loads(base.read_text())
    assert reloaded["cases"]["flux_image_t2i"]["psnr_threshold"] == 25.5
    assert reloaded["_comment"] == json.loads(BASE.read_text())["_comment"]
    with pytest.raises(ConfigError, match=r"cases\.x\.ssim_threshold"):
        ts.with_values({("x", "ssim"): 1.5})


def _write(tmp_path: Path, doc: object) -> Path:
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return p


@pytest.mark.parametrize(
    ("doc", "key", "message"),
    [
        ({"cases": {"flux_image_t2i": {"psnr_threshold": "24"}}}, "cases.flux_image_t2i.psnr_threshold", "number"),
        ({"cases": {"flux_image_t2i": {"psnr_threshold": True}}}, "cases.flux_image_t2i.psnr_threshold", "boolean"),
        ({"cases": {"flux_image_t2i": {"psnr_threshold": -1}}}, "cases.flux_image_t2i.psnr_threshold", "minimum"),
        ({"cases": {"c": {"ssim_threshold": 1.2}}}, "cases.c.ssim_threshold", "maximum"),
        ({"cases": {"c": {"clip_threshold": -0.1}}}, "cases.c.clip_threshold", "minimum"),
        ({"cases": {"c": [0.9]}}, "cases.c", "object"),
        ({"cases": []}, "cases", "object"),
        ({"default_ssim_threshold_video": "high"}, "default_ssim_threshold_video", "number"),
        ('{"cases": {"c": {"psnr_threshold": NaN}}}', "cases.c.psnr_threshold", "finite"),
        ("[1, 2]", None, "root"),
    ],
)
def test_invalid_values_name_file_and_key(tmp_path: Path, doc: object, key: str | None, message: str) -> None:
    path = _write(tmp_path, doc)
    with pytest.raises(ConfigError, match=message) as info:
        ThresholdSet.load(path)
    assert info.value.path == str(path)
    assert info.value.key == key


def test_comments_and_sglangs_audio_bounds_are_kept(tmp_path: Path) -> None:
    doc = {
        "_note": "x",
        "cases": {"c": {"psnr_threshold": 20, "_why": [1], "audio_rms_db_diff_threshold": 2.0}},
        "default_audio_duration_diff_threshold": 0.1,
    }
    ts = ThresholdSet.load(_write(tmp_path, doc))
    assert ts.to_json() == doc


@pytest.mark.parametrize(
    ("doc", "key", "hint"),
    [
        ({"cases": {"c": {"psnr_treshold": 20}}}, "cases.c.psnr_treshold", "did you mean 'psnr_threshold'"),
        ({"cases": {"c": {"audio_threshold": "anything"}}}, "cases.c.audio_threshold", "unknown key"),
        ({"extra": [1]}, "extra", "unknown key"),
        ({"default_clip_threshold": 0.9}, "default_clip_threshold", "did you mean 'default_clip_threshold_"),
    ],
    ids=["misspelt_case_key", "unknown_case_key", "unknown_top_key", "default_without_kind"],
)
def test_unknown_keys_are_refused_naming_file_and_key(doc: dict, key: str, hint: str, tmp_path: Path) -> None:
    path = _write(tmp_path, doc)
    with pytest.raises(ConfigError, match=hint) as info:
        ThresholdSet.load(path)
    assert str(path) in str(info.value) and f"key '{key}'" in str(info.value)


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, '{\n  "cases": {\n    "c": {"psnr_threshold": 20,}\n  }\n}')
    with pytest.raises(ConfigError, match=r"line 3") as info:
        ThresholdSet.load(path)
    assert str(path) in str(info.value)


def test_missing_file_and_missing_value_and_bad_kind(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        ThresholdSet.load(tmp_path / "absent.json")
    ts = ThresholdSet.load(_write(tmp_path, {"cases": {"c": {"psnr_threshold": 20}}}))
    with pytest.raises(ConfigError, match=r"no clip threshold .* default_clip_threshold_image"):
        ts.for_case("c")
    with pytest.raises(ConfigError, match="kind"):
        ThresholdSet.load(BASE).for_case("flux_image_t2i", "audio")
