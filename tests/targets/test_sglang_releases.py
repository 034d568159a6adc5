"""The sglang releases parity claims: the install script's table, the adapter's OLDEST, each release's ring refusal.

No sglang is needed: the refusal texts are each release's own words (USPAttention.__init__ of the
wheel), and the table is scripts/sglang_cpu/releases.toml as resolve.py reads it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from harness.targets import sglang as sglang_target

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "sglang_cpu"
_spec = importlib.util.spec_from_file_location("sglang_cpu_resolve", SCRIPTS / "resolve.py")
resolve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(resolve)

# sglang 0.5.17, layer.py:588 (a list of backends) and 0.5.19, layer.py:776 (a backend capability, PR #33928).
OLD_WORDS = (
    "Ring Attention is only supported for FlashAttention or SageAttention backends, but got TORCH_SDPA. "
    "Please ensure your platform supports these backends."
)
NEW_WORDS = (
    "Ring Attention requires a backend whose kernel exposes the softmax LSE for the per-hop merge; TORCH_SDPA "
    "does not declare support (see AttentionBackend.supports_ring_rotation)."
)


@pytest.mark.parametrize(
    ("version", "message", "refusal"),
    [
        ("0.5.16", OLD_WORDS, True),
        ("0.5.17", OLD_WORDS, True),
        ("0.5.17", NEW_WORDS, False),
        ("0.5.18", NEW_WORDS, True),
        ("0.5.23", NEW_WORDS, True),
        ("0.5.23", OLD_WORDS, False),
        ("0.5.23", "RuntimeError: out of memory", False),
        ("0.5.15", OLD_WORDS, False),
    ],
    ids=[
        "0.5.16-old",
        "0.5.17-old",
        "0.5.17-new",
        "0.5.18-new",
        "0.5.23-new",
        "0.5.23-old",
        "0.5.23-other",
        "older-than-OLDEST",
    ],
)
def test_a_ring_refusal_is_recognised_in_its_releases_words(version: str, message: str, refusal: bool) -> None:
    assert sglang_target.is_ring_refusal(Version(version), message) is refusal


def test_ring_refusal_words_cover_every_release_from_oldest() -> None:
    firsts = [since for since, _ in sglang_target.RING_REFUSALS]
    assert firsts == sorted(firsts, reverse=True) and firsts[-1] == sglang_target.OLDEST
    assert sglang_target.is_ring_refusal(None, OLD_WORDS) is False  # not installed: nothing is a refusal


def test_the_install_table_spans_oldest_to_its_default() -> None:
    default, groups = resolve.load()
    releases = sorted(map(Version, groups))
    assert releases[0] == sglang_target.OLDEST
    assert releases[-1] == Version(default)  # CI's release is the newest claimed


@pytest.mark.parametrize(
    ("release", "pinned", "unpinned"),
    [
        ("0.5.17", {"sglang==0.5.17", "transformers==5.12.1", "cache-dit==1.3.0", "xgrammar"}, set()),
        ("0.5.23", {"sglang==0.5.23", "apache-tvm-ffi==0.1.11"}, {"transformers", "diffusers"}),
    ],
)
def test_a_release_gets_its_own_lines_and_one_line_per_package(
    release: str, pinned: set[str], unpinned: set[str]
) -> None:
    default, groups = resolve.load()
    lists = resolve.requirements(release, groups[release])
    no_deps = lists["no_deps"]
    assert pinned | unpinned <= set(no_deps)
    names = [resolve.name_of(r) for r in no_deps + lists["deps"]]
    assert len(names) == len(set(names)), names  # a release's pin replaced the common line
    assert sum(r.startswith("sglang") for r in no_deps) == 1


def test_an_unknown_release_exits_2_naming_the_known_ones(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "resolve.py"), "--version", "0.4.0", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "known: 0.5.16, 0.5.17" in done.stderr and not list(tmp_path.iterdir())
    done = subprocess.run([sys.executable, str(SCRIPTS / "resolve.py"), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == resolve.load()[0]
    assert "sglang==" + done.stdout.strip() in (tmp_path / "requirements-no-deps.txt").read_text()


@pytest.mark.parametrize("release", [str(sglang_target.OLDEST), resolve.load()[0]], ids=["oldest", "newest"])
def test_every_line_the_script_installs_for_a_release_resolves_on_the_index(release: str, tmp_path: Path) -> None:
    """Each pin the install script would pass to pip (name==version, python tag, platform) exists on the package
    index, checked by pip itself with --dry-run: a yanked or mistyped pin fails here, not on a user's machine."""
    subprocess.run([sys.executable, str(SCRIPTS / "resolve.py"), "--version", release, str(tmp_path)], check=True)
    lists = [arg for name in ("requirements-no-deps.txt", "requirements.txt") for arg in ("-r", str(tmp_path / name))]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "-q", *lists],
        capture_output=True,
        text=True,
    )
    unresolved = ("No matching distribution", "Could not find a version", "ResolutionImpossible")
    if done.returncode != 0 and not any(words in done.stderr for words in unresolved):
        pytest.skip(f"pip could not reach a package index here: {done.stderr.strip().splitlines()[-1:]}")
    assert done.returncode == 0, done.stderr[-2000:]
