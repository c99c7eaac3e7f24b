"""Running `mosaic serve` for tests: a real process on a free port, and waiting for it to answer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import http.client
import json

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "examples" / "stdlib-moe"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if request(url, "GET", "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not come up in {timeout} s")


def request(url: str, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
            timeout: float = 120) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one plain HTTP request: what a client that is not an SDK sends."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
        res = conn.getresponse()
        return res.status, {k.lower(): v for k, v in res.getheaders()}, res.read()
    finally:
        conn.close()


class ServerProcess:
    """`python -m mosaic_runtime.cli serve ARGS` on a free loopback port, with an empty model store."""

    def __init__(self, args: list[str], home: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, MOSAIC_HOME=str(home))
        self.proc = subprocess.Popen([sys.executable, "-m", "mosaic_runtime.cli", "serve", *args,
                                      "--port", str(self.port)], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        wait_until_up(self.url, self.proc)

    def stop(self) -> str:
        """Stop it; its log."""
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err
