"""``n`` choices of one prompt on /v1/chat/completions and /v1/completions, against the real server.

Each choice is its own generation: choice i samples with seed + i, so it is the
reply an n=1 request with that seed gets, and the later choices fork the
prompt's KV slot from choice 0 instead of prefilling it again. Replies are kept
to a few tokens: each choice costs real decode steps on a 2-core machine.
"""
import json
import time

import pytest

from bench import servers

SEED = 4321
SAMPLED = {"model": "m", "temperature": 1.0, "max_tokens": 8, "seed": SEED}


def ask(content: str) -> dict:
    return {**SAMPLED, "messages": [{"role": "user", "content": content}]}


def post(server, path: str, body: dict) -> servers.Reply:
    return servers.request(server.url, "POST", path, body, {"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def three(client):
    """n=3 of a seeded sampled request, which several tests compare against."""
    return client.chat.completions.create(**ask("Tell me about owls."), n=3)


def test_choice_i_is_the_single_reply_with_seed_plus_i(client, three):
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.id.startswith("chatcmpl-") and three.object == "chat.completion"
    for index, choice in enumerate(three.choices):
        alone = client.chat.completions.create(**{**ask("Tell me about owls."), "seed": SEED + index})
        assert choice.message.content == alone.choices[0].message.content
        assert choice.finish_reason == alone.choices[0].finish_reason
    assert len({c.message.content for c in three.choices}) > 1, "different seeds sample different replies"


def test_usage_counts_the_prompt_once_and_sums_the_completions(client, three):
    alone = client.chat.completions.create(**ask("Tell me about owls."))
    assert three.usage.prompt_tokens == alone.usage.prompt_tokens
    assert three.usage.completion_tokens == sum(
        client.chat.completions.create(**{**ask("Tell me about owls."), "seed": SEED + i}).usage.completion_tokens for i in range(3)
    )
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens


def test_streamed_choices_equal_the_plain_ones(server, three):
    conn = servers.connect(server.url)
    body = {**ask("Tell me about owls."), "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    records = list(servers.sse_data(conn.getresponse()))
    conn.close()
    assert records[-1] == "[DONE]" and "[DONE]" not in records[:-1]
    *chunks, usage = [json.loads(r) for r in records[:-1]]
    assert len({c["id"] for c in chunks + [usage]}) == 1
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == three.usage.completion_tokens
    texts, roles, finishes = ["", "", ""], [], {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        if delta.get("role"):
            roles.append(choice["index"])
        texts[choice["index"]] += delta.get("content") or ""
        if choice["finish_reason"]:
            assert choice["index"] not in finishes, "one finish chunk per choice"
            finishes[choice["index"]] = choice["finish_reason"]
    assert sorted(roles) == [0, 1, 2]
    assert texts == [c.message.content for c in three.choices]
    assert finishes == {c.index: c.finish_reason for c in three.choices}


def test_later_choices_reuse_the_prompt_prefill(server, client):
    before = server.health()["engine"]
    reply = client.chat.completions.create(**ask("A fresh prompt no slot holds yet: describe a heron."), n=3)
    after = server.health()["engine"]
    prompt_tokens = reply.usage.prompt_tokens
    prefilled = after["prefill_tokens"] - before["prefill_tokens"]
    reused = after["reused_tokens"] - before["reused_tokens"]
    # Choice 0 prefills the prompt (less any prefix an earlier request left); each later one only its last token.
    assert prefilled <= prompt_tokens + 2, (prefilled, prompt_tokens)
    assert reused >= 2 * (prompt_tokens - 1), (reused, prompt_tokens)


def test_each_choice_has_its_own_grammar_and_call_parser(client):
    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    request = {
        **ask("What is the weather in Paris?"), "max_tokens": 12,
        "tools": [{"type": "function", "function": weather}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    reply = client.chat.completions.create(**request, n=2)
    for index, choice in enumerate(reply.choices):
        alone = client.chat.completions.create(**{**request, "seed": SEED + index}).choices[0]
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert call.function.arguments == alone.message.tool_calls[0].function.arguments
        assert choice.finish_reason == alone.finish_reason


def test_greedy_choices_are_identical(client):
    reply = client.chat.completions.create(**{**ask("Name a fruit."), "temperature": 0, "seed": None}, n=2)
    assert reply.choices[0].message.content == reply.choices[1].message.content


def test_a_client_that_leaves_withdraws_every_choice(server):
    before = server.health()["engine"]
    conn = servers.connect(server.url)
    body = {**ask("Write a long story about a dragon."), "max_tokens": 400, "n": 3, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    data = servers.sse_data(conn.getresponse())
    # The choices' role chunks, then text: choice 0 has started, so the other two are submitted.
    while not json.loads(next(data))["choices"][0]["delta"].get("content"):
        pass
    conn.close()
    deadline = time.monotonic() + 120
    while (engine := server.health()["engine"])["cancelled"] < before["cancelled"] + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine["cancelled"] == before["cancelled"] + 3 and engine["completed"] == before["completed"]
    assert engine["decode_steps"] - before["decode_steps"] < 100


def test_completions_take_n(client):
    request = {"model": "m", "prompt": "The owl is", "max_tokens": 8, "temperature": 1.0, "seed": SEED}
    reply = client.completions.create(**request, n=2)
    assert [c.index for c in reply.choices] == [0, 1] and reply.object == "text_completion"
    for index, choice in enumerate(reply.choices):
        alone = client.completions.create(**{**request, "seed": SEED + index})
        assert choice.text == alone.choices[0].text
    assert reply.usage.prompt_tokens == alone.usage.prompt_tokens


@pytest.mark.parametrize("n, message", [(0, "n must be at least 1"), (17, "n must be at most 16"), ("x", "n must be an integer")])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_out_of_bounds_is_400_naming_n(server, path, n, message):
    body = {**ask("hi"), "n": n} if path == "/v1/chat/completions" else {"model": "m", "prompt": "hi", "n": n}
    reply = post(server, path, body)
    assert reply.status == 400 and message in reply.json()["detail"]


def test_server_logged_no_tracebacks(server):
    assert "Traceback" not in server.log() and " ERROR " not in server.log()
