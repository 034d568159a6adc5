"""The ``openai`` pipeline target: a model behind an HTTP server speaking the OpenAI Images API.

``--pipeline-target openai --pipeline-target-arg url=http://HOST:PORT`` attaches to a running
server; ``launch='sglang serve --model-path M --port {port}'`` makes parity start it on a free
port (``{world_size}`` also filled, one server per degree), wait until it answers, and stop it
with its whole tree when the run ends, fails or is interrupted (:mod:`harness.targets.served`). A
server is started once and kept for every case; an A/B launches each side afresh per launch block
(:meth:`OpenAIPipelineTarget.stop`). Requests and timings: :mod:`harness.targets.openai_images`;
the guide: docs/targets/served.md.
"""

from __future__ import annotations

import atexit
import shlex
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import ConfigError, ParamError
from harness.targets.base import PipelineFailed, PipelineOutput, PipelineTarget
from harness.targets.command_pipeline import TIMINGS_FILE, check_executable, target_seconds
from harness.targets.openai_images import (
    ENDPOINT,
    ConnectionLost,
    image_of,
    post,
    read_answer,
    request_body,
    timings_of,
)
from harness.targets.served import READY_PATHS, LaunchedServer, answers, launch

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_READY_TIMEOUT_S = 600.0
SERVER_END_WAIT_S = 15.0  # a connection that broke: how long the server may take to be seen ended (2 s missed one
# that exited at once, on a 2-core box at load 18); only a server that lives on after it waits that long
_JSON_SCALARS = (str, int, float, bool)
_ONE_OF = (
    "the openai target needs exactly one of url=http://HOST:PORT (a running server) or launch='CMD ... {port}' "
    "(parity starts it): --pipeline-target-arg, in parity perf --base-arg or --head-arg"
)
_LIVE: list[OpenAIPipelineTarget] = []  # targets holding launched servers: stopped at exit whatever happened


def _stop_all() -> None:
    for target in list(_LIVE):
        target.stop()


atexit.register(_stop_all)


class OpenAIPipelineTarget(PipelineTarget):
    """A served model (module docstring); runs in the gate's process (``runs_in_ranks`` False)."""

    name = "openai"
    runs_in_ranks = False

    def __init__(
        self, url: str | None, launch: str | None, model: str | None, timeout: float, ready: float, perf_dump: bool
    ) -> None:
        self.url, self.launch, self.model = url, launch, model
        self.timeout, self.ready_timeout, self.perf_dump = timeout, ready, perf_dump
        self._servers: dict[int, LaunchedServer] = {}
        self.launches = 0

    def check_case(self, fields: Mapping[str, Any], world_size: int) -> str:
        if self.url is None and self.launch is None:
            raise ConfigError(_ONE_OF, key="--pipeline-target-arg")
        if "num_frames" in fields:
            raise ParamError(
                "num_frames",
                "the openai target serves images (POST /v1/images/generations); a served video endpoint "
                "(sglang's /v1/videos is an asynchronous job API) is not supported: gate a video case with the "
                "command target",
            )
        if not isinstance(fields.get("prompt"), str):
            raise ParamError("prompt", f"required: the text to draw, got {fields.get('prompt')!r}")
        for key in ("height", "width"):
            value = fields.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParamError(key, f"required: a positive int (the size asked and checked), got {value!r}")
        for key, value in fields.items():
            if key == "n" or key == "response_format":
                raise ParamError(key, "set by parity (one image, as b64_json), not by a case")
            if not isinstance(value, _JSON_SCALARS):
                raise ParamError(key, f"must be a string, number or boolean (a JSON body field), got {value!r}")
        return "image"

    def output_shape(self, fields: Mapping[str, Any]) -> tuple[int, ...]:
        return (fields["height"], fields["width"], 3)

    def prepare(self, fields: Mapping[str, Any], device: str, world_size: int | None = None) -> _PreparedRequest:
        server = self._server(world_size or 1)
        url = server.url if server is not None else self.url
        assert url is not None
        if server is None and not any(answers(url.rstrip("/") + path) for path in READY_PATHS):
            raise PipelineFailed(f"no server answers at {url} (no 200 from {' or '.join(READY_PATHS)})")
        return _PreparedRequest(self, url.rstrip("/"), dict(fields), server)

    def _server(self, world_size: int) -> LaunchedServer | None:
        """The live server for ``world_size`` (launched now if it is not running), or None when attached."""
        if self.launch is None:
            return None
        key = world_size if "{world_size}" in self.launch else 1
        server = self._servers.get(key)
        if server is not None and server.exited() is None:
            return server
        if server is not None:
            server.stop()
        template = self.launch.replace("{world_size}", str(world_size))
        self._servers[key] = server = launch(template, self.ready_timeout)
        self.launches += 1
        if self not in _LIVE:
            _LIVE.append(self)
        return server

    def stop(self) -> None:
        """Stop every server this target launched; the next :meth:`prepare` launches afresh."""
        servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.stop()
        if self in _LIVE:
            _LIVE.remove(self)


class _PreparedRequest:
    """One case's request, sent once per ``run()``."""

    def __init__(
        self, target: OpenAIPipelineTarget, url: str, fields: dict[str, Any], server: LaunchedServer | None
    ) -> None:
        self.target, self.url, self.fields, self.server = target, url, fields, server
        self.shape = (fields["height"], fields["width"], 3)

    def run(self) -> PipelineOutput:
        folder = Path(tempfile.mkdtemp(prefix="parity-request-")) if self.target.perf_dump else None
        try:
            dump = folder / TIMINGS_FILE if folder is not None else None
            body = request_body(self.fields, self.target.model, str(dump) if dump is not None else None)
            try:
                data, round_trip_ms = post(self.url + ENDPOINT, body, self.target.timeout)
            except PipelineFailed as exc:
                raise self._explained(exc) from None
            doc = read_answer(data, self.url + ENDPOINT)
            image: np.ndarray = image_of(doc, self.shape, self.url + ENDPOINT)
            timings = timings_of(doc, round_trip_ms, dump)
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        return PipelineOutput(image, timings, {"server": self.url, "timings": timings.clock})

    def _explained(self, exc: PipelineFailed) -> PipelineFailed:
        """A failed request, and, where parity launched the server and it has ended, how it ended and its log."""
        wait = SERVER_END_WAIT_S if isinstance(exc, ConnectionLost) else 0.0
        ended = self.server.exited(wait=wait) if self.server is not None else None
        if self.server is None or ended is None:
            return exc
        return self.server.failure(f"{exc.reason}; the server ended ({ended})")

    def close(self) -> None:
        """The server stays up for the next case (it is the target's to stop)."""


def factory(
    url: str | None = None,
    launch: str | None = None,
    model: str | None = None,
    timeout: str | float = DEFAULT_TIMEOUT_S,
    ready_timeout: str | float = DEFAULT_READY_TIMEOUT_S,
    perf_dump: str = "false",
) -> OpenAIPipelineTarget:
    """``url=`` or ``launch=`` (exactly one, checked with the first case: ``parity list`` builds it bare), ``model=`` for the body, request ``timeout=`` and ``ready_timeout=`` in
    seconds, ``perf_dump=true`` to ask the server (on this machine) for sglang's perf dump of every request."""
    if url is not None and launch is not None:
        raise ConfigError(_ONE_OF, key="--pipeline-target-arg")
    if url is not None and not url.startswith(("http://", "https://")):
        raise ConfigError(f"url must start with http:// or https://, got {url!r}", key="--pipeline-target-arg")
    if launch is not None:
        _check_launch(launch)
    if perf_dump not in ("true", "false"):
        raise ConfigError(f"perf_dump must be true or false, got {perf_dump!r}", key="--pipeline-target-arg")
    return OpenAIPipelineTarget(
        url,
        launch,
        model,
        target_seconds(timeout, "timeout"),
        target_seconds(ready_timeout, "ready_timeout"),
        perf_dump == "true",
    )


def _check_launch(launch: str) -> None:
    """A launch template that splits into arguments, passes ``{port}`` and names an executable."""
    try:
        argv = shlex.split(launch)
    except ValueError as exc:
        raise ConfigError(f"launch: cannot split {launch!r}: {exc}", key="--pipeline-target-arg") from None
    if not argv or not any("{port}" in arg for arg in argv):
        raise ConfigError(
            f"launch must pass {{port}}, the port parity picks for the server: {launch!r}", key="--pipeline-target-arg"
        )
    try:
        check_executable(argv[0])
    except ParamError as exc:
        raise ConfigError(f"launch: {exc}", key="--pipeline-target-arg") from None
