"""Target overlays: version-aware overrides and strict expected failures, on their own and through `parity check`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.version import Version

from harness.cases.overlays import apply_target_overlay
from harness.cli import main
from harness.contracts.case import make_case
from harness.contracts.runner import expectation_applied
from harness.errors import ConfigError
from harness.results import FAILED, PASSED, SKIPPED, XFAILED, CaseResult

pytestmark = pytest.mark.timeout(300)


def _cases():
    return [make_case("usp.ulysses_parity", {"world_size": 2}, case_id=f"u{i}", source="base.toml") for i in (1, 2)]


def _overlay(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.toml"
    path.write_text('[target]\ndistribution = "stack"\n' + text)
    return path


def test_entries_apply_only_to_the_versions_they_name(tmp_path: Path) -> None:
    path = _overlay(tmp_path, '[overrides."u1"]\nbecause = "PR 1 in 1.2"\nversions = ">=1.2"\ndtype = "bf16"\n'
                              '[expected_failures."u*"]\nbecause = "bug 7"\nversions = "<1.3"\n')
    old = {c.id: c for c in apply_target_overlay(_cases(), path, Version("1.1"))}
    assert old["u1"].params["dtype"] == "fp32" and old["u1"].expected_failure.startswith("bug 7 (stack 1.1; stack.toml")
    new = {c.id: c for c in apply_target_overlay(_cases(), path, Version("1.3"))}
    assert new["u1"].params["dtype"] == "bf16" and new["u1"].source == f"base.toml + {path}"
    assert new["u1"].expected_failure is None and new["u2"].expected_failure is None
    # not installed: validated, nothing applied (the target is unavailable and its cases skip)
    assert all(c.expected_failure is None for c in apply_target_overlay(_cases(), path))


@pytest.mark.parametrize(("text", "key"), [
    ('[overrides."u1"]\ndtype = "bf16"\n', "overrides.u1.because"),
    ('[overrides."u1"]\nbecause = "x"\nversions = "newer"\ndtype = "bf16"\n', "overrides.u1.versions"),
    ('[overrides."u1"]\nbecause = "x"\n', "overrides.u1"),
    ('[overrides."nope*"]\nbecause = "x"\ndtype = "bf16"\n', "overrides.nope*"),
    ('[overrides."u1"]\nbecause = "x"\ndtype = "int3"\n', "cases.u1.dtype"),
    ('[expected_failures."u1"]\nbecause = "x"\nbound = "abs:1"\n', "expected_failures.u1.bound"),
    ('[expected_failures]\nu1 = 3\n', "expected_failures"),
])
def test_mistakes_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_target_overlay(_cases(), _overlay(tmp_path, text), Version("1.0"))
    assert info.value.key == key


def test_a_missing_distribution_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('[expected_failures."u1"]\nbecause = "x"\n')
    with pytest.raises(ConfigError, match="distribution"):
        apply_target_overlay(_cases(), path)


def _result(status) -> CaseResult:
    return CaseResult("u1", "usp.ulysses_parity", status, "not bitwise: 3 of 8 elements differ" if status == FAILED else None)


def test_expected_failures_are_strict() -> None:
    known = make_case("usp.ulysses_parity", {"world_size": 2}, case_id="u1", source="t")
    import dataclasses

    known = dataclasses.replace(known, expected_failure="bug 7")
    failed = expectation_applied(known, _result(FAILED))
    assert failed.status == XFAILED and failed.reason == "expected failure: bug 7. It failed: not bitwise: 3 of 8 elements differ"
    passed = expectation_applied(known, _result(PASSED))
    assert passed.status == FAILED and passed.reason.startswith("expected to fail, but passed: bug 7.")
    assert expectation_applied(known, _result(SKIPPED)).status == SKIPPED


def test_check_with_a_target_overlay(tmp_path: Path, capsys) -> None:
    """The rotated-suffix target fails sglang's suffix case: recorded, it is xfailed (exit 0); a listed
    case that passes fails the run (exit 1)."""
    root = tmp_path / "cases" / "contracts"
    (root / "targets").mkdir(parents=True)
    (root / "sglang.toml").write_text(
        '[defaults]\nworld_size = 2\ntokens_per_rank = 16\nheads = 4\nreplicated = 2\ndtype = "bf16"\n'
        '[cases.suffix]\ncontract = "usp.replicated_suffix_bitwise"\n[cases.prefix]\ncontract = "usp.replicated_prefix_drift"\n')
    overlay = root / "targets" / "rotating_suffix.toml"
    overlay.write_text('[target]\ndistribution = "torch"\n[expected_failures."suffix"]\nbecause = "rotates the suffix"\n')
    args = ["check", "--cases", str(tmp_path / "cases"), "--target", "tests.targets.rotating_suffix:factory"]
    assert main([*args, "--json", str(tmp_path / "a.json")]) == 0
    records = {r["case_id"]: r for r in json.loads((tmp_path / "a.json").read_text())["stages"]["contracts"]["records"]}
    assert records["suffix"]["status"] == "xfailed" and "rotates the suffix (torch " in records["suffix"]["reason"]
    assert records["prefix"]["status"] == "passed"
    assert "1 xfailed" in capsys.readouterr().out
    overlay.write_text(overlay.read_text() + '[expected_failures."prefix"]\nbecause = "a stale entry"\n')
    assert main([*args, "--json", str(tmp_path / "b.json")]) == 1
    records = {r["case_id"]: r for r in json.loads((tmp_path / "b.json").read_text())["stages"]["contracts"]["records"]}
    assert records["prefix"]["status"] == "failed" and records["prefix"]["reason"].startswith("expected to fail, but passed")


def test_an_entry_can_name_the_platforms_it_holds_on(tmp_path: Path) -> None:
    path = _overlay(tmp_path, '[expected_failures."u1"]\nbecause = "a CUDA kernel refuses it"\nplatforms = ["cuda"]\n')
    on_cuda = {c.id: c for c in apply_target_overlay(_cases(), path, Version("1.0"), platform="cuda")}
    on_cpu = {c.id: c for c in apply_target_overlay(_cases(), path, Version("1.0"), platform="cpu")}
    assert on_cuda["u1"].expected_failure is not None and on_cpu["u1"].expected_failure is None
    bad = _overlay(tmp_path, '[expected_failures."u1"]\nbecause = "x"\nplatforms = ["tpu"]\n')
    with pytest.raises(ConfigError) as info:
        apply_target_overlay(_cases(), bad, Version("1.0"), platform="cpu")
    assert info.value.key == "expected_failures.u1.platforms"
    # an entry for another platform is still validated here: a broken specifier must not wait for a CUDA run
    broken = _overlay(tmp_path, '[expected_failures."u1"]\nbecause = "x"\nplatforms = ["cuda"]\nversions = "~~1"\n')
    with pytest.raises(ConfigError) as info:
        apply_target_overlay(_cases(), broken, Version("1.0"), platform="cpu")
    assert info.value.key == "expected_failures.u1.versions"


def test_a_command_line_override_keeps_the_expected_failure(tmp_path: Path) -> None:
    """`parity check --target X --dtype bf16` must still report X's known divergences as expected failures."""
    from harness.contracts.case import with_overrides

    path = _overlay(tmp_path, '[expected_failures."u1"]\nbecause = "bug 7"\n')
    marked = {c.id: c for c in apply_target_overlay(_cases(), path, Version("1.0"))}
    overridden = {c.id: c for c in with_overrides(marked.values(), dtype="bf16")}
    assert overridden["u1"].params["dtype"] == "bf16"
    assert overridden["u1"].expected_failure == marked["u1"].expected_failure is not None
    assert overridden["u2"].expected_failure is None


def test_a_case_glob_means_the_same_in_an_overlay_and_on_the_command_line(tmp_path: Path) -> None:
    """``m[*]`` (brackets literal, as matrix case ids have them) selects the matrix cases of m in both places."""
    from harness.cases.contract import CaseSelection, select_cases

    cases = [make_case("usp.ulysses_parity", {"world_size": 2}, case_id=f"m[dtype={d}]", source="base.toml") for d in ("fp32", "bf16")]
    cases.append(make_case("usp.ulysses_parity", {"world_size": 2}, case_id="md", source="base.toml"))
    path = _overlay(tmp_path, '[expected_failures."m[*]"]\nbecause = "bug 7"\n')
    marked = [c.id for c in apply_target_overlay(cases, path, Version("1.0")) if c.expected_failure]
    selected = [c.id for c in select_cases(cases, CaseSelection(("m[*]",)))]
    assert marked == selected == ["m[dtype=fp32]", "m[dtype=bf16]"]
