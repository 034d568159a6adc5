"""An OpenAI-Images-compatible server that parity's code did not write: the standard library and zlib only.

Run as a script (``python images_api_server.py --port P [--mode M] [--delay-ms D]``). It draws a
deterministic picture from the prompt and seed with its own PNG encoder, so the openai target is
tested against an implementation that shares nothing with parity's decoder or pipeline. ``--mode``
makes it misbehave the ways real servers do; ``--delay-ms`` is the request's work (a sleep, so a
loaded machine stretches it little) and ``--slowdown`` multiplies it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import struct
import sys
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("ok", "changed", "http500", "not-json", "no-image", "wrong-size", "hang", "die", "jpeg", "no-timing")


def png(width: int, height: int, pixel: bytes) -> bytes:
    """An 8-bit RGB PNG of ``pixel``-seeded rows (filter byte 0 per row)."""
    rows = b"".join(
        b"\x00" + bytes((pixel[(x + y) % len(pixel)] + 3 * x + 5 * y) % 256 for x in range(width * 3))
        for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    options: argparse.Namespace

    def answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        if self.options.never_ready or self.path not in ("/health", "/v1/models"):
            self.answer(404, b'{"error": "not here"}')
        else:
            self.answer(200, json.dumps({"object": "list", "data": [{"id": "test-model"}]}).encode())

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = self.options.mode
        if mode == "die":
            os._exit(3)
        if mode == "hang":
            time.sleep(3600)
        start = time.perf_counter()
        time.sleep(self.options.delay_ms * self.options.slowdown / 1e3)
        width, height = (int(v) for v in request["size"].split("x"))
        if mode == "wrong-size":
            width += 8
        seed = hashlib.sha256(f"{request['prompt']}|{request.get('seed')}".encode()).digest()
        if mode == "changed":
            seed = bytes(255 - b for b in seed)
        image = png(width, height, seed)
        if mode == "jpeg":
            image = b"\xff\xd8\xff\xe0" + image[4:]
        if mode == "http500":
            self.answer(500, b'{"error": {"message": "CUDA out of memory. Tried to allocate 20.00 GiB"}}')
        elif mode == "not-json":
            self.answer(200, b"<html>502 Bad Gateway</html>", "text/html")
        elif mode == "no-image":
            self.answer(200, json.dumps({"created": 0, "data": [{"url": "http://example/x.png"}]}).encode())
        else:
            doc = {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(image).decode()}]}
            if mode != "no-timing":
                doc["inference_time_s"] = time.perf_counter() - start
            self.answer(200, json.dumps(doc).encode())

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        sys.stderr.write(f"images_api_server: {format % args}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=MODES, default="ok")
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--never-ready", action="store_true")
    parser.add_argument("--tag", default="")  # lets a test find this process in /proc
    Handler.options = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", Handler.options.port), Handler)
    print(f"images_api_server: listening on {Handler.options.port}", file=sys.stderr, flush=True)
    server.serve_forever(poll_interval=0.1)


if __name__ == "__main__":
    main()
