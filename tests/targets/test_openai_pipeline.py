"""The ``openai`` pipeline target against a server parity's code did not write (``images_api_server.py``) and
against ``parity serve``: bless and gate, a changed image failing, every bad server a failed case with its
status and body (never a traceback), A/Bs of two launched servers, and no server left after any ending.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main
from harness.errors import ConfigError, ParamError
from harness.targets.base import PipelineFailed, Timings
from harness.targets.openai_images import image_of, request_body, timings_of
from harness.targets.openai_pipeline import factory
from harness.targets.served import free_port
from tests.gate_project import clip_pinned

pytestmark = pytest.mark.timeout(300)

SERVER = Path(__file__).with_name("images_api_server.py")
REPO = Path(__file__).resolve().parents[2]
CASES = '[defaults]\nprompt = "a lighthouse"\nseed = 3\nheight = 16\nwidth = 24\n\n[cases.served]\n'


def launch(tag: str, *options: str) -> str:
    """The launch template of the independent server, marked with ``tag`` so its processes can be found."""
    return shlex.join([sys.executable, str(SERVER), "--port", "{port}", "--tag", tag, *options])


def tagged(tag: str, servers_only: bool = False) -> list[int]:
    """Live processes whose command line holds ``tag`` (with ``servers_only``: the servers, not their keepers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            server = len(argv) > 1 and argv[1].endswith(SERVER.name.encode())
            if tag.encode() in b" ".join(argv) and state != "Z" and (server or not servers_only):
                found.append(int(entry.name))
    return found


def gone(tag: str, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while tagged(tag) and time.monotonic() < deadline:  # poll: the keeper ends the server within its grace
        time.sleep(0.1)
    return not tagged(tag)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "cases" / "images").mkdir(parents=True)
    (tmp_path / "cases" / "images" / "served.toml").write_text(clip_pinned(CASES))
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "consistency_threshold.json").write_text(
        (REPO / "baselines" / "consistency_threshold.json").read_text()
    )
    return tmp_path


def parity(project: Path, verb: str, *argv: str) -> tuple[int, dict[str, Any]]:
    out = project / f"{verb}.json"
    code = main([verb, *argv, "--cases", str(project / "cases"), "--baselines", str(project / "baselines"),
                 "--json", str(out)])  # fmt: skip
    return code, json.loads(out.read_text()) if out.exists() else {}


def openai_args(tag: str, *options: str, args: tuple[str, ...] = ()) -> list[str]:
    """The options that make the openai target launch the independent server."""
    target = ["--pipeline-target", "openai", "--pipeline-target-arg", f"launch={launch(tag, *options)}"]
    return target + [f"--pipeline-target-arg={a}" for a in args]


def served(project: Path, verb: str, tag: str, *options: str, args: tuple[str, ...] = ()) -> tuple[int, dict]:
    """``verb`` with the openai target launching the independent server."""
    return parity(project, verb, *openai_args(tag, *options, args=args))


def images_record(doc: dict[str, Any]) -> dict[str, Any]:
    (record,) = doc["stages"]["images"]["records"]
    return record


def test_bless_then_gate_pass_and_a_changed_image_fails(project: Path) -> None:
    tag = uuid.uuid4().hex
    code, blessed = parity(project, "bless", "--all", *openai_args(tag))
    assert code == 0 and [c["change"] for c in blessed["changes"]] == ["new"]
    code, doc = served(project, "gate", tag)
    record = images_record(doc)
    assert (code, record["status"]) == (0, "passed") and record["figures"]["mean_abs_diff"] == 0.0
    assert record["kernel"].startswith("server: http://127.0.0.1:") and "server inference_time_s" in record["kernel"]
    code, doc = served(project, "gate", tag, "--mode", "changed")
    record = images_record(doc)
    assert (code, record["status"]) == (1, "failed") and "psnr" in record["reason"]
    assert gone(tag), "a launched server outlived parity"


BAD_SERVERS = {
    "http500": ("HTTP 500", "CUDA out of memory"),
    "not-json": ("the answer is not JSON", "502 Bad Gateway"),
    "no-image": ("data[0] has no b64_json image (keys: url)", None),
    "wrong-size": ("is an image of shape (16, 32, 3), the case asks for (16, 24, 3)", None),
    "jpeg": ("not a PNG file", None),
    "die": ("the server ended (exit status 3)", "images_api_server: listening"),
    "hang": ("no answer within 2 s", None),
}


@pytest.mark.parametrize("mode", BAD_SERVERS)
def test_a_bad_server_fails_its_case_with_what_it_said_and_ends(project: Path, mode: str) -> None:
    tag = uuid.uuid4().hex
    reason, detail = BAD_SERVERS[mode]
    code, doc = served(project, "gate", tag, "--mode", mode, args=("timeout=2",))
    record = images_record(doc)
    assert (code, record["status"]) == (1, "failed"), record
    assert reason in record["reason"], record["reason"]
    assert detail is None or detail in (record["traceback"] or ""), record["traceback"]
    assert "Traceback" not in (record["traceback"] or "")
    assert gone(tag)


@pytest.mark.parametrize(
    ("template", "args", "reason", "log"),
    [
        (
            [sys.executable, "-c", "import sys; print('boom: no GPU', file=sys.stderr); sys.exit(4)", "{port}"],
            (),
            "the server exited before it was ready (exit status 4)",
            "boom: no GPU",
        ),
        (
            [sys.executable, str(SERVER), "--port", "{port}", "--never-ready"],
            ("ready_timeout=1.5",),
            "the server was not ready after 1.5 s (no 200 from /health or /v1/models",
            "",  # under load the server may not have printed anything in 1.5 s
        ),
    ],
    ids=["exits", "never-ready"],
)
def test_a_server_that_never_gets_ready_fails_with_its_log(
    project: Path, template: list[str], args: tuple[str, ...], reason: str, log: str
) -> None:
    tag = uuid.uuid4().hex
    target = ["--pipeline-target", "openai", "--pipeline-target-arg", f"launch={shlex.join(template)} --tag {tag}"]
    code, doc = parity(project, "gate", *target, *(f"--pipeline-target-arg={a}" for a in args))
    record = images_record(doc)
    assert (code, record["status"]) == (1, "failed") and reason in record["reason"], record["reason"]
    assert log in record["traceback"] and gone(tag)


def test_nothing_answering_at_the_url_fails_the_case(project: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, doc = parity(project, "gate", "--pipeline-target", "openai", "--pipeline-target-arg", f"url={url}")
    record = images_record(doc)
    assert (code, record["status"]) == (1, "failed")
    assert record["reason"] == f"no server answers at {url} (no 200 from /health or /v1/models)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"url": "http://x", "launch": "serve {port}"}, "exactly one of url="),
        ({"url": "ftp://x"}, "must start with http://"),
        ({"launch": f"{sys.executable} server.py"}, "must pass {port}"),
        ({"launch": "no-such-server-binary {port}"}, "launch: 'no-such-server-binary': not found on PATH"),
        ({"launch": "'unclosed {port}"}, "cannot split"),
        ({"url": "http://x", "timeout": "-1"}, "timeout must be a finite number of seconds"),
        ({"url": "http://x", "perf_dump": "yes"}, "perf_dump must be true or false"),
    ],
)
def test_target_argument_mistakes_name_the_option(args: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        factory(**args)
    assert info.value.key == "--pipeline-target-arg"


FIELDS = {"prompt": "p", "height": 16, "width": 16}


def test_a_target_built_bare_is_refused_at_its_first_case() -> None:
    with pytest.raises(ConfigError, match="exactly one of url=") as info:
        factory().check_case(FIELDS, 1)  # parity list builds every target bare
    assert info.value.key == "--pipeline-target-arg"
    assert factory(url="http://127.0.0.1:1").check_case(FIELDS, 1) == "image"


@pytest.mark.parametrize(
    ("key", "value"), [("num_frames", 3), ("n", 2), ("response_format", "url"), ("guidance", [1, 2]), ("width", 0)]
)
def test_a_video_case_and_parity_owned_fields_are_refused_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ParamError) as info:
        factory(url="http://127.0.0.1:1").check_case({**FIELDS, key: value}, 1)
    assert info.value.key == key


def test_the_request_body_follows_the_images_api() -> None:
    body = request_body(
        {"prompt": "a fox", "width": 64, "height": 32, "seed": 7, "num_inference_steps": 9}, "zimage", "/t/d.json"
    )
    assert body == {
        "prompt": "a fox",
        "size": "64x32",
        "n": 1,
        "response_format": "b64_json",
        "model": "zimage",
        "seed": 7,
        "num_inference_steps": 9,
        "perf_dump_path": "/t/d.json",
    }


def test_timings_come_from_the_perf_dump_then_the_answer_then_the_round_trip(tmp_path: Path) -> None:
    dump = tmp_path / "timings.json"
    dump.write_text(json.dumps({"total_duration_ms": 90.0, "steps": [{"name": "DenoisingStage", "duration_ms": 70}],
                                "denoise_steps_ms": [{"step": 0, "duration_ms": 35}, {"step": 1, "duration_ms": 35}]}))  # fmt: skip
    assert timings_of({}, 120.0, dump) == Timings(90.0, {"DenoisingStage": 70.0}, [35.0, 35.0], "sglang perf dump")
    assert timings_of({"inference_time_s": 0.08}, 120.0, None) == Timings(80.0, {}, [], "server inference_time_s")
    assert timings_of({}, 120.0, None) == Timings(120.0, {}, [], "request round trip")
    with pytest.raises(PipelineFailed, match="it wrote none"):
        timings_of({}, 1.0, tmp_path / "absent" / "timings.json")


@pytest.mark.parametrize("seconds", [0, -1.0, "1", True])
def test_a_server_time_that_is_not_a_positive_number_fails_the_run(seconds: object) -> None:
    with pytest.raises(PipelineFailed, match="inference_time_s must be a positive number"):
        timings_of({"inference_time_s": seconds}, 1.0, None)


def test_an_answer_with_a_broken_image_fails_naming_what_is_wrong() -> None:
    def doc(data: Any) -> dict[str, Any]:
        return {"data": data}

    with pytest.raises(PipelineFailed, match="expected data with one image, got 2"):
        image_of(doc([{}, {}]), (8, 8, 3), "u")
    with pytest.raises(PipelineFailed, match="not base64"):
        image_of(doc([{"b64_json": "@@@"}]), (8, 8, 3), "u")
    with pytest.raises(PipelineFailed, match="not a PNG"):
        image_of(doc([{"b64_json": base64.b64encode(b"GIF89a....").decode()}]), (8, 8, 3), "u")


# ------------------------------------------------------------------------------------------- A/B


AB = ("--max-pairs", "200", "--min-pairs", "12", "--launches", "3")


def ab(project: Path, tag: str, base: tuple[str, ...], head: tuple[str, ...]) -> tuple[int, dict[str, Any]]:
    return parity(project, "perf", "openai", "openai", "--base-arg", f"launch={launch(tag, *base)}",
                  "--head-arg", f"launch={launch(tag, *head)}", *AB)  # fmt: skip


@pytest.mark.timeout(900)  # a hang guard: under load an A/B may run to its 200-pair cap (over 300 s measured)
def test_an_ab_of_two_identical_servers_is_not_slower_and_each_side_is_launched_afresh(project: Path) -> None:
    from tests.perf.test_ab import assert_not_slower

    tag = uuid.uuid4().hex
    code, doc = ab(project, tag, (), ())
    (record,) = doc["stages"]["perf"]["records"]
    assert_not_slower(record, code)
    assert record["figures"]["launches"] >= 3
    assert record["figures"]["base"]["target"] == record["figures"]["head"]["target"] == "openai"
    assert record["target"] == "openai vs openai"  # the record names both sides, not the contract target
    assert doc["stages"]["perf"]["heads"]["served"]["target"] == "openai"
    assert gone(tag)


@pytest.mark.timeout(900)  # a hang guard: under load an A/B may run to its 200-pair cap (over 300 s measured)
def test_an_ab_of_a_server_25_percent_slower_finds_it_slower(project: Path) -> None:
    from tests.perf.test_ab import assert_slower

    tag = uuid.uuid4().hex
    code, doc = ab(project, tag, (), ("--slowdown", "1.25"))
    (record,) = doc["stages"]["perf"]["records"]
    assert_slower(record, code)
    assert gone(tag)


class MostServers:
    """The most servers tagged ``tag`` alive at once while the ``with`` body runs, sampled every 20 ms."""

    def __init__(self, tag: str) -> None:
        self.tag, self.most, self._done = tag, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.02):  # poll: how many servers are up now
            self.most = max(self.most, len(tagged(self.tag, servers_only=True)))

    def __enter__(self) -> MostServers:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()


@pytest.mark.timeout(900)  # a hang guard: under load an A/B may run to its 200-pair cap (over 300 s measured)
@pytest.mark.parametrize(
    ("options", "replicas", "overlapped"),
    [(("--overlap-launches",), 1, True), (("--replicas", "2"), 2, False)],
    ids=["overlapped", "two-replicas"],
)
def test_launches_of_several_server_pairs_pass_two_identical_servers_and_leave_none(
    project: Path, options: tuple[str, ...], replicas: int, overlapped: bool
) -> None:
    """Four servers alive at once, never more: two launches' (overlapped), or two replicas of each side."""
    from tests.perf.test_ab import assert_not_slower

    tag = uuid.uuid4().hex
    with MostServers(tag) as servers:
        code, doc = parity(project, "perf", "openai", "openai", "--base-arg", f"launch={launch(tag, '--delay-ms', '50')}",
                           "--head-arg", f"launch={launch(tag, '--delay-ms', '50')}", *AB, *options)  # fmt: skip
    (record,) = doc["stages"]["perf"]["records"]
    assert_not_slower(record, code)
    figures = record["figures"]
    blocks = set(figures["samples"]["expected_e2e_ms"]["launch"])
    assert figures["launches"] * replicas >= 3  # each side started afresh --launches times, a launch of 2 counts 2
    assert figures["overlapped_launches"] == overlapped * (figures["launches"] - 1)
    assert figures["replicas"] == replicas and blocks == set(range(replicas * figures["launches"]))
    assert servers.most == 4 and "overlap_refused" not in figures
    assert gone(tag)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
@pytest.mark.parametrize(
    ("options", "up"),
    [((), 2), (("--overlap-launches",), 3), (("--replicas", "2"), 4)],
    ids=["one-by-one", "overlapped", "two-replicas"],
)
def test_no_server_survives_parity_ended_mid_ab(
    project: Path, sig: signal.Signals, options: tuple[str, ...], up: int
) -> None:
    """Ended once ``up`` servers are alive: both sides', overlapped the next launch's starting beside them, or two
    replicas of each side."""
    tag = uuid.uuid4().hex
    argv = [str(Path(sys.executable).with_name("parity")), "perf", "openai", "openai",
            "--base-arg", f"launch={launch(tag, '--delay-ms', '200')}",
            "--head-arg", f"launch={launch(tag, '--delay-ms', '200')}",
            "--cases", str(project / "cases"), "--max-pairs", "200", *options]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(tagged(tag, servers_only=True)) < up and time.monotonic() < deadline:  # poll: the servers are up
            time.sleep(0.05)
        assert len(tagged(tag, servers_only=True)) >= up, f"the A/B never had {up} servers up"
        proc.send_signal(sig)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert gone(tag), f"servers outlived parity after {sig.name}: {tagged(tag)}"
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and b"Traceback" not in proc.stderr.read()  # type: ignore[union-attr]


# --------------------------------------------------------------------------- a port taken before the server binds it


def _taken_first(marker: Path, times: int, tag: str) -> str:
    """A launch template that fails as a server whose port was taken, ``times`` times, then starts the real one."""
    script = (
        f"n=$(cat {marker} 2>/dev/null || echo 0); echo $((n + 1)) > {marker}; "
        f'if [ "$n" -lt {times} ]; then echo "OSError: [Errno 98] Address already in use"; exit 1; fi; '
        f'exec {shlex.join([sys.executable, str(SERVER), "--tag", tag])} --port "$0"'
    )
    return shlex.join(["sh", "-c", script, "{port}"])


@pytest.mark.parametrize(("taken", "starts"), [(2, True), (3, False)], ids=["taken-twice", "taken-every-time"])
def test_a_port_taken_before_the_server_binds_it_is_tried_again_on_another(
    tmp_path: Path, taken: int, starts: bool
) -> None:
    from harness.targets.base import PipelineFailed
    from harness.targets.served import PORT_ATTEMPTS, launch

    tag = uuid.uuid4().hex
    template, marker = _taken_first(tmp_path / "tries", taken, tag), tmp_path / "tries"
    if starts:
        server = launch(template, ready_timeout=120.0)
        try:
            assert server.exited() is None and marker.read_text().strip() == str(taken + 1)
        finally:
            server.stop()
    else:
        with pytest.raises(PipelineFailed, match="Address already in use"):
            launch(template, ready_timeout=120.0)
        assert marker.read_text().strip() == str(PORT_ATTEMPTS)  # and no more
    assert gone(tag)
