"""Faults in the real server process: a failing decode step, device out of memory, SIGTERM.

Failures are injected through TORNCHAT_FAULT (see tornchat/engine/worker.py):
model step 3 of every generation raises, so a request for one new token
(prefill, then one sampling step) passes and shows the server recovered.
"""
import json
import signal
import threading
import time

import openai
import pytest

from bench import servers

ASK = {"model": "m", "messages": [{"role": "user", "content": "Count to twenty."}], "temperature": 0}


def post(server, **extra) -> servers.Reply:
    return servers.request(server.url, "POST", "/v1/chat/completions", {**ASK, **extra})


def stream_records(server, **extra) -> list[str]:
    conn = servers.connect(server.url, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**ASK, **extra, "stream": True}))
        response = conn.getresponse()
        assert response.status == 200
        return list(servers.sse_data(response))
    finally:
        conn.close()


def assert_recovered(server) -> None:
    reply = post(server, max_tokens=1)
    assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 1


def kv_slots(server) -> int:
    return server.health()["kv"]["slots"]


@pytest.fixture(scope="module")
def failing(tiny_checkpoint):
    with servers.running("--checkpoint-path", tiny_checkpoint, env={"TORNCHAT_FAULT": "error:3"}) as server:
        yield server


@pytest.fixture(scope="module")
def out_of_memory(tiny_checkpoint):
    with servers.running("--checkpoint-path", tiny_checkpoint, env={"TORNCHAT_FAULT": "oom:3"}) as server:
        yield server


def test_decode_error_without_stream_is_a_clean_500(failing):
    slots = kv_slots(failing)
    reply = post(failing, max_tokens=8)
    assert reply.status == 500 and reply.json() == {"detail": "Internal server error"}
    assert "injected" not in reply.body.decode()
    assert kv_slots(failing) == slots, "the half-written slot is dropped"
    assert_recovered(failing)
    assert "Traceback" in failing.log() and "injected by TORNCHAT_FAULT" in failing.log(), "logged server-side"


def test_decode_error_mid_stream_is_an_error_record_then_done(failing):
    slots, failed = kv_slots(failing), failing.health()["engine"]["failed"]
    records = stream_records(failing, max_tokens=8)
    assert kv_slots(failing) == slots and failing.health()["engine"]["failed"] == failed + 1
    assert json.loads(records[0])["choices"][0]["delta"] == {"role": "assistant"}
    assert records[-2:] == ['{"error":{"message":"Generation failed","type":"server_error"}}', "[DONE]"]
    assert_recovered(failing)


def agent_events(server, path: str, body: dict) -> list[tuple[str, dict]]:
    conn = servers.connect(server.url, timeout=60)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}))
        response = conn.getresponse()
        assert response.status == 200
        return list(servers.sse_events(response))
    finally:
        conn.close()


def test_decode_error_in_the_agent_apis_is_in_their_own_shapes(failing):
    responses = {"model": "m", "input": "Count to twenty.", "temperature": 0, "max_output_tokens": 8}
    messages = {"model": "m", "messages": ASK["messages"], "temperature": 0, "max_tokens": 8}
    reply = servers.request(failing.url, "POST", "/v1/responses", responses)
    assert reply.status == 500 and reply.json()["error"]["message"] == "Internal server error"
    reply = servers.request(failing.url, "POST", "/v1/messages", messages)
    assert reply.status == 500 and reply.json() == {"type": "error", "error": {"type": "api_error", "message": "Internal server error"}}
    name, data = agent_events(failing, "/v1/responses", responses)[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed"
    assert data["response"]["error"] == {"code": "server_error", "message": "Generation failed"}
    name, data = agent_events(failing, "/v1/messages", messages)[-1]
    assert name == "error" and data == {"type": "error", "error": {"type": "api_error", "message": "Generation failed"}}
    assert_recovered(failing)


def test_out_of_memory_is_a_503_that_says_so_and_drops_the_slot(out_of_memory):
    slots = kv_slots(out_of_memory)
    reply = post(out_of_memory, max_tokens=8)
    assert reply.status == 503 and reply.headers["Retry-After"] == "1"
    assert "ran out of memory" in reply.json()["detail"]
    assert kv_slots(out_of_memory) == slots, "the failed request's slot is dropped"
    assert_recovered(out_of_memory)
    assert "the device ran out of memory" in out_of_memory.log()


def test_out_of_memory_mid_stream_reaches_the_sdk_as_an_error(out_of_memory):
    slots = kv_slots(out_of_memory)
    records = stream_records(out_of_memory, max_tokens=8)
    assert kv_slots(out_of_memory) == slots
    assert records[-1] == "[DONE]" and "ran out of memory" in json.loads(records[-2])["error"]["message"]
    client = openai.OpenAI(base_url=out_of_memory.api_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="ran out of memory"):
        for _ in client.chat.completions.create(**ASK, max_tokens=8, stream=True):
            pass
    assert_recovered(out_of_memory)


def test_sigterm_drains_in_flight_requests_and_exits_0(tiny_checkpoint):
    # --parallel 1: the plain request must wait in the queue behind the stream, not decode beside it.
    with servers.running("--checkpoint-path", tiny_checkpoint, "--parallel", "1") as server:
        # One stream running (random weights do not stop by themselves), one plain request queued behind it.
        conn = servers.connect(server.url, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps({**ASK, "max_tokens": 4000, "stream": True}))
        records = servers.sse_data(conn.getresponse())
        assert json.loads(next(records))["choices"][0]["delta"] == {"role": "assistant"}
        queued: list[servers.Reply] = []
        waiter = threading.Thread(target=lambda: queued.append(post(server, max_tokens=4)))
        waiter.start()
        deadline = time.monotonic() + 30
        while server.health()["queue_depth"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)

        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        rest = list(records)
        conn.close()
        waiter.join(30)
        assert server.process.wait(timeout=15) == 0
        assert time.monotonic() - started < 10, "within the grace period and a little"
        log = server.log()

    # Each request ends cleanly: finished in the grace period, or told that the server is stopping.
    assert rest[-1] == "[DONE]"
    last = json.loads(rest[-2])
    if "error" in last:
        assert last["error"]["message"].startswith("Server shutting down")
        assert queued[0].status == 503 and queued[0].json()["detail"].startswith("Server shutting down")
    else:
        assert last["choices"][0]["finish_reason"] in ("stop", "length")
        assert queued[0].status in (200, 503)
    assert "Traceback" not in log and "shutting down" in log
