"""Server processes on loopback, started, waited for and stopped, and raw HTTP to them.

The one harness of the server tests and the benchmarks: ``running`` starts the
real server (``python -m tornchat serve``) on a free port; ``launch`` starts
any server command (the benchmarks' other systems)::

    with servers.running("--api-key", "k") as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="k")
        server.health()["engine"]["cancelled"]
"""
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from bench.common import free_port


@dataclass
class Server:
    port: int
    process: subprocess.Popen
    log_path: Path
    ready_path: str  # answers 200 once the server takes requests
    started: float  # time.perf_counter() at launch
    ready_s: float | None = None  # seconds from launch until it took requests, once wait_ready saw it

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

    def log_tail(self, lines: int = 3) -> str:
        """The log's last lines on one line: the first line of an error, which a benchmark's table shows."""
        return " | ".join(self.log().strip().splitlines()[-lines:]) or "(no output)"


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


@contextmanager
def running(*flags: str, startup_timeout: float = 300.0, env: dict | None = None) -> Iterator[Server]:
    """tornchat serve with these extra flags on a free port, ready; stopped on exit."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tornchat-server-") as tmp:
        command = [sys.executable, "-m", "tornchat", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
        server = launch(command, port, Path(tmp) / "server.log", env)
        try:
            wait_ready(server, startup_timeout)
            yield server
        finally:
            stop(server)


def launch(command: list[str], port: int, log_path: Path, env: dict | None = None, ready_path: str = "/health") -> Server:
    """Any server process (tornchat, llama-server, a baseline) in a session of its own, so that stop()
    ends the children it forks too; its output goes to log_path."""
    started = time.perf_counter()
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
    return Server(port, process, log_path, ready_path, started)


def wait_ready(server: Server, timeout: float) -> float:
    """Seconds from launch until its ready path answers 200; raises with the log's tail if it never does."""
    deadline = server.started + timeout
    while time.perf_counter() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with status {server.process.returncode}: {server.log_tail()}\n"
                               f"{server.log()[-3000:]}")
        try:
            with urllib.request.urlopen(server.url + server.ready_path, timeout=10) as reply:
                if reply.status == 200:
                    server.ready_s = time.perf_counter() - server.started
                    return server.ready_s
        except OSError:  # refused while it starts; urllib's HTTPError (a 503 while loading) is one too
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s: {server.log_tail()}\n{server.log()[-3000:]}")


def stop(server: Server) -> None:
    """SIGTERM to its session, then SIGKILL after 15 s."""
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
