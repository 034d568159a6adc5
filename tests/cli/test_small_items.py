"""The small traps of issue 24, one test each: help texts that said the wrong thing, output that named
a file it did not write, listings that left things out."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.cli import VERBS, main
from harness.targets.base import CAPABILITIES
from harness.targets.loader import BUILTIN_PIPELINES

README = Path(__file__).resolve().parents[2] / "README.md"


def test_top_level_help_lists_each_verb_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    lines = {
        verb: len(re.findall(rf"^ {{2,4}}{verb}\b", text, re.MULTILINE)) for verb in VERBS
    }  # a verb line, not a wrapped help line
    assert lines == dict.fromkeys(VERBS, 1)


def test_compare_help_says_a_figure_worse_from_zero_or_inf_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "fails every --fail-on rule on it" in text and "passes every threshold" not in text


def test_sweep_to_stdout_names_no_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "sweep",
                "--json",
                "-",
                "--contracts",
                "usp.ulysses_parity",
                "--world-sizes",
                "1",
                "--backends",
                "math",
                "--dtypes",
                "fp32",
                "--no-kernels",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert json.loads(captured.out)["cells"] and "wrote" not in captured.err


def test_list_and_doctor_show_the_pipeline_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json", "-"]) == 0
    assert [p["name"] for p in json.loads(capsys.readouterr().out)["pipeline_targets"]] == list(BUILTIN_PIPELINES)
    assert main(["doctor", "--json", "-"]) == 0
    doctor = json.loads(capsys.readouterr().out)["pipeline_targets"]
    assert [p["name"] for p in doctor] == list(BUILTIN_PIPELINES) and all(p["available"] for p in doctor)


@pytest.mark.parametrize("capability", list(CAPABILITIES))
def test_the_target_docs_capability_table_has_every_capability(capability: str) -> None:
    assert f"\n| `{capability}` | " in (README.parent / "docs" / "targets" / "attention.md").read_text()


def test_contract_parameters_are_documented_in_docs_contracts_md(capsys: pytest.CaptureFixture[str]) -> None:
    from harness.contracts import all_contracts

    assert main(["list", "--markdown"]) == 0
    text = capsys.readouterr().out
    assert all(
        f"| `{p.name}` |" in text.split(f"## `{c.id}`")[1].split("\n## ")[0] for c in all_contracts() for p in c.params
    )
    docs = README.parent / "docs" / "contracts.md"
    assert docs.read_text() == text, "docs/contracts.md is stale: parity list --markdown > docs/contracts.md"


def test_an_error_a_library_raised_after_catching_the_signal_ends_as_the_signal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy interrupted mid-import by SIGTERM fails its retry with an ImportError: that is the signal's doing."""
    import signal

    import harness.cli as cli

    def interrupted_then_failed() -> int:
        cli._Unwinding.signum = signal.SIGTERM  # what the handler records before raising
        raise ImportError("cannot load module more than once per process")

    monkeypatch.setattr(cli._Unwinding, "signum", None)
    monkeypatch.setattr(cli._Unwinding, "reported", False)
    assert cli._exit_code("parity check", interrupted_then_failed) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "parity check: stopped by SIGTERM; every rank was ended\n"
