"""Text read from files reaches a terminal inert: an escape sequence in a sweep file's labels or in a key an error
names is shown as its ``\\x1b`` escape, never sent raw (a terminal would act on it: clear the screen, retitle the
window, hide what follows). ``compare``'s own rows are in ``test_compare_hostile``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from tests.files.kinds import SWEEP

ESCAPES = "\x1b]0;pwned\x07\x1b[2J"


def _sweep(path: Path) -> Path:
    doc = json.loads(json.dumps(SWEEP))
    doc["platform"]["device_name"] = f"dev{ESCAPES}"
    doc["cells"][0]["contract"] = f"usp.x{ESCAPES}"
    doc["kernels"][0]["shape"] = f"B=1{ESCAPES}"
    path.write_text(json.dumps(doc))
    return path


def _thresholds(folder: Path) -> Path:
    folder.mkdir()
    (folder / "consistency_threshold.json").write_text(json.dumps({"cases": {f"a{ESCAPES}": {"psnr_threshold": 1}}}))
    return folder


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["matrix", "{sweep}"], 0, "dev\\x1b]0;pwned\\x07\\x1b[2J"),
        (["matrix", "{sweep}", "--format", "html"], 0, "usp.x\\x1b]0;pwned\\x07\\x1b[2J"),
        (["matrix", "{sweep}", "--output", "{tmp}/m.md"], 0, "B=1\\x1b]0;pwned\\x07\\x1b[2J"),
        (["gate", "--baselines", "{baselines}"], 2, "key 'cases.a\\x1b]0;pwned\\x07\\x1b[2J'"),
    ],
    ids=["matrix_markdown", "matrix_html", "matrix_to_a_file", "error_naming_a_key"],
)
def test_escapes_from_a_file_are_shown_inert(
    args: list[str], code: int, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fill = {"sweep": _sweep(tmp_path / "sweep.json"), "baselines": _thresholds(tmp_path / "baselines"), "tmp": tmp_path}
    assert main([a.format(**fill) for a in args]) == code
    captured = capsys.readouterr()
    written = (tmp_path / "m.md").read_text() if (tmp_path / "m.md").exists() else ""
    text = captured.out + captured.err + written
    assert says in text, text
    assert "\x1b" not in text and "\x07" not in text
