"""Every CLI value is validated before any work: exit 2, a message naming the argument and the valid values.

Each of these once ran cases (a traceback per case, 9 failed cells, a whole gate) before failing,
or failed with exit 1. Here each must exit 2 before a rank starts: starting one fails the test.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from harness.cli import main
from harness.ranks import PoolSet

pytestmark = pytest.mark.timeout(120)

CASES = '[cases.uly]\ncontract = "usp.ulysses_parity"\nworld_size = 2\ntokens_per_rank = 8\n'


@pytest.fixture(autouse=True)
def _no_rank_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before any work: a rank group asked for here is the bug."""

    def get(self: PoolSet, world: int) -> None:
        raise AssertionError(f"a {world}-rank group was started before the bad value was refused")

    def prestart(self: PoolSet, world_sizes: Iterable[int]) -> None:
        assert not list(world_sizes), "rank groups were started before the bad value was refused"

    monkeypatch.setattr(PoolSet, "get", get)
    monkeypatch.setattr(PoolSet, "prestart", prestart)


@pytest.fixture
def cases(tmp_path: Path) -> Path:
    (tmp_path / "contracts").mkdir()
    (tmp_path / "contracts" / "u.toml").write_text(CASES)
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["check", "--backend", "flashy"],
            "key '--backend': unknown attention backend 'flashy'; valid names: torch_sdpa, fa, sage_attn, math",
        ),
        (
            ["check", "--backend", "math", "--sdpa-kernel", "flash"],
            "key '--sdpa-kernel': a pinned SDPA kernel applies to torch_sdpa only",
        ),
        (
            ["sweep", "--backends", "nope", "--json", "{tmp}/s.json"],
            "key '--backends': unknown attention backend 'nope'",
        ),
        (
            ["sweep", "--backends", "torch_sdpa:fast", "--json", "{tmp}/s.json"],
            "key '--backends': unknown SDPA kernel 'fast'; valid: math, flash, efficient, cudnn",
        ),
        (["sweep", "--json", "/proc/nope/s.json"], "/proc/nope/s.json: key '--json': cannot write here"),
        (
            ["sweep", "--world-sizes", "2", "0", "--json", "{tmp}/s.json"],
            "argument --world-sizes: must be in [1, 1024], got 0",
        ),
        (["check", "--timeout", "-5"], "argument --timeout: must be a finite number of seconds > 0, got '-5'"),
        (["check", "--timeout", "inf"], "argument --timeout: must be a finite number of seconds > 0, got 'inf'"),
        (["check", "--timeout", "soon"], "argument --timeout: not a number of seconds: 'soon'"),
        (["bless", "--timeout", "0"], "argument --timeout: must be a finite number of seconds > 0, got '0'"),
        (["check", "--world-size", "4096"], "argument --world-size: must be in [1, 1024], got 4096"),
        (["check", "--json", "{tmp}/dir.json"], "key '--json': is a directory; give a file name"),
        (["check", "--junit", "/proc/nope/j.xml"], "key '--junit': cannot write here"),
        (["gate", "--report", "/proc/forbidden"], "/proc/forbidden: key '--report': cannot write here"),
        (["gate", "--json", "/proc/nope/r.json"], "key '--json': cannot write here"),
        (["matrix", "{tmp}/none.json", "-o", "/proc/nope/m.md"], "key '--output': cannot write here"),
    ],
)
def test_bad_argument_exits_2_before_any_work(
    argv: list[str], message: str, cases: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.format(tmp=tmp_path) for a in argv]
    (tmp_path / "dir.json").mkdir()  # a directory where a file is asked for
    if argv[0] in ("check", "sweep", "gate"):
        argv += ["--cases", str(cases)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "PARITY_PERF_TOL_E2E",
            "abc",
            "key 'PARITY_PERF_TOL_E2E': environment variable must be a number in [0, 1e+06], got 'abc'",
        ),
        ("PARITY_PERF_TOL_E2E", "nan", "got 'nan'"),
        (
            "PARITY_PERF_TOL_DENOISE_STEPS",
            "0.1",
            "key 'PARITY_PERF_TOL_DENOISE_STEPS': unknown variable; valid: PARITY_PERF_TOL_E2E",
        ),
        (
            "PARITY_PLATFORM",
            "tpu",
            "key 'PARITY_PLATFORM': unknown platform 'tpu' in 'tpu'; valid: cuda, rocm, mps, cpu",
        ),
    ],
)
def test_bad_environment_exits_2_before_any_work(
    variable: str,
    value: str,
    message: str,
    cases: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["gate", "--no-perf", "--cases", str(cases)]) == 2  # perf off: a bad override is still an error
    err = capsys.readouterr().err
    assert message in err, err


def test_platform_env_is_checked_for_every_verb(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PARITY_PLATFORM", "rocm:sm90")
    assert main(["doctor"]) == 2
    assert "key 'PARITY_PLATFORM': 'rocm:sm90': 'sm90' is not a gcn arch" in capsys.readouterr().err
    monkeypatch.setenv("PARITY_PLATFORM", "rocm:gfx950")
    assert main(["list", "--json", "-"]) == 0
