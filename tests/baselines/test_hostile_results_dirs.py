"""Hostile results directories and reference folders through ``parity bless --from-results``: 0 tracebacks,
0 wrong accepts, and nothing moved into the references.

Each row plants something in a gate run's saved candidates (``DIR/candidates``) or next to the
references (``baselines/images/.bless-pending``): a candidate that links to a PNG outside DIR, a
linked candidates folder, an animated or wrongly sized candidate rehashed into its manifest, a
manifest key that climbs out of the folder, a ``.bless-pending`` symlink or file. bless must exit 2
naming the file (and key), and the references must be exactly what they were; the honest run
blesses.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from harness.baselines.image_writes import blessing, write_set
from harness.cases.image import load_image_cases
from harness.cli import main
from harness.files.png import encode_png

CASES = '[defaults]\nprompt = "a hostile run"\nheight = 32\nwidth = 32\nsteps = 1\n\n[cases.img]\n'


@dataclass(frozen=True)
class Dirs:
    root: Path
    results: Path
    references: Path

    @property
    def candidates(self) -> Path:
        return self.results / "candidates"


def _rehash(dirs: Dirs, data: bytes, shape: list[int] | None = None) -> None:
    """Put ``data`` in place of the candidate and make its manifest agree (what a careful forger does)."""
    (dirs.candidates / "img.png").write_bytes(data)
    manifest = json.loads((dirs.candidates / "manifest.json").read_text())
    entry = manifest["cases"]["img"]
    entry["files"]["img.png"] = hashlib.sha256(data).hexdigest()
    if shape is not None:
        entry["shape"] = shape
    (dirs.candidates / "manifest.json").write_text(json.dumps(manifest))


def _apng() -> bytes:
    from PIL import Image

    frames = [Image.fromarray(np.full((32, 32, 3), i, np.uint8)) for i in range(50)]
    out = io.BytesIO()
    frames[0].save(out, format="PNG", save_all=True, append_images=frames[1:])
    return out.getvalue()


def _outside_png(dirs: Dirs) -> Path:
    path = dirs.root / "elsewhere.png"
    path.write_bytes(encode_png(np.full((32, 32, 3), 200, np.uint8)))
    return path


def _link_candidate(dirs: Dirs) -> None:
    outside = _outside_png(dirs)
    _rehash(dirs, outside.read_bytes())
    (dirs.candidates / "img.png").unlink()
    (dirs.candidates / "img.png").symlink_to(outside)


def _link_folder(dirs: Dirs) -> None:
    shutil.move(str(dirs.candidates), dirs.root / "real-candidates")
    dirs.candidates.symlink_to(dirs.root / "real-candidates")


def _link_manifest(dirs: Dirs) -> None:
    shutil.move(str(dirs.candidates / "manifest.json"), dirs.root / "manifest.json")
    (dirs.candidates / "manifest.json").symlink_to(dirs.root / "manifest.json")


def _fifo_candidate(dirs: Dirs) -> None:
    (dirs.candidates / "img.png").unlink()
    os.mkfifo(dirs.candidates / "img.png")


def _manifest_key(key: str) -> Callable[[Dirs], None]:
    def apply(dirs: Dirs) -> None:
        manifest = json.loads((dirs.candidates / "manifest.json").read_text())
        manifest["cases"][key] = manifest["cases"]["img"]
        (dirs.candidates / "manifest.json").write_text(json.dumps(manifest))

    return apply


def _unknown_manifest_key(dirs: Dirs) -> None:
    manifest = json.loads((dirs.candidates / "manifest.json").read_text())
    manifest["cases"]["img"]["shapes"] = [32, 32, 3]
    (dirs.candidates / "manifest.json").write_text(json.dumps(manifest))


def _a_planted_set(dirs: Dirs) -> Path:
    """A complete set elsewhere (a manifest naming one PNG), as a ``.bless-pending`` would hold."""
    planted = dirs.root / "planted"
    write_set(planted, [blessing("img", np.full((32, 32, 3), 77, np.uint8), {"prompt": "planted"})])
    return planted


def _pending_link(dirs: Dirs) -> None:
    (dirs.references / ".bless-pending").symlink_to(_a_planted_set(dirs))


def _pending_file(dirs: Dirs) -> None:
    (dirs.references / ".bless-pending").write_text("not a staged set")


def _pending_with_a_linked_png(dirs: Dirs) -> None:
    planted = _a_planted_set(dirs)
    pending = dirs.references / ".bless-pending"
    pending.mkdir()
    shutil.copy(planted / "manifest.json", pending / "manifest.json")
    (pending / "img.png").symlink_to(planted / "img.png")


def _nothing(dirs: Dirs) -> None:
    pass


# (id, what to plant, None: blessed, else (the path the refusal names, relative to the test's folder; what it says))
ROWS: list[tuple[str, Callable[[Dirs], None], tuple[str, str] | None]] = [
    ("honest", _nothing, None),
    ("candidate_links_out_of_the_folder", _link_candidate, ("results/candidates/img.png", "is a symlink")),
    ("candidates_folder_is_a_link", _link_folder, ("results/candidates", "not the folder of candidates")),
    ("candidates_manifest_is_a_link", _link_manifest, ("results/candidates/manifest.json", "is a symlink")),
    ("candidate_is_a_fifo", _fifo_candidate, ("results/candidates/img.png", "a FIFO")),
    (
        "candidate_64x64_for_a_32x32_case",
        lambda d: _rehash(d, encode_png(np.zeros((64, 64, 3), np.uint8)), [64, 64, 3]),
        ("results/candidates", "the case makes [32, 32, 3]"),
    ),
    (
        "candidate_pixels_not_the_recorded_shape",
        lambda d: _rehash(d, encode_png(np.zeros((64, 64, 3), np.uint8))),
        ("results/candidates/img.png", "records shape [32, 32, 3]"),
    ),
    ("candidate_is_an_apng", lambda d: _rehash(d, _apng()), ("results/candidates/img.png", "an animated PNG")),
    (
        "manifest_key_climbs_out",
        _manifest_key("../../../etc/passwd"),
        ("results/candidates/manifest.json", "key 'cases.../../../etc/passwd'"),
    ),
    (
        "manifest_unknown_entry_key",
        _unknown_manifest_key,
        ("results/candidates/manifest.json", "key 'cases.img.shapes'"),
    ),
    ("pending_is_a_link_to_a_set", _pending_link, ("baselines/images/.bless-pending", "is a symlink")),
    ("pending_is_a_file", _pending_file, ("baselines/images/.bless-pending", "is a regular file")),
    (
        "pending_holds_a_linked_png",
        _pending_with_a_linked_png,
        ("baselines/images/.bless-pending/img.png", "not a file staged by parity bless"),
    ),
]


def _snapshot(folder: Path) -> dict[str, str]:
    """Every entry below ``folder`` (links not followed) with what it is: the references before and after."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = (
            f"-> {os.readlink(path)}"
            if path.is_symlink()
            else (
                "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "other"
            )
        )
    return out


@pytest.fixture
def dirs(tmp_path: Path) -> Dirs:
    cases = tmp_path / "cases" / "images"
    cases.mkdir(parents=True)
    (cases / "c.toml").write_text(CASES)
    fields = load_image_cases(tmp_path / "cases")[0].fields
    out = Dirs(tmp_path, tmp_path / "results", tmp_path / "baselines" / "images")
    write_set(out.candidates, [blessing("img", np.full((32, 32, 3), 5, np.uint8), fields, 1, "reference")])
    write_set(out.references, [blessing("img", np.full((32, 32, 3), 1, np.uint8), fields, 1, "reference")])
    return out


@pytest.mark.parametrize(("plant", "expect"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bless_from_a_hostile_results_dir_refuses_and_moves_nothing(
    plant: Callable[[Dirs], None], expect: tuple[str, str] | None, dirs: Dirs, capsys: pytest.CaptureFixture[str]
) -> None:
    plant(dirs)
    before = _snapshot(dirs.references)
    code = main(
        [
            "bless",
            "--from-results",
            str(dirs.results),
            "img",
            "--cases",
            str(dirs.root / "cases"),
            "--baselines",
            str(dirs.references.parent),
        ]
    )
    err = capsys.readouterr().err
    if expect is None:
        assert code == 0, err
        assert _snapshot(dirs.references) != before
        return
    where, says = expect
    assert code == 2, f"wrongly blessed: {err}"
    assert str(dirs.root / where) in err and says in err, err
    assert _snapshot(dirs.references) == before, "something moved into the references"
