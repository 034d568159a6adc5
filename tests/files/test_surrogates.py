"""A JSON file holding a lone surrogate (``"\\ud800"`` decodes to one) is refused on read, naming the file and
key: no output can encode it, so `parity compare` on such a results file ended in a UnicodeEncodeError
traceback (issue 39, leftover 9)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.errors import ConfigError
from harness.files.jsonio import read_json


@pytest.mark.parametrize(
    ("text", "key"),
    [('{"a": "x\\udc00y"}', "a"), ('{"a\\ud800": 1}', "a\\ud800"), ('{"a": ["ok", "\\ud83d"]}', "a.1")],
    ids=["in-a-string", "in-a-key", "half-an-emoji"],
)
def test_a_lone_surrogate_is_refused_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "doc.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="a lone surrogate") as caught:
        read_json(path)
    assert caught.value.key == key and caught.value.path == str(path)
    str(caught.value).encode("utf-8")  # the message itself is printable


def test_an_escaped_pair_is_text() -> None:
    assert json.loads('"\\ud83d\\ude00"') == "\U0001f600"  # a pair is one character, not a surrogate


def test_compare_on_a_results_file_with_a_surrogate_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = {"verdict": "passed", "stages": {"contracts": {"records": []}}}
    (tmp_path / "base.json").write_text(json.dumps(good))
    (tmp_path / "new.json").write_text('{"verdict": "passed\\ud800", "stages": {}}')
    assert main(["compare", str(tmp_path / "base.json"), str(tmp_path / "new.json")]) == 2
    err = capsys.readouterr().err
    assert "new.json: key 'verdict': a lone surrogate" in err and "Traceback" not in err
