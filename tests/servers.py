"""Start the real server process (``python -m tornchat serve``) on a free loopback port.

Used by the server tests and benchmarks::

    with servers.running("--api-key", "k") as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="k")
        server.health()["engine"]["cancelled"]
"""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit


@dataclass
class Server:
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return self.url + "/v1"

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=10) as reply:
            return json.loads(reply.read())

    def log(self) -> str:
        """Everything the server wrote to stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self):
        return json.loads(self.body)


def connect(url: str, timeout: float = 600) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def request(url: str, method: str, path: str, body=None, headers: dict | None = None) -> Reply:
    """One raw HTTP exchange; a dict body is sent as JSON."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn = connect(url)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return Reply(response.status, response.headers, response.read())
    finally:
        conn.close()


def sse_data(response: http.client.HTTPResponse) -> Iterator[str]:
    """The data of each SSE record, as the server framed it (one data line, then a blank line)."""
    while line := response.readline():
        assert line.startswith(b"data: ") and line.endswith(b"\n"), line
        assert response.readline() == b"\n", "records are separated by a blank line"
        yield line[len(b"data: ") : -1].decode()


def sse_events(response: http.client.HTTPResponse) -> Iterator[tuple[str, dict]]:
    """(event name, data) of each record framed as the agents' APIs frame theirs: an event line, one data line, a blank line."""
    while line := response.readline():
        assert line.startswith(b"event: ") and line.endswith(b"\n"), line
        data = response.readline()
        assert data.startswith(b"data: ") and data.endswith(b"\n"), data
        assert response.readline() == b"\n", "records are separated by a blank line"
        yield line[len(b"event: ") : -1].decode(), json.loads(data[len(b"data: ") :])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(*flags: str, startup_timeout: float = 300.0, env: dict | None = None) -> Iterator[Server]:
    """A server started with these extra flags; stopped (SIGTERM, then SIGKILL) on exit."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tornchat-server-") as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "tornchat", "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        server = Server(port, process, log_path)
        try:
            _wait_ready(server, startup_timeout)
            yield server
        finally:
            _stop(process)


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()[-3000:]}")
        try:
            server.health()
            return
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{server.log()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
