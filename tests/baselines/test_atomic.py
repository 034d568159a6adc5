"""Atomic writes: a SIGKILLed writer leaves the old or the new complete file, never a torn one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.files import atomic
from harness.files.atomic import write_bytes_atomic, write_json_atomic

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="uses SIGKILL, SIGSTOP, POSIX modes and /proc"
)


def _spawn(code: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    )


def _temps(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def _writer_stopped_at_temp(target: Path, payload: dict, resume_when: Path | None = None) -> subprocess.Popen[str]:
    """A child writing ``payload`` to ``target`` atomically, stopped once its temp file is written and
    synced (it prints WRITTEN then): until ``resume_when`` exists, else for 60 s (long enough to be killed)."""
    wait = f"while not os.path.exists({str(resume_when)!r}): time.sleep(0.05)" if resume_when else "time.sleep(60)"
    return _spawn(
        f"""
        import os, time
        from harness.files import atomic
        real_fsync = os.fsync
        def fsync_then_stop(fd):
            real_fsync(fd)
            if os.path.basename(os.readlink(f"/proc/self/fd/{{fd}}")).endswith(".tmp"):
                print("WRITTEN", flush=True)
                {wait}
        atomic.os.fsync = fsync_then_stop
        atomic.write_json_atomic({str(target)!r}, {payload!r})
        """
    )


def test_normal_write_leaves_no_temp_and_round_trips(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "b.json"
    write_json_atomic(target, {"a": 1, "b": [1.5, "x"]})
    write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert _temps(target.parent) == []
    assert sorted(p.name for p in target.parent.iterdir()) == ["b.json"]


def test_backup_keeps_previous_version(tmp_path: Path) -> None:
    target = tmp_path / "t.json"
    write_json_atomic(target, {"v": 1}, backup=True)  # nothing to back up yet
    assert not (tmp_path / "t.json.bak").exists()
    write_json_atomic(target, {"v": 2}, backup=True)
    assert json.loads((tmp_path / "t.json.bak").read_text()) == {"v": 1}
    assert json.loads(target.read_text()) == {"v": 2}
    assert _temps(tmp_path) == []


def test_mode_of_existing_file_is_kept_and_new_file_follows_umask(tmp_path: Path) -> None:
    target = tmp_path / "m.json"
    old_umask = os.umask(0o022)
    try:
        write_bytes_atomic(target, b"{}")
        assert target.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
        os.chmod(target, 0o640)
        write_bytes_atomic(target, b"[]")
        assert target.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old_umask)


def test_nan_is_refused_before_touching_disk(tmp_path: Path) -> None:
    target = tmp_path / "n.json"
    target.write_text('{"old": true}')
    with pytest.raises(ValueError):
        write_json_atomic(target, {"x": float("nan")})
    assert target.read_text() == '{"old": true}'
    assert _temps(tmp_path) == []


def test_failed_write_removes_temp_and_keeps_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "f.json"
    target.write_text("old")

    def boom(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        write_bytes_atomic(target, b"new")
    assert target.read_text() == "old"
    assert _temps(tmp_path) == []


def test_sglang_style_serialisation() -> None:
    # json.dump(indent=4), no trailing newline: rewriting sglang's files is byte-identical.
    assert atomic.dump_json({"a": {"b": 1}}) == '{\n    "a": {\n        "b": 1\n    }\n}'


def test_sigkill_between_temp_write_and_rename_keeps_old_file(tmp_path: Path) -> None:
    target = tmp_path / "base.json"
    target.write_text(json.dumps({"version": "old"}))
    child = _writer_stopped_at_temp(target, {"version": "new", "payload": "x" * 100000})
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "WRITTEN"  # temp file complete, rename pending
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        child.kill()
        child.wait()
    assert json.loads(target.read_text()) == {"version": "old"}
    leftovers = _temps(tmp_path)
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".base.json.")  # hidden, never the target


def test_sigkill_at_random_moments_never_tears_the_target(tmp_path: Path) -> None:
    target = tmp_path / "stress.json"
    write_json_atomic(target, {"version": -1, "payload": ""})
    child = _spawn(
        f"""
        from harness.files.atomic import write_json_atomic
        i = 0
        print("GO", flush=True)
        while True:
            # ~1 MB documents whose payload length encodes the version: a torn or mixed file
            # either fails to parse or fails the consistency check below.
            write_json_atomic({str(target)!r}, {{"version": i, "payload": str(i % 10) * (1_000_000 + i)}})
            i += 1
        """
    )
    snapshots = []
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "GO"
        for delay in (0.05, 0.11, 0.17, 0.23, 0.31):
            time.sleep(delay)
            os.kill(child.pid, signal.SIGSTOP)  # freeze mid-whatever, read, resume
            snapshots.append(target.read_text())
            os.kill(child.pid, signal.SIGCONT)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        child.kill()
        child.wait()
    docs = [json.loads(text) for text in [*snapshots, target.read_text()]]  # every snapshot parses ...
    torn = [
        d["version"]
        for d in docs
        if d["version"] != -1 and d["payload"] != str(d["version"] % 10) * (1_000_000 + d["version"])
    ]
    assert not torn, f"versions whose payload is not their own: {torn}"  # ... and is one whole version
    seen = {d["version"] for d in docs[:-1]}
    assert len(seen) > 1, "the writer made no progress; the test did not exercise concurrent writes"
    assert len(_temps(tmp_path)) <= 1  # at most the one the kill interrupted


def _backdate(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_next_write_removes_the_temp_file_of_a_killed_writer(tmp_path: Path) -> None:
    target = tmp_path / "base.json"
    child = _writer_stopped_at_temp(target, {"version": "killed"})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "WRITTEN"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        child.kill()
        child.wait()
    (orphan,) = _temps(tmp_path)
    write_json_atomic(tmp_path / "other.json", {})
    assert _temps(tmp_path) == [orphan]  # younger than the grace: it could be a writer that has not locked yet
    _backdate(orphan, atomic.ORPHAN_GRACE_S + 1)
    write_json_atomic(tmp_path / "other.json", {"again": True})
    assert _temps(tmp_path) == []  # unlocked and old enough: its writer is dead


def test_a_live_writers_temp_file_is_never_removed(tmp_path: Path) -> None:
    target, go = tmp_path / "live.json", tmp_path / "go"
    child = _writer_stopped_at_temp(target, {"version": "live"}, resume_when=go)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "WRITTEN"
        (live,) = _temps(tmp_path)
        _backdate(live, atomic.STALE_TEMP_S * 2)  # however old it looks, its writer holds the lock
        write_json_atomic(tmp_path / "other.json", {})
        assert _temps(tmp_path) == [live]
        go.touch()
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
        child.wait()
    assert json.loads(target.read_text()) == {"version": "live"}  # its rename found its temp file
    assert _temps(tmp_path) == []


def test_without_locks_only_temps_older_than_an_hour_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(atomic, "fcntl", None)
    recent, stale = tmp_path / ".a.json.0123456789ab.tmp", tmp_path / ".b.json.ba9876543210.tmp"
    not_ours = [
        tmp_path / n for n in (".notes.tmp", "c.json.0123456789ab.tmp", ".d.json.XYZ.tmp", ".e.json.0123456789ab.tmpx")
    ]
    for path in (recent, stale, *not_ours):
        path.write_text("x")
        _backdate(path, atomic.STALE_TEMP_S + 10)
    _backdate(recent, atomic.STALE_TEMP_S - 60)
    write_bytes_atomic(tmp_path / "t.json", b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([recent.name, "t.json", *(p.name for p in not_ours)])


def test_check_writable_probes_without_leaving_anything(tmp_path: Path) -> None:
    from harness.errors import ConfigError

    atomic.check_writable(tmp_path / "new" / "dir", "--report", directory=True)
    atomic.check_writable(tmp_path / "out.json", "--json")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["dir", "new"]
    with pytest.raises(ConfigError, match="key '--json': is a directory"):
        atomic.check_writable(tmp_path / "new", "--json")
    with pytest.raises(ConfigError, match="key '--report': cannot write here"):
        atomic.check_writable(Path("/proc/forbidden"), "--report", directory=True)
