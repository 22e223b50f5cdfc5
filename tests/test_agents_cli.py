"""Codex CLI and Claude Code, installed from npm, each complete a turn headless against the real server.

The server runs the embedded SmolLM2-135M with the settings a small model
needs behind an agent: ``--temperature-default 0`` (neither agent sends a
temperature, and at 1.0 the 135M model often never ends its turn) and
``--max-tokens-default`` (Codex sends no ``max_output_tokens``; a rambling
reply then stops, ``incomplete``, instead of filling the context). Each
agent gets slim settings (a one-line system prompt, Codex's optional
instruction blocks off) and its own HOME and config directory, so the user's
own configuration is never read or written.

The agents talk to the server through a recording proxy. Each test replays
the agent's last model request against the server itself and asserts that
the agent printed exactly the reply the server generates for it: greedy
decoding gives one answer per request (DESIGN), so that is the text the
agent was sent.

The agents come from npm, installed once into a cache reused across runs
(``~/.cache/tornchat-test-npm``, or ``$TORNCHAT_TEST_NPM_CACHE``); without
npm, or when the install fails (offline), the tests skip, saying why.
"""
import http.client
import http.server
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import openai
import pytest

from bench import servers
from tornchat import config

CODEX = "@openai/codex@0.169.0"
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.331"
NPM_TIMEOUT_S = 600
TURN_TIMEOUT_S = 120
MAX_TOKENS_DEFAULT = 24  # the agents' replies here are 8 and 9 tokens
QUESTION = "What is the capital of France?"  # a question the 135M model answers in one short greedy line, whatever the agent's prompt
SYSTEM = "You are a helpful assistant. Answer briefly."


# ---- npm ------------------------------------------------------------------------------


def _installed(prefix: Path, spec: str) -> bool:
    name, _, version = spec.rpartition("@")
    manifest = prefix / "node_modules" / name / "package.json"
    try:
        return json.loads(manifest.read_text())["version"] == version
    except (OSError, ValueError, KeyError):
        return False


@pytest.fixture(scope="session")
def agents_bin() -> Path:
    """node_modules/.bin holding codex and claude at the pinned versions, installed from npm once per cache."""
    prefix = Path(os.environ.get("TORNCHAT_TEST_NPM_CACHE") or Path.home() / ".cache" / "tornchat-test-npm")
    bin_dir = prefix / "node_modules" / ".bin"
    if all(_installed(prefix, spec) for spec in (CODEX, CLAUDE_CODE)) and (bin_dir / "codex").exists() and (bin_dir / "claude").exists():
        return bin_dir
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: Codex CLI and Claude Code come from npm (apt-get install npm)")
    prefix.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--fetch-retries=1", "--fetch-retry-maxtimeout=10000", "--prefix", str(prefix), CODEX, CLAUDE_CODE],
                                capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install {CODEX} {CLAUDE_CODE} took over {NPM_TIMEOUT_S} s (is the npm registry reachable?)")
    if result.returncode != 0 or not ((bin_dir / "codex").exists() and (bin_dir / "claude").exists()):
        said = [line for line in (result.stderr or result.stdout).splitlines() if line.strip() not in ("", "npm error")][:2]
        pytest.skip(f"npm install {CODEX} {CLAUDE_CODE} failed (offline?): {' / '.join(said)}")
    return bin_dir


# ---- the server, behind a recording proxy ------------------------------------------


class Recorder(http.server.ThreadingHTTPServer):
    """Forwards every request to the server as it is and streams the reply back; keeps (path, body) of each POST."""

    daemon_threads = True

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.posts: list[tuple[str, dict]] = []
        super().__init__(("127.0.0.1", 0), _Forward)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def last(self, path: str) -> dict:
        return [body for where, body in self.posts if where.split("?")[0] == path][-1]


class _Forward(http.server.BaseHTTPRequestHandler):
    server: Recorder

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.command == "POST":
            self.server.posts.append((self.path, json.loads(body)))
        upstream = servers.connect(self.server.upstream, timeout=TURN_TIMEOUT_S)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection", "accept-encoding")}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            reply = upstream.getresponse()
            self.send_response(reply.status)
            for key, value in reply.getheaders():
                if key.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                    self.send_header(key, value)
            self.send_header("Connection", "close")  # HTTP/1.0: the body ends where the connection does
            self.end_headers()
            while self.command != "HEAD" and (chunk := reply.read1(65536)):
                self.wfile.write(chunk)
                self.wfile.flush()
        finally:
            upstream.close()

    do_GET = do_HEAD = do_POST = _forward

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    with servers.running("--max-tokens-default", str(MAX_TOKENS_DEFAULT), "--temperature-default", "0") as running:
        yield running


@pytest.fixture
def recorder(server):
    proxy = Recorder(server.url)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield proxy
    proxy.shutdown()
    proxy.server_close()


def agent_env(home: Path, **extra: str) -> dict:
    """A clean environment: the user's HOME, config, keys and proxies stay out."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "NO_PROXY": "127.0.0.1,localhost", "TMPDIR": str(home), **extra}


def run_agent(argv: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([str(a) for a in argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=TURN_TIMEOUT_S)


def replay(server, path: str, body: dict) -> dict:
    """The server's own reply to a request an agent sent, asked again without streaming."""
    reply = servers.request(server.url, "POST", path, {**body, "stream": False}, {"Content-Type": "application/json"})
    assert reply.status == 200, reply.body
    return reply.json()


def codex_argv(bin_dir: Path, base_url: str, instructions: Path, question: str) -> list:
    return [
        bin_dir / "codex", "exec", "--skip-git-repo-check", "-m", "gpt-3.5-turbo",
        "-c", "model_provider=tornchat",
        "-c", f'model_providers.tornchat={{name="tornchat", base_url="{base_url}/v1", wire_api="responses"}}',
        # slim: a one-line system prompt instead of Codex's 17.7 KB one, and its optional blocks off
        "-c", f"model_instructions_file={instructions}", "-c", "include_permissions_instructions=false",
        "-c", "include_environment_context=false", "-c", "include_apps_instructions=false",
        "-c", "include_collaboration_mode_instructions=false", "--disable", "multi_agent", "--disable", "goals",
        question,
    ]


# ---- the server options the agents need -----------------------------------------


def test_server_defaults_fill_only_what_a_request_leaves_out(server):
    client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=600)
    ask = [{"role": "user", "content": "Write a long story about the sea."}]
    unset = client.chat.completions.create(model="m", messages=ask)
    greedy = client.chat.completions.create(model="m", messages=ask, temperature=0, max_tokens=MAX_TOKENS_DEFAULT)
    assert unset.choices[0].message.content == greedy.choices[0].message.content  # greedy by default
    assert unset.usage.completion_tokens == MAX_TOKENS_DEFAULT and unset.choices[0].finish_reason == "length"
    # what a request sets wins, above the default cap or below it
    longer = client.chat.completions.create(model="m", messages=ask, max_tokens=MAX_TOKENS_DEFAULT + 4)
    assert longer.usage.completion_tokens == MAX_TOKENS_DEFAULT + 4
    assert client.responses.create(model="m", input="Hi", temperature=0.7, max_output_tokens=1).temperature == 0.7
    # the Responses API: the same cap, reported as OpenAI does (incomplete, max_output_tokens), and the temperature used
    response = client.responses.create(model="m", input="Write a long story about the sea.")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == MAX_TOKENS_DEFAULT and response.temperature == 0


@pytest.mark.parametrize("values, fragment", [
    ({"max_tokens_default": 0}, "max_tokens_default is 0"),
    ({"temperature_default": 2.5}, "temperature_default is 2.5"),
    ({"temperature_default": "hot"}, "temperature_default is 'hot'"),
])
def test_bad_server_defaults_are_refused(values, fragment):
    with pytest.raises(ValueError, match=fragment):
        config.build(None, values)


# ---- the agents ---------------------------------------------------------------------


def test_codex_completes_a_turn(agents_bin, recorder, server, tmp_path):
    instructions = tmp_path / "instructions.md"
    instructions.write_text(SYSTEM + "\n")
    env = agent_env(tmp_path / "home", CODEX_HOME=str(tmp_path / "codex-home"))
    Path(env["CODEX_HOME"]).mkdir()
    result = run_agent(codex_argv(agents_bin, recorder.url, instructions, QUESTION), env, tmp_path / "work")
    assert result.returncode == 0, result.stderr[-3000:]
    sent = recorder.last("/v1/responses")
    assert sent["stream"] is True and "temperature" not in sent and "max_output_tokens" not in sent
    expected = replay(server, "/v1/responses", sent)
    assert expected["status"] == "completed"
    [message] = [item for item in expected["output"] if item["type"] == "message"]
    text = message["content"][0]["text"]
    assert text.strip() and result.stdout.strip() == text.strip()  # codex exec prints the turn's last message on stdout


def test_claude_code_completes_a_turn(agents_bin, recorder, server, tmp_path):
    home = tmp_path / "home"
    env = agent_env(home, ANTHROPIC_BASE_URL=recorder.url, ANTHROPIC_API_KEY="unused", CLAUDE_CONFIG_DIR=str(home / ".claude"),
                    CLAUDE_CODE_MAX_OUTPUT_TOKENS="256", DISABLE_AUTOUPDATER="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    argv = [agents_bin / "claude", "-p", QUESTION, "--bare", "--model", "any", "--tools", "", "--system-prompt", SYSTEM]
    result = run_agent(argv, env, tmp_path / "work")
    assert result.returncode == 0, result.stderr[-3000:]
    sent = recorder.last("/v1/messages")
    assert sent["stream"] is True and "temperature" not in sent and sent["max_tokens"] == 256
    expected = replay(server, "/v1/messages", sent)
    assert expected["stop_reason"] == "end_turn"
    text = "".join(block["text"] for block in expected["content"] if block["type"] == "text")
    assert text.strip() and result.stdout.strip() == text.strip()
