"""The OpenAI Images API as parity speaks it: a request from a case's fields, an answer read strictly.

``POST {url}/v1/images/generations`` with ``prompt``, ``size`` ("WxH" from the case's ``width`` and
``height``), ``n`` 1, ``response_format`` ``b64_json`` and the case's other fields as extra body
fields (sglang's ``seed``, ``num_inference_steps``, ``guidance_scale``...). Whatever goes wrong
(connection refused, an HTTP error, a timeout, a body that is not JSON or holds no PNG of the
case's size) is a :class:`PipelineFailed` with the status and the body's tail. Timings: sglang's
perf dump when parity asked the server for one, else the answer's ``inference_time_s``, else the
request's round trip; the record says which (``Timings.clock``).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import ConfigError
from harness.files.jsonio import parse_json
from harness.files.png import decode_rgb_png
from harness.targets.base import PipelineFailed, Timings
from harness.targets.command_pipeline import read_timings

ENDPOINT = "/v1/images/generations"
MAX_ANSWER_BYTES = 512 * 2**20  # a 4096x4096 PNG in base64 is ~70 MB
BODY_TAIL_CHARS = 2000
ROUND_TRIP = "request round trip"
SERVER_TIME = "server inference_time_s"


def request_body(fields: Mapping[str, Any], model: str | None, perf_dump: str | None) -> dict[str, Any]:
    """The JSON body for one image of ``fields``: ``width``/``height`` become ``size``, the rest travel as they are."""
    extra = {k: v for k, v in fields.items() if k not in ("width", "height", "prompt")}
    body: dict[str, Any] = {
        "prompt": fields["prompt"],
        "size": f"{fields['width']}x{fields['height']}",
        "n": 1,
        "response_format": "b64_json",
        **({"model": model} if model else {}),
        **extra,
    }
    if perf_dump is not None:
        body["perf_dump_path"] = perf_dump
    return body


def _tail(data: bytes) -> str:
    text = data.decode(errors="replace")
    return text if len(text) <= BODY_TAIL_CHARS else "..." + text[-BODY_TAIL_CHARS:]


class ConnectionLost(PipelineFailed):
    """No answer because the connection was refused or broke: what a server that died mid-request leaves."""


def post(url: str, body: Mapping[str, Any], timeout: float) -> tuple[bytes, float]:
    """POST ``body`` to ``url``; the answer's bytes and the round trip in ms, or PipelineFailed saying what went wrong."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", "Accept": "application/json"}
    )
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 - the user's own server
            data = answer.read(MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as exc:
        detail = _tail(exc.read(MAX_ANSWER_BYTES))
        raise PipelineFailed(f"POST {url}: HTTP {exc.code} {exc.reason}: {detail[-200:].strip()}", detail) from None
    except TimeoutError:
        raise PipelineFailed(f"POST {url}: no answer within {timeout:g} s") from None
    except urllib.error.URLError as exc:
        raise ConnectionLost(f"POST {url}: {exc.reason}") from None
    except (http.client.HTTPException, OSError) as exc:
        raise ConnectionLost(f"POST {url}: the connection broke ({type(exc).__name__}: {exc})") from None
    round_trip_ms = (time.perf_counter() - start) * 1e3
    if len(data) > MAX_ANSWER_BYTES:
        raise PipelineFailed(f"POST {url}: the answer is larger than {MAX_ANSWER_BYTES} bytes")
    return data, round_trip_ms


def read_answer(data: bytes, url: str) -> dict[str, Any]:
    """The answer as a JSON object, or PipelineFailed with its tail."""
    try:
        doc = parse_json(data.decode("utf-8"), url)
    except (UnicodeDecodeError, ConfigError) as exc:
        raise PipelineFailed(f"the answer is not JSON: {exc}", _tail(data)) from None
    if not isinstance(doc, dict):
        raise PipelineFailed(f"{url}: the answer is a JSON {type(doc).__name__}, not an object", _tail(data))
    return doc


def image_of(doc: Mapping[str, Any], shape: tuple[int, ...], url: str) -> np.ndarray:
    """The one image of the answer (``data[0].b64_json``), an 8-bit RGB PNG of ``shape``."""
    data = doc.get("data")
    if not isinstance(data, list) or len(data) != 1 or not isinstance(data[0], dict):
        count = len(data) if isinstance(data, list) else type(data).__name__
        raise PipelineFailed(f"{url}: expected data with one image, got {count}", _tail(json.dumps(doc).encode()))
    encoded = data[0].get("b64_json")
    if not isinstance(encoded, str) or not encoded:
        keys = ", ".join(sorted(data[0])) or "none"
        raise PipelineFailed(f"{url}: data[0] has no b64_json image (keys: {keys}); parity asks for b64_json")
    try:
        png = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PipelineFailed(f"{url}: data[0].b64_json is not base64: {exc}") from None
    try:
        image = decode_rgb_png(png, f"{url} data[0].b64_json")
    except ConfigError as exc:
        raise PipelineFailed(str(exc)) from None
    if image.shape != shape:
        raise PipelineFailed(f"{url}: data[0] is an image of shape {image.shape}, the case asks for {shape}")
    return image


def timings_of(doc: Mapping[str, Any], round_trip_ms: float, perf_dump: Path | None) -> Timings:
    """The server's own timings (module docstring), else the round trip."""
    if perf_dump is not None:
        if not perf_dump.exists():
            raise PipelineFailed(f"asked the server for a perf dump at {perf_dump}; it wrote none")
        return read_timings(perf_dump.parent, round_trip_ms)[0]
    seconds = doc.get("inference_time_s")
    if seconds is None:
        return Timings(round_trip_ms, {}, [], ROUND_TRIP)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise PipelineFailed(f"inference_time_s must be a positive number of seconds, got {seconds!r}")
    return Timings(float(seconds) * 1e3, {}, [], SERVER_TIME)
