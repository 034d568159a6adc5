"""A minimal W3C WebDriver client for Debian's headless Chromium through chromedriver (standard library only).

Enough for a test to load a page, run a script in it and take a screenshot. Chromium is
started with the flags this closed network needs (no background networking, no component
updates, no QUIC) and a fresh profile directory.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def find_browser() -> tuple[str, str] | None:
    """(chromium, chromedriver) executables, or None when either is missing."""
    browser = next((p for name in ("chromium", "chromium-browser") if (p := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


class Session:
    def __init__(self, url: str, session_id: str) -> None:
        self._base = f"{url}/session/{session_id}"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return call(method, self._base + path, body)

    def open(self, url: str) -> None:
        self._call("POST", "/url", {"url": url})

    def script(self, source: str, *args: Any) -> Any:
        """Run ``source`` as a function body in the page (``arguments[i]`` are ``args``); its return value."""
        return self._call("POST", "/execute/sync", {"script": source, "args": list(args)})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._call("GET", "/screenshot")))


def call(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["value"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def chromium(browser: str, driver: str, profile: Path, width: int = 1280, height: int = 800) -> Iterator[Session]:
    """A headless Chromium window of ``width`` x ``height`` CSS pixels, driven through a chromedriver of our own."""
    port = _free_port()
    proc = subprocess.Popen(
        [driver, f"--port={port}", "--allowed-ips=127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                call("GET", f"{url}/status")
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("chromedriver did not start") from None
                time.sleep(0.1)
        args = [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"]
        capabilities = {
            "alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {"binary": browser, "args": args}}
        }
        session_id = call("POST", f"{url}/session", {"capabilities": capabilities})["sessionId"]
        try:
            yield Session(url, session_id)
        finally:
            call("DELETE", f"{url}/session/{session_id}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
