"""Failure paths of the HTTP layer, in-process, with an engine that fails on cue.

What the real model cannot be made to do on demand: raise at submit, fail
mid-generation, refuse for a full queue. The app, handlers and routes are
the real ones (make_app).
"""
import asyncio
import copy
import json
import logging
import threading

import openai
import pytest
from tornado.httpserver import HTTPServer
from tornado.ioloop import IOLoop

from bench import servers
from tornchat.config import Config
from tornchat.engine.types import Event, QueueFull, Usage
from tornchat.engine.worker import EngineStats
from tornchat.server.app import make_app

from fixtures import chat_templates

SECRET = "/secret/checkpoint/path"


class ScriptedEngine:
    """Engine stand-in: the last user message says what to do."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stats = EngineStats()
        self.tuning = None  # no measurement under way

    def running(self) -> int:
        return 0

    def queue_depth(self) -> int:
        return 0

    def submit(self, request, on_event):
        text = self.tokenizer.decode(request.prompt_ids)
        if "crash" in text:
            raise RuntimeError(f"weights missing at {SECRET}")
        if "busy" in text:
            raise QueueFull("1 request is waiting")
        usage = Usage(prompt_tokens=len(request.prompt_ids), completion_tokens=2, cached_tokens=0)
        events = [Event(text="Hello"), Event(text=" there"), Event(finish_reason="stop", usage=usage)]
        if "fail" in text:
            events[1:] = [Event(error=RuntimeError(f"CUDA error reading {SECRET}"))]
        threading.Thread(target=lambda: [on_event(e) for e in events], daemon=True).start()
        return object()

    def withdraw(self, handle) -> None:
        pass


@pytest.fixture(scope="module")
def server(tokenizer):
    yield from serving(ScriptedEngine(tokenizer))


@pytest.fixture(scope="module")
def strict_server(tokenizer):
    """Behind Mistral's template, which refuses turns out of order."""
    strict = copy.copy(tokenizer)
    strict.chat_template = chat_templates.MISTRAL_V03
    yield from serving(ScriptedEngine(strict))


def serving(engine):
    """The real app on a loopback port, in a thread of its own: its URL, until the test module is done."""
    port = servers.free_port()
    started = threading.Event()
    loops = []

    def run():
        asyncio.set_event_loop(asyncio.new_event_loop())
        HTTPServer(make_app(Config(), engine)).listen(port, "127.0.0.1")
        loops.append(IOLoop.current())
        started.set()
        loops[0].start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(10)
    yield f"http://127.0.0.1:{port}"
    loops[0].add_callback(loops[0].stop)
    thread.join(10)


def chat(url, content, **extra) -> servers.Reply:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return servers.request(url, "POST", "/v1/chat/completions", body)


def test_unexpected_exception_is_a_clean_500_and_the_server_goes_on(server, caplog):
    with caplog.at_level(logging.ERROR):
        reply = chat(server, "crash please")
    assert reply.status == 500 and reply.json() == {"detail": "Internal server error"}
    assert SECRET not in reply.body.decode()
    assert any(r.exc_info and SECRET in str(r.exc_info[1]) for r in caplog.records), "logged with its traceback"
    assert chat(server, "hello").json()["choices"][0]["message"]["content"] == "Hello there"
    assert servers.request(server, "GET", "/health").json()["server"]["http_server_errors"] >= 1


def test_queue_full_is_503_with_retry_after(server):
    reply = chat(server, "busy now")
    assert reply.status == 503 and reply.headers["Retry-After"] == "1"
    assert reply.json()["detail"].startswith("Server busy")


def test_generation_failure_without_stream_is_500(server):
    reply = chat(server, "fail midway")
    assert reply.status == 500 and reply.json() == {"detail": "Internal server error"}


def test_generation_failure_mid_stream_is_one_error_record_then_done(server):
    conn = servers.connect(server)
    body = {"model": "m", "messages": [{"role": "user", "content": "fail midway"}], "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body))
    records = list(servers.sse_data(conn.getresponse()))
    conn.close()
    assert records[-1] == "[DONE]"
    assert json.loads(records[-2]) == {"error": {"message": "Generation failed", "type": "server_error"}}
    assert json.loads(records[1])["choices"][0]["delta"] == {"content": "Hello"}
    assert SECRET not in "".join(records)


def test_sdk_raises_on_a_stream_error(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "fail"}], stream=True)
    with pytest.raises(openai.APIError, match="Generation failed"):
        for _ in stream:
            pass


def test_cors_is_off_unless_configured(server):
    reply = servers.request(server, "OPTIONS", "/v1/chat/completions", headers={"Origin": "https://x.example"})
    assert reply.status == 405 and "Access-Control-Allow-Origin" not in reply.headers
    assert "Access-Control-Allow-Origin" not in servers.request(server, "GET", "/v1/models").headers


def test_messages_the_chat_template_refuses_are_a_400_naming_them(strict_server, tokenizer):
    """Two user turns in a row, which Mistral's template refuses with raise_exception: a 400 that says so, through
    chat completions and Anthropic's Messages alike, and the server answers the next request."""
    turns = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    reply = servers.request(strict_server, "POST", "/v1/chat/completions", {"model": "m", "messages": turns})
    assert reply.status == 400, reply.body
    detail = json.loads(reply.body)["detail"]
    assert detail.startswith("Invalid request: messages: the model's chat template refuses them") and "alternate" in detail
    anthropic = servers.request(strict_server, "POST", "/v1/messages", {"model": "m", "max_tokens": 8, "messages": turns},
                                {"Content-Type": "application/json", "anthropic-version": "2023-06-01"})
    assert anthropic.status == 400 and "alternate" in anthropic.body.decode()
    assert chat(strict_server, "hello").status == 200
