"""The requirement files for one sglang release on the CPU: the common files plus its group in releases.toml.

Run by install-sglang-cpu.sh with the venv's Python (standard library only: the venv may hold
nothing but torch). ``resolve.py [--version V] OUTDIR`` writes OUTDIR/requirements.txt and
OUTDIR/requirements-no-deps.txt and prints the release; an unknown release exits 2 naming those
known. ``resolve.py --list`` prints the releases, the default marked.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMON = {"deps": HERE / "requirements.txt", "no_deps": HERE / "requirements-no-deps.txt"}


def load(path: Path = HERE / "releases.toml") -> tuple[str, dict[str, dict]]:
    """The default release and each release's group (every release in exactly one group)."""
    data = tomllib.loads(path.read_text())
    groups: dict[str, dict] = {}
    for group in data["group"]:
        for release in group["releases"]:
            if release in groups:
                raise ValueError(f"{path}: release {release} is in two groups")
            groups[release] = group
    if data["default"] not in groups:
        raise ValueError(f"{path}: default {data['default']} is in no group")
    return data["default"], groups


def name_of(requirement: str) -> str:
    """A requirement's project name, normalised as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[=<>!~\[; ]", requirement.strip(), maxsplit=1)[0]).lower()


def lines(path: Path) -> list[str]:
    return [req for line in path.read_text().splitlines() if (req := line.split("#", 1)[0].strip())]


def requirements(release: str, group: dict) -> dict[str, list[str]]:
    """Both lists for ``release``: common lines, the group's additions, a same-named group line replacing a common one."""
    out = {}
    for kind, path in COMMON.items():
        extra = [req.split("#", 1)[0].strip() for req in group[kind]]
        replaced = {name_of(req) for req in extra}
        common = [req for req in lines(path) if name_of(req) not in replaced | {"sglang"}]
        out[kind] = common + extra + ([f"sglang=={release}"] if kind == "no_deps" else [])
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", help="the sglang release (default: releases.toml's default)")
    parser.add_argument("--list", action="store_true", help="print the known releases and exit")
    parser.add_argument("outdir", nargs="?", type=Path)
    args = parser.parse_args(argv)
    default, groups = load()
    if args.list:
        print("\n".join(f"{r}{' (default)' if r == default else ''}" for r in groups))
        return 0
    release = args.version or default
    if release not in groups:
        print(
            f"install-sglang-cpu: sglang {release} is not a release this script knows; known: {', '.join(groups)} "
            f"(scripts/sglang_cpu/releases.toml)",
            file=sys.stderr,
        )
        return 2
    if args.outdir is None:
        parser.error("OUTDIR is required")
    for kind, reqs in requirements(release, groups[release]).items():
        (args.outdir / COMMON[kind].name).write_text("\n".join(reqs) + "\n")
    print(release)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
