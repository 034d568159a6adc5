"""``-q`` and ``--failures-only`` on check and gate: the passes stop drowning the failures, the verdict stays."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cli import main
from tests.cli.test_cli import SGLANG_CASES

ROTATING = "tests.targets.rotating_suffix:factory"  # fails sglang_suffix_w2, passes sglang_prefix_w2


@pytest.mark.parametrize(
    ("flags", "rows"),
    [
        ([], {"sglang_suffix_w2", "sglang_prefix_w2"}),
        (["--failures-only"], {"sglang_suffix_w2"}),
        (["-q"], set()),
    ],
    ids=["all", "failures-only", "quiet"],
)
@pytest.mark.parametrize("verb", ["check", "gate"])
def test_result_tables_show_what_was_asked_and_the_verdict_always(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: str, flags: list[str], rows: set[str]
) -> None:
    (tmp_path / "contracts").mkdir()
    (tmp_path / "contracts" / "sglang.toml").write_text(SGLANG_CASES)
    ids = ["usp.replicated_suffix_bitwise", "usp.replicated_prefix_drift"] if verb == "check" else []
    extra = ["--baselines", str(tmp_path)] if verb == "gate" else []
    assert main([verb, *ids, "--cases", str(tmp_path), "--target", ROTATING, *extra, *flags]) == 1
    out = capsys.readouterr().out
    table_rows = {line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│") and "│" in line[1:]}
    assert table_rows & {"sglang_suffix_w2", "sglang_prefix_w2"} == rows
    assert "1 passed, 1 failed, 0 skipped" in out and f"{verb}: FAILED (1 failing case: sglang_suffix_w2)" in out
    if flags == ["--failures-only"]:
        assert "(failures only: 1 of 2)" in out
