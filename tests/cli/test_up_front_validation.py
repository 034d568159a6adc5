"""Every command-line value, variable and case field is checked before any work: exit 2, one line naming what
is wrong, no traceback (each once ended in a traceback, or ran, or exited 0 having run nothing).

One row per hostile value: the verb's arguments (``{tmp}``: the test's folder, ``{cases}``: a cases
root holding the row's image case file), the environment, the exit code and what stderr says.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]
CASE = "ulysses[world_size=1,dtype=fp32,causal=false]"
COMMAND = '[cases.cmd]\ntarget = "command"\ntemplate = "true {out_dir} {seed}"\nseed = 1\nheight = 8\nwidth = 8\n'
MODULES = {"synerr.py": "def factory(:\n", "raiser.py": "raise RuntimeError('boom at import')\n"}

# (id, arguments, environment, image case file or "", what stderr must say)
ROWS = [
    ("list_json_is_a_directory", ["list", "--json", "{tmp}/out.json"], {}, "", "key '--json': is a directory"),
    ("doctor_json_is_a_directory", ["doctor", "--json", "{tmp}/out.json"], {}, "", "key '--json': is a directory"),
    (
        "compare_json_is_a_directory",
        ["compare", "{tmp}/a.json", "{tmp}/b.json", "--json", "{tmp}/out.json"],
        {},
        "",
        "key '--json': is a directory",
    ),
    ("bless_json_is_a_directory", ["bless", "x", "--json", "{tmp}/out.json"], {}, "", "key '--json': is a directory"),
    ("list_json_below_a_file", ["list", "--json", "{tmp}/file/out.json"], {}, "", "key '--json': cannot write here"),
    (
        "start_method_bogus",
        ["check", CASE],
        {"PARITY_START_METHOD": "bogus"},
        "",
        "key 'PARITY_START_METHOD': 'bogus' is not a start method; valid: forkserver, spawn",
    ),
    ("factory_needs_an_argument", ["check", CASE, "--target", "time:sleep"], {}, "", "target 'time:sleep'"),
    ("factory_module_syntax_error", ["check", CASE, "--target", "synerr:factory"], {}, "", "SyntaxError"),
    (
        "factory_module_raises_at_import",
        ["check", CASE, "--target", "raiser:factory"],
        {},
        "",
        "RuntimeError: boom at import",
    ),
    ("factory_exits", ["check", CASE, "--target", "sys:exit"], {}, "", "exit() raised SystemExit"),
    ("factory_returns_no_target", ["check", CASE, "--target", "os:getcwd"], {}, "", "getcwd() returned str"),
    (
        "pipeline_timeout_inf",
        [
            "bless",
            "--all",
            "--dry-run",
            "--cases",
            "{cases}",
            "--pipeline-target",
            "command",
            "--pipeline-target-arg",
            "timeout=inf",
        ],
        {},
        COMMAND.replace('target = "command"\n', ""),
        "timeout must be a finite number of seconds",
    ),
    (
        "pipeline_timeout_1e309",
        [
            "bless",
            "--all",
            "--dry-run",
            "--cases",
            "{cases}",
            "--pipeline-target",
            "command",
            "--pipeline-target-arg",
            "timeout=1e309",
        ],
        {},
        COMMAND.replace('target = "command"\n', ""),
        "timeout must be a finite number of seconds",
    ),
    (
        "pipeline_arg_reaching_no_case",
        ["gate", "--cases", "{cases}", "--pipeline-target-arg", "timeout=3"],
        {},
        COMMAND,
        "key '--pipeline-target-arg': no image case runs on --pipeline-target 'reference'",
    ),
    (
        "template_width_2e9",
        ["bless", "--all", "--dry-run", "--cases", "{cases}"],
        {},
        COMMAND.replace("{seed}", "{seed:2000000000d}"),
        "width or precision 2000000000 is above 1024",
    ),
    (
        "nul_in_a_case_field",
        ["bless", "--all", "--dry-run", "--cases", "{cases}"],
        {},
        COMMAND.replace("seed = 1", 'seed = "1\\u0000"'),
        "key 'cases.cmd.seed': a NUL character",
    ),
    (
        "case_timeout_inf",
        ["bless", "--all", "--dry-run", "--cases", "{cases}"],
        {},
        COMMAND + "timeout = inf\n",
        "key 'cases.cmd.timeout'",
    ),
    (
        "missing_text_encoder_dir",
        ["bless", "--all", "--dry-run", "--cases", "{cases}"],
        {},
        '[cases.ref]\ntext_encoder_dir = "{tmp}/no-such-encoder"\n',
        "key 'cases.ref.text_encoder_dir'",
    ),
    (
        "missing_executable",
        ["bless", "--all", "--dry-run", "--cases", "{cases}"],
        {},
        COMMAND.replace("true {out_dir}", "no-such-generator {out_dir}"),
        "'no-such-generator': not found on PATH",
    ),
]


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "out.json").mkdir()
    (tmp_path / "file").write_text("a regular file")
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(("args", "env", "case_file", "says"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_a_hostile_value_exits_2_before_any_work(
    args: list[str],
    env: dict[str, str],
    case_file: str,
    says: str,
    folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cases = folder / "cases"
    (cases / "images").mkdir(parents=True)
    (cases / "contracts").mkdir()
    (cases / "contracts" / "c.toml").write_text('[cases.u]\ncontract = "usp.ulysses_parity"\nworld_size = 1\n')
    if case_file:
        (cases / "images" / "c.toml").write_text(case_file.replace("{tmp}", str(folder)))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main([a.format(tmp=folder, cases=cases) for a in args]) == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err


def test_parity_as_its_own_target_factory_exits_2(tmp_path: Path) -> None:
    """``harness.cli:main`` called as a factory would run parity again on the same arguments, forever."""
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "check", CASE, "--target", "harness.cli:main"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "its factory loads 'harness.cli:main' again" in done.stderr
