"""The chat-completions contract against the real server process and the embedded SmolLM2.

Through the official OpenAI SDK where a client would use it, and raw HTTP
where the framing itself is under test. Replies are kept to a few tokens:
every one costs real decode steps on a 2-core machine.
"""
import json
import re
import threading
import time

import openai
import pytest

from bench import servers
from tornchat import MODEL_ID

MAX_BODY = 65536
MAX_MESSAGES = 64
HELLO = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"model": "gpt-4o", "messages": HELLO, "temperature": 0, "max_tokens": 8}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with servers.running("--max-body-bytes", str(MAX_BODY), "--max-messages", str(MAX_MESSAGES)) as running:
        yield running


@pytest.fixture(scope="module")
def serial_server():
    # --parallel 1: a second request waits in the queue behind the first instead of joining its batch at the
    # next step (with the default 4 it sat in the queue for at most one step, and a test that caught it there
    # raced the worker's admission).
    with servers.running("--parallel", "1") as running:
        yield running


@pytest.fixture(scope="module")
def reference(client):
    """The greedy reply to GREEDY, which several tests compare against."""
    return client.chat.completions.create(**GREEDY)


def post(server, body, headers=None) -> servers.Reply:
    return servers.request(server.url, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **(headers or {})})


def open_stream(server, body: dict):
    conn = servers.connect(server.url)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    return conn, response


def assert_clean(body: bytes) -> None:
    text = body.decode()
    assert "Traceback" not in text and "File \"" not in text
    assert ".cache/tornchat" not in text and "SmolLM" not in text and "llama" not in text.lower()


# ---- models and health ------------------------------------------------------------


def test_models_list_has_exactly_the_fixed_id(client, server):
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    card = servers.request(server.url, "GET", "/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "owner" and isinstance(card["created"], int)
    assert card["root"] is None and card["parent"] is None and card["permission"] is None


def test_health_reports_model_queue_and_counters(server):
    health = server.health()
    assert health["model_loaded"] is True and health["queue_depth"] == 0
    assert {"requests", "completed", "cancelled", "prefill_tokens", "decode_steps"} <= set(health["engine"])


def test_unknown_path_and_wrong_method_are_json(server):
    missing = servers.request(server.url, "GET", "/v1/nothing")
    assert missing.status == 404 and missing.json() == {"detail": "Not found"}
    wrong = servers.request(server.url, "DELETE", "/v1/models")
    assert wrong.status == 405 and wrong.json() == {"detail": "Method not allowed"}
    assert servers.request(server.url, "GET", "/v1/chat/completions").status == 405


# ---- replies ----------------------------------------------------------------------


def test_reply_shape(reference):
    assert reference.id.startswith("chatcmpl-") and reference.object == "chat.completion"
    assert reference.model == MODEL_ID and isinstance(reference.created, int)
    choice = reference.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    usage = reference.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert choice.finish_reason == ("length" if usage.completion_tokens == 8 else "stop")


def test_stream_framing_and_text_equal_the_plain_reply(server, reference):
    conn, response = open_stream(server, {**GREEDY, "stream_options": {"include_usage": True}})
    records = list(servers.sse_data(response))
    conn.close()
    assert records[-1] == "[DONE]"
    chunks = [json.loads(r) for r in records[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["model"] == MODEL_ID for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    *content, final, usage = chunks[1:]
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert text == reference.choices[0].message.content
    assert final["choices"][0] == {"index": 0, "delta": {}, "finish_reason": reference.choices[0].finish_reason}
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == reference.usage.total_tokens


def test_stop_string_never_appears(client, reference):
    text = reference.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    stream = client.chat.completions.create(**GREEDY, stop=["zzzz", stop], stream=True)
    deltas, finish = [], None
    for chunk in stream:
        deltas += [chunk.choices[0].delta.content or ""]
        finish = chunk.choices[0].finish_reason or finish
    assert not any(stop in d for d in deltas)
    assert "".join(deltas) == expected and finish == "stop"
    plain = client.chat.completions.create(**GREEDY, stop=stop)
    assert plain.choices[0].message.content == expected and plain.choices[0].finish_reason == "stop"


def test_max_length_counts_prompt_and_output(client, reference):
    prompt_tokens = reference.usage.prompt_tokens
    reply = client.chat.completions.create(**GREEDY, extra_body={"max_length": prompt_tokens + 2})
    assert reply.usage.completion_tokens == 2 and reply.usage.total_tokens == prompt_tokens + 2
    assert reply.choices[0].finish_reason == "length"


def test_prompt_too_long_is_400(client, reference):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**GREEDY, extra_body={"max_length": reference.usage.prompt_tokens})
    assert caught.value.status_code == 400
    assert caught.value.body["detail"].startswith("Invalid request: the prompt has")


def test_seed_makes_sampling_reproducible(client):
    request = dict(model="m", messages=HELLO, temperature=1.0, max_tokens=4, seed=1234)
    first = client.chat.completions.create(**request).choices[0].message.content
    assert client.chat.completions.create(**request).choices[0].message.content == first


def test_access_log_line_per_request(server, reference):
    line = r"POST /v1/chat/completions 200 prompt_tokens=\d+ completion_tokens=\d+ ttft_ms=[\d.]+ total_ms=[\d.]+"
    assert re.search(line, server.log())
    assert re.search(r"GET /v1/models 200 prompt_tokens=- completion_tokens=- ttft_ms=- total_ms=", server.log())


# ---- validation -------------------------------------------------------------------

INVALID = [
    # (body, detail must contain)
    ({"messages": HELLO}, "model"),
    ({**GREEDY, "model": 3}, "model"),
    ({**GREEDY, "messages": []}, "messages"),
    ({**GREEDY, "messages": "hi"}, "messages"),
    ({**GREEDY, "messages": [{"role": "system", "content": "x"}]}, "Expecting at least one user message."),
    ({**GREEDY, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({**GREEDY, "messages": [{"content": "x"}]}, "messages[0].role"),
    ({**GREEDY, "messages": ["hi"]}, "messages[0]"),
    ({**GREEDY, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**GREEDY, "messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({**GREEDY, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({**GREEDY, "messages": HELLO + [{"role": "function", "content": "x"}]}, "messages[1]"),
    ({**GREEDY, "messages": HELLO + [{"role": "tool", "content": "x", "tool_call_id": "a"}]}, "messages[1]"),
    (
        {
            **GREEDY,
            "messages": HELLO
            + [
                {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "x", "tool_call_id": "b"},
            ],
        },
        "messages[2].tool_call_id",
    ),
    ({**GREEDY, "messages": [{"role": "user", "content": "x", "function_call": {"name": "f"}}]}, "messages[0].function_call"),
    ({**GREEDY, "messages": HELLO + [{"role": "assistant", "content": "", "function_call": {"name": 1}}]}, "messages[1].function_call.name"),
    ({**GREEDY, "messages": HELLO + [{"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": {}}}]}, "messages[1].function_call.arguments"),
    ({**GREEDY, "temperature": 2.5}, "temperature"),
    ({**GREEDY, "temperature": -0.1}, "temperature"),
    ({**GREEDY, "temperature": "hot"}, "temperature"),
    ({**GREEDY, "temperature": True}, "temperature"),
    ({**GREEDY, "top_p": 1.5}, "top_p"),
    ({**GREEDY, "top_p": False}, "top_p"),
    ({**GREEDY, "top_k": 0}, "top_k"),
    ({**GREEDY, "top_k": 2.5}, "top_k"),
    ({**GREEDY, "top_k": True}, "top_k"),
    ({**GREEDY, "max_tokens": 0}, "max_tokens"),
    ({**GREEDY, "max_tokens": True}, "max_tokens"),
    ({**GREEDY, "max_tokens": "9"}, "max_tokens"),
    ({**GREEDY, "max_length": 0}, "max_length"),
    ({**GREEDY, "max_length": 1.0}, "max_length"),
    ({**GREEDY, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**GREEDY, "stop": [1]}, "stop"),
    ({**GREEDY, "n": 17}, "n must be at most 16"),
    ({**GREEDY, "n": True}, "n"),
    ({**GREEDY, "seed": "x"}, "seed"),
    ({**GREEDY, "stream": "yes"}, "stream"),
    ({**GREEDY, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({**GREEDY, "functions": {"name": "f"}}, "functions"),
    ({**GREEDY, "functions": [{"name": "bad name!"}]}, "functions[0].name"),
    ({**GREEDY, "functions": [{"description": "x"}]}, "functions[0].name"),
    ({**GREEDY, "functions": [WEATHER], "function_call": {"name": "other"}}, "function_call.name"),
    ({**GREEDY, "functions": [WEATHER], "function_call": "always"}, "function_call"),
    ({**GREEDY, "tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({**GREEDY, "tools": [{"type": "function", "function": WEATHER}], "tool_choice": "sometimes"}, "tool_choice"),
    ({**GREEDY, "tools": [{"type": "function", "function": WEATHER}], "functions": [WEATHER]}, "either functions or tools"),
    ({**GREEDY, "messages": HELLO * (MAX_MESSAGES + 1)}, f"at most {MAX_MESSAGES}"),
]


@pytest.mark.parametrize("body, field", INVALID, ids=[f"{i}-{case[1][:30]}" for i, case in enumerate(INVALID)])
def test_invalid_request_is_400_naming_the_field(server, body, field):
    reply = post(server, body)
    assert reply.status == 400, reply.body
    detail = reply.json()["detail"]
    assert detail.startswith("Invalid request: ") and field in detail
    assert_clean(reply.body)


@pytest.mark.parametrize(
    "raw, field",
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"", "not valid JSON"), (b'"text"', "JSON object")],
)
def test_malformed_body_is_400(server, raw, field):
    reply = post(server, raw)
    assert reply.status == 400 and field in reply.json()["detail"]
    assert_clean(reply.body)


def test_oversized_body_is_413(server):
    big = {**GREEDY, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    reply = post(server, big)
    assert reply.status == 413 and "max_body_bytes" in reply.json()["detail"]
    # Without a Content-Length (chunked upload) the limit still holds.
    conn = servers.connect(server.url)
    payload = json.dumps(big).encode()
    conn.request("POST", "/v1/chat/completions", body=iter([payload[:1000], payload[1000:]]), encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 413 and b"max_body_bytes" in response.read()
    conn.close()
    assert server.health()["model_loaded"]


def test_sdk_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "system", "content": "x"}])
    assert caught.value.body == {"detail": "Invalid request: Expecting at least one user message."}


# ---- function calling -------------------------------------------------------------


def test_forced_function_call(client):
    reply = client.chat.completions.create(
        model="m", messages=ASK_WEATHER, functions=[WEATHER], function_call={"name": "get_weather"}, temperature=0, max_tokens=12
    )
    choice = reply.choices[0]
    assert choice.message.function_call.name == "get_weather"
    assert isinstance(choice.message.function_call.arguments, str) and choice.message.function_call.arguments
    assert choice.finish_reason in ("function_call", "length") and choice.message.tool_calls is None


def test_forced_tool_call_streams_like_the_plain_reply(client):
    request = dict(
        model="m",
        messages=ASK_WEATHER,
        tools=[{"type": "function", "function": WEATHER}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=12,
    )
    plain = client.chat.completions.create(**request).choices[0]
    (call,) = plain.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert plain.finish_reason in ("tool_calls", "length")
    name, arguments, finish = None, "", None
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        for tool_call in delta.tool_calls or ():
            assert tool_call.index == 0
            if tool_call.function.name:
                assert name is None and not arguments, "the name comes first, once"
                name = tool_call.function.name
                assert tool_call.id.startswith("call_") and tool_call.type == "function"
            arguments += tool_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, arguments, finish) == (call.function.name, call.function.arguments, plain.finish_reason)


def test_legacy_function_call_stream_framing(server):
    body = {**GREEDY, "messages": ASK_WEATHER, "functions": [WEATHER], "function_call": {"name": "get_weather"}, "max_tokens": 6}
    conn, response = open_stream(server, body)
    chunks = [json.loads(r) for r in servers.sse_data(response) if r != "[DONE]"]
    conn.close()
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert deltas[0] == {"function_call": {"name": "get_weather", "arguments": ""}}
    assert all(set(d) == {"function_call"} and set(d["function_call"]) == {"arguments"} for d in deltas[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] in ("function_call", "length")


def test_function_result_turn_is_answered(client):
    messages = ASK_WEATHER + [
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": "sunny, 22 C"},
    ]
    reply = client.chat.completions.create(model="m", messages=messages, functions=[WEATHER], temperature=0, max_tokens=6)
    assert reply.choices[0].finish_reason in ("stop", "length", "function_call")
    assert reply.choices[0].message.content or reply.choices[0].message.function_call


def test_function_call_none_answers_in_text(client):
    reply = client.chat.completions.create(
        model="m", messages=ASK_WEATHER, functions=[WEATHER], function_call="none", temperature=0, max_tokens=4
    )
    assert reply.choices[0].message.function_call is None and reply.choices[0].message.content


# ---- concurrency and disconnects --------------------------------------------------


def test_four_concurrent_requests_all_complete(client):
    prompts = ["Say yes.", "Say no.", "Count to three.", "Name a fruit."]
    requests = [dict(model="m", messages=[{"role": "user", "content": p}], temperature=0, max_tokens=3) for p in prompts]
    results: dict[int, str] = {}

    def ask(i):
        results[i] = client.chat.completions.create(**requests[i]).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2, 3]
    for i, request in enumerate(requests):  # the same greedy requests, one at a time
        assert client.chat.completions.create(**request).choices[0].message.content == results[i]


def wait_for(server, condition, timeout=120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = server.health()
        if condition(health):
            return health
        time.sleep(0.05)
    raise AssertionError(f"condition not met: {server.health()}")


def test_disconnects_cancel_and_models_stay_responsive(serial_server):
    server = serial_server
    long_request = {**GREEDY, "messages": [{"role": "user", "content": "Write a long story about a dragon."}], "max_tokens": 400}
    before = server.health()["engine"]
    running_conn, running = open_stream(server, long_request)
    data = servers.sse_data(running)
    next(data)  # role
    first = json.loads(next(data))  # a token: the generation is running
    assert first["choices"][0]["delta"]["content"] is not None

    # A second request waits in the queue; its client leaves; it leaves the queue.
    waiting_conn, _ = open_stream(server, {**long_request, "max_tokens": 5})
    wait_for(server, lambda h: h["queue_depth"] == 1)
    waiting_conn.close()
    health = wait_for(server, lambda h: h["engine"]["cancelled"] == before["cancelled"] + 1)
    assert health["queue_depth"] == 0 and health["engine"]["requests"] == before["requests"] + 1

    started = time.perf_counter()
    assert servers.request(server.url, "GET", "/v1/models").status == 200
    assert time.perf_counter() - started < 0.5, "the IOLoop must not wait on the model"

    for _ in range(3):  # a few more tokens, then the client leaves mid-stream
        assert json.loads(next(data))["choices"][0]["finish_reason"] is None
    at_close = server.health()["engine"]["decode_steps"]
    running_conn.close()
    after = wait_for(server, lambda h: h["engine"]["cancelled"] == before["cancelled"] + 2)["engine"]
    assert after["completed"] == before["completed"]
    # At most the step in flight when we looked, and the one racing with the close.
    assert after["decode_steps"] - at_close <= 2, (at_close, after["decode_steps"])
    assert after["decode_steps"] - before["decode_steps"] < 100
    assert server.health()["server"]["client_disconnects"] >= 2
    assert "Traceback" not in server.log() and " ERROR " not in server.log()


def test_disconnect_without_stream_cancels(server):
    before = server.health()["engine"]
    conn = servers.connect(server.url)
    body = {**GREEDY, "messages": [{"role": "user", "content": "Write a long poem."}], "max_tokens": 400}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    wait_for(server, lambda h: h["engine"]["decode_steps"] > before["decode_steps"])
    conn.close()
    after = wait_for(server, lambda h: h["engine"]["cancelled"] == before["cancelled"] + 1)["engine"]
    assert after["completed"] == before["completed"] and after["decode_steps"] - before["decode_steps"] < 100
    assert servers.request(server.url, "GET", "/v1/models").status == 200


def test_server_logged_no_tracebacks(server):
    # Every request above ended in a reply or a clean cancel: nothing unexpected was logged.
    assert "Traceback" not in server.log() and " ERROR " not in server.log()
