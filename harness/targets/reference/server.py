"""parity's reference pipeline behind the OpenAI Images API (``parity serve``), on the standard library's HTTP server.

What ``sglang serve`` offers a client, on parity's tiny pipeline: models built once, then ``POST
/v1/images/generations`` draws one PNG per request (``prompt``, ``size`` "WxH", ``seed``,
``num_inference_steps`` or ``steps``, any other :class:`~reference_impl.pipeline.PipelineConfig`
field) as ``b64_json`` with ``inference_time_s``, and sglang's perf dump where ``perf_dump_path``
asks; ``GET /health`` and ``GET /v1/models`` say it is ready. One request at a time, as one GPU
serves them. ``slowdown`` F sleeps F x each generation's time after it, reported as denoising time
(the image unchanged): a server F slower end to end, for an A/B to find.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from harness.files.atomic import write_json_atomic
from harness.files.png import encode_png
from reference_impl.pipeline import (
    MODEL_KEYS,
    PipelineConfig,
    PipelineModels,
    PipelineResult,
    build_models,
    run_pipeline,
)

ENDPOINT = "/v1/images/generations"
MAX_BODY_BYTES = 2**20
MODEL_ID = "parity-reference"
_IGNORED = ("model", "quality", "style", "user", "background")  # OpenAI fields that change nothing here
_FIELDS = {f.name for f in dataclasses.fields(PipelineConfig)} - {"device", "height", "width"}


class RequestError(ValueError):
    """A request the server refuses (HTTP 400), naming the field."""


@dataclasses.dataclass
class ServedPipeline:
    """The models, built once, and what every request shares."""

    base: PipelineConfig
    models: PipelineModels
    slowdown: float = 0.0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @classmethod
    def build(cls, base: PipelineConfig, slowdown: float) -> ServedPipeline:
        return cls(base, build_models(base), slowdown)

    def config(self, body: dict[str, Any]) -> PipelineConfig:
        """The request's config (RequestError naming a bad field)."""
        fields = _request_fields(body)
        for key in MODEL_KEYS:
            if key in fields and fields[key] != getattr(self.base, key):
                raise RequestError(f"{key}: this server's models are {key}={getattr(self.base, key)!r}")
        try:
            config = PipelineConfig.from_dict({**dataclasses.asdict(self.base), **fields})
            self.models.check_serves(config)
        except ValueError as exc:  # ModelConfigError names the key
            raise RequestError(str(exc)) from None
        return config

    def generate(self, config: PipelineConfig) -> tuple[PipelineResult, dict[str, Any]]:
        """One image, and its timings in sglang's perf dump schema (the slowdown's sleep inside the denoising steps)."""
        with self.lock:
            result = run_pipeline(config, self.models)
            extra_ms = self.slowdown * result.timings.e2e_ms
            if extra_ms:
                time.sleep(extra_ms / 1e3)
        t = result.timings
        per_step = extra_ms / max(1, len(t.denoise_step_ms))
        dump = {
            "total_duration_ms": t.e2e_ms + extra_ms,
            "steps": [
                {"name": "TextEncodingStage", "duration_ms": t.text_encoding_ms},
                {"name": "DenoisingStage", "duration_ms": t.denoising_ms + extra_ms},
                {"name": "DecodingStage", "duration_ms": t.decoding_ms},
            ],
            "denoise_steps_ms": [{"step": i, "duration_ms": ms + per_step} for i, ms in enumerate(t.denoise_step_ms)],
        }
        return result, dump


def _request_fields(body: dict[str, Any]) -> dict[str, Any]:
    """PipelineConfig fields from an Images API body."""
    fields: dict[str, Any] = {}
    for key, value in body.items():
        if key == "prompt" or key in _IGNORED or key == "perf_dump_path":
            continue
        if key == "n" and value != 1:
            raise RequestError(f"n: this server draws one image per request, got {value!r}")
        if key == "response_format" and value != "b64_json":
            raise RequestError(f"response_format: only b64_json is served, got {value!r}")
        if key == "size":
            width, sep, height = str(value).partition("x")
            if not (sep and width.isdigit() and height.isdigit()):
                raise RequestError(f"size must be WIDTHxHEIGHT, got {value!r}")
            fields.update(width=int(width), height=int(height))
        elif key == "num_inference_steps":
            fields["steps"] = value
        elif key in _FIELDS:
            fields[key] = value
        elif key not in ("n", "response_format"):
            raise RequestError(f"{key}: not a field of this server (it takes {', '.join(sorted(_FIELDS))})")
    if not isinstance(body.get("prompt"), str):
        raise RequestError("prompt: required, a string")
    fields["prompt"] = body["prompt"]
    return fields


class _Handler(BaseHTTPRequestHandler):
    server: ImagesServer
    protocol_version = "HTTP/1.1"

    def _send(self, status: HTTPStatus, doc: dict[str, Any]) -> None:
        payload = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        if self.path == "/health":
            self._send(HTTPStatus.OK, {"status": "ok"})
        elif self.path == "/v1/models":
            self._send(HTTPStatus.OK, {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": {"message": f"no such path {self.path}"}})

    def do_POST(self) -> None:  # noqa: N802 - the base class's name
        if self.path != ENDPOINT:
            self._send(HTTPStatus.NOT_FOUND, {"error": {"message": f"no such path {self.path}"}})
            return
        try:
            self._send(HTTPStatus.OK, self._generate(self._body()))
        except RequestError as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc), "type": "invalid_request_error"}})
        except Exception as exc:  # noqa: BLE001 - a failed generation is the client's 500, the server lives on
            self.log_error("generation failed: %s: %s", type(exc).__name__, exc)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": f"{type(exc).__name__}: {exc}"}})

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            raise RequestError(f"Content-Length must be in (0, {MAX_BODY_BYTES}], got {length}")
        try:
            body = json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    def _generate(self, body: dict[str, Any]) -> dict[str, Any]:
        pipeline = self.server.pipeline
        result, dump = pipeline.generate(pipeline.config(body))
        if isinstance(body.get("perf_dump_path"), str):
            write_json_atomic(Path(body["perf_dump_path"]), dump)
        return {
            "id": f"parity-{time.time_ns()}",
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(encode_png(result.output)).decode()}],
            "inference_time_s": dump["total_duration_ms"] / 1e3,
        }


class ImagesServer(ThreadingHTTPServer):
    """The HTTP server holding one :class:`ServedPipeline`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], pipeline: ServedPipeline) -> None:
        super().__init__(address, _Handler)
        self.pipeline = pipeline


def base_config(**fields: Any) -> PipelineConfig:
    """The config the models are built for (a ConfigError naming the option otherwise)."""
    try:
        return PipelineConfig.from_dict(fields)
    except ValueError as exc:
        from harness.errors import ConfigError

        raise ConfigError(str(exc), key=f"--{getattr(exc, 'key', None) or 'weights'}") from None
