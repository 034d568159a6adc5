"""Target overlays: version-aware overrides, strict expected failures and strict pinned skips, on their own and
through `parity check`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from packaging.version import Version

from harness.cases.overlays import apply_target_overlay
from harness.cli import main
from harness.contracts.case import Case, ExpectedFailure, ExpectedSkip, make_case
from harness.contracts.runner import expectations_applied
from harness.errors import ConfigError
from harness.results import FAILED, PASSED, SKIPPED, XFAILED, CaseResult
from harness.targets.base import Refusal, Refused

pytestmark = pytest.mark.timeout(300)


def _cases():
    return [make_case("usp.ulysses_parity", {"world_size": 2}, case_id=f"u{i}", source="base.toml") for i in (1, 2)]


def _overlay(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.toml"
    path.write_text('[target]\ndistribution = "stack"\n' + text)
    return path


def test_entries_apply_only_to_the_versions_they_name(tmp_path: Path) -> None:
    path = _overlay(
        tmp_path,
        '[overrides."u1"]\nbecause = "PR 1 in 1.2"\nversions = ">=1.2"\ndtype = "bf16"\n'
        '[expected_failures."u*"]\nbecause = "bug 7"\nfails = ["output"]\nversions = "<1.3"\n',
    )
    old = {c.id: c for c in apply_target_overlay(_cases(), path, Version("1.1"))}
    assert old["u1"].params["dtype"] == "fp32" and old["u1"].expected_failure.describe().startswith(
        "bug 7 (output fail; stack 1.1; stack.toml"
    )
    new = {c.id: c for c in apply_target_overlay(_cases(), path, Version("1.3"))}
    assert new["u1"].params["dtype"] == "bf16" and new["u1"].source == f"base.toml + {path}"
    assert new["u1"].expected_failure is None and new["u2"].expected_failure is None
    # not installed: validated, nothing applied (the target is unavailable and its cases skip)
    assert all(c.expected_failure is None for c in apply_target_overlay(_cases(), path))
    # ... but where the target runs, its overlay names the wrong distribution: an error, not entries switched off
    with pytest.raises(ConfigError, match="names 'stack', which is not installed here") as info:
        apply_target_overlay(_cases(), path, target_runs=True)
    assert (info.value.key, info.value.path) == ("target.distribution", str(path))


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[overrides."u1"]\ndtype = "bf16"\n', "overrides.u1.because"),
        ('[overrides."u1"]\nbecause = "x"\nversions = "newer"\ndtype = "bf16"\n', "overrides.u1.versions"),
        ('[overrides."u1"]\nbecause = "x"\n', "overrides.u1"),
        ('[overrides."nope*"]\nbecause = "x"\ndtype = "bf16"\n', "overrides.nope*"),
        ('[overrides."u1"]\nbecause = "x"\ndtype = "int3"\n', "cases.u1.dtype"),
        ('[expected_failures."u1"]\nbecause = "x"\nbound = "abs:1"\n', "expected_failures.u1.bound"),
        ('[expected_failures."u1"]\nbecause = "x"\n', "expected_failures.u1"),  # what fails, unsaid
        ('[expected_failures."u1"]\nbecause = "x"\nfails = ["dz"]\n', "expected_failures.u1.fails"),
        ('[expected_failures."u1"]\nbecause = "x"\nraises = ""\n', "expected_failures.u1.raises"),
        ('[expected_failures."u1"]\nbecause = "x"\nfails = ["dq"]\nraises = "boom"\n', "expected_failures.u1"),
        ("[expected_failures]\nu1 = 3\n", "expected_failures"),
    ],
)
def test_mistakes_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_target_overlay(_cases(), _overlay(tmp_path, text), Version("1.0"))
    assert info.value.key == key


def test_versions_need_a_distribution_and_nothing_else_does(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text('[expected_failures."u1"]\nbecause = "x"\nfails = ["output"]\nversions = ">=1"\n')
    with pytest.raises(ConfigError, match="distribution") as info:
        apply_target_overlay(_cases(), path)
    assert info.value.key == "target.distribution"
    path.write_text('[expected_skips."u1"]\nbecause = "the stack has no such mode"\n')
    assert {c.id: c.expected_skip for c in apply_target_overlay(_cases(), path)}[
        "u1"
    ].because == "the stack has no such mode"


def _result(
    status, failing: list[str] | None = None, reason: str = "not bitwise: 3 of 8 elements differ"
) -> CaseResult:
    figures = {"failing": failing} if failing else {}
    return CaseResult("u1", "usp.ulysses_parity", status, reason if status == FAILED else None, figures=figures)


def _known(**pin) -> Case:
    expected = ExpectedFailure("bug 7", "stack.toml: expected_failures.u1", **pin)
    return dataclasses.replace(
        make_case("usp.ulysses_parity", {"world_size": 2}, case_id="u1", source="t"), expected_failure=expected
    )


def test_expected_failures_are_strict() -> None:
    known = _known(fails=("output",))
    failed = expectations_applied(known, _result(FAILED, ["output"]), "stack")
    assert failed.status == XFAILED and failed.reason == (
        "expected failure: bug 7 (output fail; stack.toml: expected_failures.u1). "
        "It failed: not bitwise: 3 of 8 elements differ"
    )
    passed = expectations_applied(known, _result(PASSED), "stack")
    assert passed.status == FAILED and passed.reason.startswith("expected to fail, but passed: bug 7")


def test_an_expected_failure_covers_only_what_it_names() -> None:
    """diffusers' ring_grad_w4 fails dk and dv (upstream); a second defect that breaks dq must not hide in it."""
    known = _known(fails=("dk", "dv"))
    assert expectations_applied(known, _result(FAILED, ["dk", "dv"]), "stack").status == XFAILED
    worse = expectations_applied(known, _result(FAILED, ["dk", "dq", "dv"]), "stack")
    assert worse.status == FAILED and worse.reason.startswith(
        "fails beyond its expected failure (bug 7 (dk, dv fail; stack.toml: expected_failures.u1)): dq fails too."
    )
    narrowed = expectations_applied(known, _result(FAILED, ["dk"]), "stack")
    assert narrowed.status == XFAILED and "(dv now passes)" in narrowed.reason
    crashed = expectations_applied(known, _result(FAILED, None, "rank 0 raised: KeyError: 3"), "stack")
    assert crashed.status == FAILED and "it failed before its comparisons were judged" in crashed.reason


def test_an_expected_raise_covers_only_that_error() -> None:
    known = _known(raises=("must match the size", "is invalid for input"))
    same = expectations_applied(
        known, _result(FAILED, None, "rank 0 raised: RuntimeError: shape is invalid for input of size 4"), "stack"
    )
    assert same.status == XFAILED
    other = expectations_applied(known, _result(FAILED, ["output"]), "stack")
    assert other.status == FAILED and "it did not raise as pinned" in other.reason


def _skipped(
    reason: str = "target stack does not support ring (ring: ...)", refused: Refused | None = None
) -> CaseResult:
    return CaseResult("u1", "usp.ulysses_parity", SKIPPED, reason, refusal=refused)


PIN = ExpectedSkip("the stack has no ring", "stack.toml: expected_skips.u1", "does not support ring")
LACKS_RING = ExpectedSkip("the stack has no ring", "stack.toml: expected_skips.u1", lacks=frozenset({"ring"}))
NO_LSE = ExpectedSkip("no LSE", "stack.toml: expected_skips.u1", refusal=Refusal.RING_NEEDS_LSE)


@pytest.mark.parametrize(
    ("pin", "result", "allow", "status", "reason"),
    [
        (
            None,
            _skipped(),
            False,
            FAILED,
            "skipped, and this target was expected to run it: target stack does not support ring",
        ),
        (
            None,
            _skipped(),
            True,
            SKIPPED,
            "target stack does not support ring (ring: ...) (not pinned; --allow-new-skips)",
        ),
        (
            PIN,
            _skipped(),
            False,
            SKIPPED,
            "target stack does not support ring (ring: ...) (pinned: the stack has no ring)",
        ),
        (
            PIN,
            _skipped("sglang 0.5.23: a size mismatch"),
            False,
            FAILED,
            "skipped for another reason than its pin (stack.toml: expected_skips.u1) expects ('does not support ring')",
        ),
        (
            PIN,
            CaseResult("u1", "usp.ulysses_parity", PASSED),
            False,
            FAILED,
            "pinned to skip (stack.toml: expected_skips.u1: the stack has no ring), but it ran (it passed): remove it from the overlay",
        ),
        (
            dataclasses.replace(PIN, reason=None),
            _skipped("anything"),
            False,
            SKIPPED,
            "anything (pinned: the stack has no ring)",
        ),
        (
            LACKS_RING,
            _skipped("lacks ring, gqa", Refused(Refusal.LACKS, frozenset({"gqa", "ring"}))),
            False,
            SKIPPED,
            "lacks ring, gqa (pinned: the stack has no ring)",
        ),
        (
            LACKS_RING,
            _skipped("does not support ring in its words", Refused(Refusal.LACKS, frozenset({"gqa"}))),
            False,
            FAILED,
            "skipped for another reason than its pin (stack.toml: expected_skips.u1) expects (a target lacking ring)",
        ),
        (
            LACKS_RING,
            _skipped("does not support ring, but untyped"),
            False,
            FAILED,
            "skipped for another reason than its pin (stack.toml: expected_skips.u1) expects (a target lacking ring)",
        ),
        (
            NO_LSE,
            _skipped("no lse", Refused(Refusal.RING_NEEDS_LSE)),
            False,
            SKIPPED,
            "no lse (pinned: no LSE)",
        ),
        (
            NO_LSE,
            _skipped("ring_needs_lse in the words only", Refused(Refusal.UNSUPPORTED)),
            False,
            FAILED,
            "skipped for another reason than its pin (stack.toml: expected_skips.u1) expects (a ring_needs_lse "
            "refusal, not unsupported)",
        ),
    ],
    ids=[
        "unpinned",
        "unpinned-allowed",
        "pinned",
        "pinned-other-reason",
        "pinned-but-ran",
        "pinned-any-reason",
        "lacks-one-of-its-capabilities",
        "lacks-another-capability",
        "lacks-but-untyped",
        "refusal-of-its-kind",
        "refusal-of-another-kind",
    ],
)
def test_a_skip_is_a_claim_the_overlay_must_pin(
    pin: ExpectedSkip | None, result: CaseResult, allow: bool, status: str, reason: str
) -> None:
    case = dataclasses.replace(
        make_case("usp.ulysses_parity", {"world_size": 2}, case_id="u1", source="t"), expected_skip=pin
    )
    got = expectations_applied(case, result, "stack", allow_new_skips=allow)
    assert got.status == status and got.reason.startswith(reason), got.reason
    if status == FAILED and pin is None:
        assert "pin it in cases/contracts/targets/stack.toml [expected_skips]" in got.reason


@pytest.mark.parametrize(
    ("text", "applies"),
    [
        ('because = "x"\n', True),
        ('because = "x"\nplatforms = ["cuda"]\n', False),  # this run is on the CPU
        ('because = "x"\nwhen_missing = "json"\n', False),  # json can be imported: the pin does not hold here
        ('because = "x"\nwhen_missing = "no_such_module_here"\n', True),
        ('because = "x"\nversions = ">=2"\n', False),
    ],
    ids=["always", "another-platform", "module-present", "module-missing", "another-version"],
)
def test_a_pin_holds_only_where_its_conditions_do(tmp_path: Path, text: str, applies: bool) -> None:
    path = _overlay(tmp_path, f'[expected_skips."u1"]\n{text}')
    pinned = {c.id: c.expected_skip for c in apply_target_overlay(_cases(), path, Version("1.0"), platform="cpu")}
    assert (pinned["u1"] is not None) is applies and pinned["u2"] is None


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[expected_skips."u1"]\nreason = "x"\n', "expected_skips.u1.because"),
        ('[expected_skips."u1"]\nbecause = "x"\nkind = "ring"\n', "expected_skips.u1.kind"),
        ('[expected_skips."u1"]\nbecause = "x"\nreason = ""\n', "expected_skips.u1.reason"),
        ('[expected_skips."none*"]\nbecause = "x"\n', "expected_skips.none*"),
        ('[expected_skips."u1"]\nbecause = "x"\nlacks = ["rings"]\n', "expected_skips.u1.lacks"),
        ('[expected_skips."u1"]\nbecause = "x"\nlacks = "ring"\n', "expected_skips.u1.lacks"),
        ('[expected_skips."u1"]\nbecause = "x"\nlacks = []\n', "expected_skips.u1.lacks"),
        ('[expected_skips."u1"]\nbecause = "x"\nrefusal = "no_lse"\n', "expected_skips.u1.refusal"),
    ],
    ids=[
        "no-because",
        "unknown-key",
        "empty-reason",
        "matches-nothing",
        "unknown-capability",
        "lacks-not-a-list",
        "lacks-empty",
        "unknown-refusal",
    ],
)
def test_pin_mistakes_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_target_overlay(_cases(), _overlay(tmp_path, text), Version("1.0"))
    assert info.value.key == key


_RANGES = (
    '[[expected_skips."u1"]]\nbecause = "refused before 2"\nversions = "<2"\nreason = "old words"\n'
    '[[expected_skips."u1"]]\nbecause = "refused in 2.x"\nversions = ">=2,<3"\nreason = "new words"\n'
)


@pytest.mark.parametrize(
    ("version", "because", "reason"),
    [
        ("1.9", "refused before 2", "old words"),
        ("2.0", "refused in 2.x", "new words"),
        ("3.0", None, None),
    ],
    ids=["first-range", "second-range", "neither"],
)
def test_one_glob_takes_an_entry_per_version_range(
    tmp_path: Path, version: str, because: str | None, reason: str | None
) -> None:
    path = _overlay(tmp_path, _RANGES)
    pin = {c.id: c.expected_skip for c in apply_target_overlay(_cases(), path, Version(version))}["u1"]
    if because is None:
        assert pin is None
    else:
        assert (pin.because, pin.reason) == (because, reason)
        assert pin.where.endswith("expected_skips.u1[1]" if version == "2.0" else "expected_skips.u1[0]")


def test_a_version_range_entry_names_its_index_in_mistakes(tmp_path: Path) -> None:
    path = _overlay(tmp_path, _RANGES + '[[expected_skips."u1"]]\nversions = "<1"\n')
    with pytest.raises(ConfigError) as info:
        apply_target_overlay(_cases(), path, Version("1.0"))
    assert info.value.key == "expected_skips.u1[2].because"
    with pytest.raises(ConfigError) as info:
        apply_target_overlay(_cases(), _overlay(tmp_path, "[expected_failures]\nu1 = []\n"), Version("1.0"))
    assert info.value.key == "expected_failures.u1"


def test_check_with_a_target_overlay(tmp_path: Path, capsys) -> None:
    """The rotated-suffix target fails sglang's suffix case: recorded, it is xfailed (exit 0); a listed
    case that passes fails the run (exit 1)."""
    root = tmp_path / "cases" / "contracts"
    (root / "targets").mkdir(parents=True)
    (root / "sglang.toml").write_text(
        '[defaults]\nworld_size = 2\ntokens_per_rank = 16\nheads = 4\nreplicated = 2\ndtype = "bf16"\n'
        '[cases.suffix]\ncontract = "usp.replicated_suffix_bitwise"\n[cases.prefix]\ncontract = "usp.replicated_prefix_drift"\n'
    )
    overlay = root / "targets" / "rotating_suffix.toml"
    overlay.write_text(
        '[target]\ndistribution = "torch"\n[expected_failures."suffix"]\nbecause = "rotates the suffix"\nfails = ["output"]\n'
    )
    args = ["check", "--cases", str(tmp_path / "cases"), "--target", "tests.targets.rotating_suffix:factory"]
    assert main([*args, "--json", str(tmp_path / "a.json")]) == 0
    records = {r["case_id"]: r for r in json.loads((tmp_path / "a.json").read_text())["stages"]["contracts"]["records"]}
    assert (
        records["suffix"]["status"] == "xfailed"
        and "rotates the suffix (output fail; torch " in records["suffix"]["reason"]
    )
    assert records["prefix"]["status"] == "passed"
    assert "1 xfailed" in capsys.readouterr().out
    overlay.write_text(
        overlay.read_text() + '[expected_failures."prefix"]\nbecause = "a stale entry"\nfails = ["output"]\n'
    )
    assert main([*args, "--json", str(tmp_path / "b.json")]) == 1
    records = {r["case_id"]: r for r in json.loads((tmp_path / "b.json").read_text())["stages"]["contracts"]["records"]}
    assert records["prefix"]["status"] == "failed" and records["prefix"]["reason"].startswith(
        "expected to fail, but passed"
    )
    overlay.write_text(overlay.read_text().replace('"torch"', '"no-such-stack"'))  # a misspelt distribution
    capsys.readouterr()
    assert main(args) == 2
    said = capsys.readouterr().err
    assert "rotating_suffix.toml" in said and "target.distribution" in said and "'no-such-stack'" in said, said


def test_an_entry_can_name_the_platforms_it_holds_on(tmp_path: Path) -> None:
    path = _overlay(
        tmp_path,
        '[expected_failures."u1"]\nbecause = "a CUDA kernel refuses it"\nraises = "refuses"\nplatforms = ["cuda"]\n',
    )
    on_cuda = {c.id: c for c in apply_target_overlay(_cases(), path, Version("1.0"), platform="cuda")}
    on_cpu = {c.id: c for c in apply_target_overlay(_cases(), path, Version("1.0"), platform="cpu")}
    assert on_cuda["u1"].expected_failure is not None and on_cpu["u1"].expected_failure is None
    bad = _overlay(tmp_path, '[expected_failures."u1"]\nbecause = "x"\nfails = ["output"]\nplatforms = ["tpu"]\n')
    with pytest.raises(ConfigError) as info:
        apply_target_overlay(_cases(), bad, Version("1.0"), platform="cpu")
    assert info.value.key == "expected_failures.u1.platforms"
    # an entry for another platform is still validated here: a broken specifier must not wait for a CUDA run
    broken = _overlay(
        tmp_path,
        '[expected_failures."u1"]\nbecause = "x"\nfails = ["output"]\nplatforms = ["cuda"]\nversions = "~~1"\n',
    )
    with pytest.raises(ConfigError) as info:
        apply_target_overlay(_cases(), broken, Version("1.0"), platform="cpu")
    assert info.value.key == "expected_failures.u1.versions"


def test_a_command_line_override_keeps_the_expected_failure(tmp_path: Path) -> None:
    """`parity check --target X --dtype bf16` must still report X's known divergences as expected failures."""
    from harness.contracts.case import with_overrides

    path = _overlay(tmp_path, '[expected_failures."u1"]\nbecause = "bug 7"\nfails = ["output"]\n')
    marked = {c.id: c for c in apply_target_overlay(_cases(), path, Version("1.0"))}
    overridden = {c.id: c for c in with_overrides(marked.values(), dtype="bf16")}
    assert overridden["u1"].params["dtype"] == "bf16"
    assert overridden["u1"].expected_failure == marked["u1"].expected_failure is not None
    assert overridden["u2"].expected_failure is None


def test_a_case_glob_means_the_same_in_an_overlay_and_on_the_command_line(tmp_path: Path) -> None:
    """``m[*]`` (brackets literal, as matrix case ids have them) selects the matrix cases of m in both places."""
    from harness.cases.contract import CaseSelection, select_cases

    cases = [
        make_case("usp.ulysses_parity", {"world_size": 2}, case_id=f"m[dtype={d}]", source="base.toml")
        for d in ("fp32", "bf16")
    ]
    cases.append(make_case("usp.ulysses_parity", {"world_size": 2}, case_id="md", source="base.toml"))
    path = _overlay(tmp_path, '[expected_failures."m[*]"]\nbecause = "bug 7"\nfails = ["output"]\n')
    marked = [c.id for c in apply_target_overlay(cases, path, Version("1.0")) if c.expected_failure]
    selected = [c.id for c in select_cases(cases, CaseSelection(("m[*]",)))]
    assert marked == selected == ["m[dtype=fp32]", "m[dtype=bf16]"]


# --------------------------------------------------------------------------- backend overlays

FA_PINS = '[[expected_skips]]\nreason = "does not compute in torch.float32"\nbecause = "fp16/bf16 only"\n'


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        ("backend fa cannot run this case here: it does not compute in torch.float32", SKIPPED),
        ("backend fa cannot run this case here: head size 12 is not supported", FAILED),
    ],
    ids=["its-limit", "another-reason"],
)
def test_a_backend_overlay_pins_a_skip_by_its_reason_only(tmp_path: Path, reason: str, status: str) -> None:
    from harness.cases.overlays import apply_backend_overlays

    (tmp_path / "fa.toml").write_text(FA_PINS)
    cases = [
        make_case("usp.ulysses_parity", {"world_size": 2, "backend": backend}, case_id=backend, source="t")
        for backend in ("fa", "math")
    ]
    fa, other = apply_backend_overlays(cases, tmp_path)
    assert other.backend_skips == () and [p.because for p in fa.backend_skips] == ["fp16/bf16 only"]
    judged = expectations_applied(fa, CaseResult(fa.id, "usp.ulysses_parity", SKIPPED, reason), "reference")
    assert judged.status == status
    if status == SKIPPED:
        assert judged.reason.endswith("(pinned: fp16/bf16 only)")
    passed = expectations_applied(fa, CaseResult(fa.id, "usp.ulysses_parity", PASSED), "reference")
    assert passed.status == PASSED  # a backend's limit pins no case to skip: one that runs is fine


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[expected_skips.x]\nreason = 'r'\n", "expected_skips"),
        ("[[expected_skips]]\nreason = 'r'\n", "expected_skips[0].because"),
        ("[[expected_skips]]\nreason = 'r'\nbecause = 'b'\nversions = '>1'\n", "expected_skips[0].versions"),
        ("[overrides.x]\nbound = 'bitwise'\n", "overrides"),
        ("[[expected_skips]]\nbecause = 'b'\n", "expected_skips[0]"),
    ],
    ids=["not-an-array", "no-because", "unknown-key", "unknown-section", "neither-refusal-nor-reason"],
)
def test_backend_overlay_mistakes_name_file_and_key(tmp_path: Path, text: str, key: str) -> None:
    from harness.cases.overlays import apply_backend_overlays

    (tmp_path / "fa.toml").write_text(text)
    case = make_case("usp.ulysses_parity", {"world_size": 2, "backend": "fa"}, case_id="u", source="t")
    with pytest.raises(ConfigError) as err:
        apply_backend_overlays([case], tmp_path)
    assert err.value.key == key and "fa.toml" in str(err.value)


def test_the_pin_hint_names_the_overlay_of_the_cases_own_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A project's cases live in parity/cases/contracts: its hint names parity/cases/contracts/targets/X.toml."""
    project = tmp_path / "repo"
    source = project / "parity" / "cases" / "contracts" / "mine.toml"
    case = make_case("usp.ulysses_parity", {"world_size": 2}, case_id="u1", source=str(source))
    monkeypatch.chdir(tmp_path)
    got = expectations_applied(case, CaseResult("u1", "usp.ulysses_parity", SKIPPED, "cannot"), "stack")
    assert "pin it in repo/parity/cases/contracts/targets/stack.toml [expected_skips]" in got.reason
