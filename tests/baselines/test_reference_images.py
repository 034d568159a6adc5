"""Reference images/videos: bless writes PNG + manifest (hashes, fields, fingerprint); load verifies the hash, loudly."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from harness.baselines.image_writes import bless
from harness.baselines.images import MANIFEST, changed_fields, fingerprint, load_reference, read_manifest
from harness.errors import ConfigError

TINY_IMAGE_CASE = '[defaults]\nprompt = "a cameraman"\nheight = 16\nwidth = 16\nsteps = 2\n\n[cases.tiny_1rank]\n'


def _image(seed: int, shape: tuple[int, ...] = (12, 16, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_image_round_trip_and_manifest(tmp_path: Path) -> None:
    img = _image(0)
    assert bless(tmp_path, "flux_image_t2i", img) == ["flux_image_t2i.png"]
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    digest = hashlib.sha256((tmp_path / "flux_image_t2i.png").read_bytes()).hexdigest()
    assert manifest == {
        "format": 2,
        "cases": {
            "flux_image_t2i": {
                "fingerprint": None,
                "fields": None,
                "world_size": 1,
                "pipeline": None,
                "shape": [12, 16, 3],
                "files": {"flux_image_t2i.png": digest},
            }
        },
    }
    out = load_reference(tmp_path, "flux_image_t2i")
    assert out.dtype == np.uint8 and np.array_equal(out, img)


def test_video_is_stored_per_frame(tmp_path: Path) -> None:
    video = np.stack([_image(i) for i in range(3)])
    assert bless(tmp_path, "wan_t2v", video) == [f"wan_t2v/frame_{i:04d}.png" for i in range(3)]
    assert np.array_equal(load_reference(tmp_path, "wan_t2v"), video)
    # re-blessing with fewer frames drops the stale frame from disk and manifest
    bless(tmp_path, "wan_t2v", video[:2])
    assert load_reference(tmp_path, "wan_t2v").shape == (2, 12, 16, 3)
    assert not (tmp_path / "wan_t2v" / "frame_0002.png").exists()
    assert "wan_t2v/frame_0002.png" not in json.loads((tmp_path / MANIFEST).read_text())["cases"]["wan_t2v"]["files"]


def test_frame_missing_from_manifest_is_an_error(tmp_path: Path) -> None:
    bless(tmp_path, "v", np.stack([_image(i) for i in range(3)]))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    del manifest["cases"]["v"]["files"]["v/frame_0001.png"]
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="v/frame_0001.png is not listed"):
        load_reference(tmp_path, "v")


def test_hash_mismatch_is_an_error_naming_the_file(tmp_path: Path) -> None:
    bless(tmp_path, "a", _image(1))
    bless(tmp_path, "b", _image(2))
    (tmp_path / "a.png").write_bytes((tmp_path / "b.png").read_bytes())  # valid PNG, wrong content
    with pytest.raises(ConfigError, match="sha256 mismatch") as info:
        load_reference(tmp_path, "a")
    assert info.value.path == str(tmp_path / "a.png")


def test_file_missing_from_manifest_is_an_error(tmp_path: Path) -> None:
    bless(tmp_path, "a", _image(1))
    (tmp_path / "stray.png").write_bytes((tmp_path / "a.png").read_bytes())
    with pytest.raises(ConfigError, match="not in manifest.json") as info:
        load_reference(tmp_path, "stray")
    assert info.value.path == str(tmp_path / "stray.png")
    with pytest.raises(
        ConfigError, match="no reference for case 'nothing' in manifest.json: run `parity bless nothing`"
    ):
        load_reference(tmp_path, "nothing")


def test_manifest_entry_without_file_is_an_error(tmp_path: Path) -> None:
    bless(tmp_path, "a", _image(1))
    (tmp_path / "a.png").unlink()
    with pytest.raises(ConfigError, match="file is missing") as info:
        load_reference(tmp_path, "a")
    assert info.value.path == str(tmp_path / "a.png")


def test_corrupt_manifest_and_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / MANIFEST).write_text('{"format": 2, "cases": {"a": {"files": {"a.png": "not-a-hash"}}}}')
    with pytest.raises(ConfigError, match="sha256") as info:
        load_reference(tmp_path, "a")
    assert info.value.key == "cases.a.files.a.png"
    (tmp_path / MANIFEST).write_text('{"a.png": "0000"}')  # no format: not a manifest parity writes
    with pytest.raises(ConfigError, match="unknown manifest format None") as info:
        load_reference(tmp_path, "a")
    assert info.value.key == "format"
    (tmp_path / MANIFEST).write_text('{"format": 3, "cases": {}}')
    with pytest.raises(ConfigError, match="unknown manifest format 3") as info:
        load_reference(tmp_path, "a")
    assert info.value.key == "format"
    with pytest.raises(ConfigError, match="file name"):
        bless(tmp_path, "../escape", _image(0))
    with pytest.raises(ValueError, match="uint8"):
        bless(tmp_path / "new", "x", _image(0).astype(np.float32))


def test_fields_are_recorded_and_their_changes_named(tmp_path: Path) -> None:
    fields = {"prompt": "a fox", "seed": 0, "steps": 4}
    bless(tmp_path, "a", _image(1), fields=fields, pipeline="reference")
    entry = read_manifest(tmp_path)["a"]
    assert entry.fields == fields and entry.fingerprint == fingerprint({"steps": 4, "seed": 0, "prompt": "a fox"})
    assert fingerprint({**fields, "seed": 1}) != entry.fingerprint
    assert changed_fields(entry.fields, {"prompt": "a fox", "seed": 1, "dtype": "bf16"}) == [
        "dtype 'bf16' added",
        "seed 0 → 1",
        "steps 4 removed",
    ]
    assert changed_fields(None, fields) == ["blessed before fields were recorded"]


def test_bless_all_replaces_a_set_of_an_older_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 39, leftover 14: an old manifest format was a dead end (every verb and `bless --all` refused)."""
    from harness.cli import main
    from tests.gate_project import gate_project

    cases, baselines = gate_project(tmp_path, tiny=TINY_IMAGE_CASE)
    refs = baselines / "images"
    refs.mkdir()
    (refs / MANIFEST).write_text('{"tiny_1rank.png": "0000"}')  # format 1: a bare file -> hash map
    (refs / "tiny_1rank.png").write_bytes(b"old")
    where = ["--cases", str(cases), "--baselines", str(baselines)]
    assert main(["gate", *where, "--no-perf"]) == 2
    assert "`parity bless --all` replaces the whole set" in capsys.readouterr().err
    assert main(["bless", "tiny_1rank", *where]) == 2  # one case cannot rewrite a set it cannot read
    assert main(["bless", "--all", *where, "--json", str(tmp_path / "bless.json")]) == 0
    (change,) = json.loads((tmp_path / "bless.json").read_text())["changes"]
    assert change["change"] == "repaired" and "unknown manifest format None" in " ".join(change["fields_changed"])
    assert main(["gate", *where, "--no-perf"]) == 0
