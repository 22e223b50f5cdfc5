"""Thinking apart from the answer, through the real server: chat completions (the openai SDK), Responses, Messages.

The model is the tiny random one behind Qwen3-Thinking's template, whose
generation prompt opens <think>: every reply starts thinking and never
closes it itself, so the budget (the server's, or the request's tighter
one) is what ends the thinking, at a known token, and an answer follows.
Seeded sampling: the random model's greedy text is newlines only.
"""
import copy
import json

import pytest

from bench import servers
from fixtures import chat_templates

SERVER_BUDGET, BUDGET = 8, 4
ASK = [{"role": "user", "content": "What is the capital of France?"}]
SEEDED = {"temperature": 1.0, "seed": 11}
CHAT = {"model": "m", "messages": ASK, "max_tokens": 16, **SEEDED}


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("thinking-checkpoint")
    tiny_model.save_pretrained(path)
    tok = copy.copy(tokenizer)
    tok.chat_template = chat_templates.QWEN_3_THINKING
    tok.save_pretrained(path)
    with servers.running("--checkpoint-path", str(path), "--reasoning-budget", str(SERVER_BUDGET)) as running:
        yield running


def post(server, path, body) -> servers.Reply:
    return servers.request(server.url, "POST", path, body, {"Content-Type": "application/json"})


def events(server, path, body) -> list[tuple[str, dict]]:
    conn = servers.connect(server.url)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        return list(servers.sse_events(conn.getresponse()))
    finally:
        conn.close()


def test_chat_returns_the_thinking_apart_streamed_and_not(client):
    extra = {"reasoning_budget": BUDGET, **SEEDED}
    reply = client.chat.completions.create(model="m", messages=ASK, max_tokens=16, extra_body=extra)
    message = reply.choices[0].message
    thought, answer = message.reasoning_content, message.content
    assert thought and answer and "think>" not in thought + answer
    assert message.reasoning == thought  # vLLM's newer name, the same value
    assert reply.usage.completion_tokens_details.reasoning_tokens == BUDGET + 4  # "\n", "</", "think", ">"
    stream = client.chat.completions.create(model="m", messages=ASK, max_tokens=16, stream=True, extra_body=extra)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    first = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first:])  # thinking first, then the answer


def test_the_servers_budget_holds_where_the_request_gives_none(client):
    message = client.chat.completions.create(**CHAT).choices[0].message
    longer = client.chat.completions.create(**CHAT, extra_body={"reasoning_budget": 100}).choices[0].message
    assert message.reasoning_content == longer.reasoning_content  # the tighter bound wins
    short = client.chat.completions.create(**CHAT, extra_body={"reasoning_budget": 1}).choices[0].message
    assert len(short.reasoning_content) < len(message.reasoning_content)


@pytest.mark.parametrize("off", [{"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}])
def test_thinking_off_closes_it_at_once(client, off):
    reply = client.chat.completions.create(**CHAT, extra_body=off)
    message = reply.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content
    assert reply.usage.completion_tokens_details.reasoning_tokens == 4  # only the closing tag, forced


def test_earlier_thinking_on_assistant_messages_is_accepted(client):
    turns = [*ASK, {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."}, {"role": "user", "content": "Spain?"}]
    assert client.chat.completions.create(**{**CHAT, "messages": turns}).choices[0].message.content


@pytest.mark.parametrize("field, value, named", [
    ("reasoning_effort", "maximum", "reasoning_effort"),
    ("reasoning_budget", -1, "reasoning_budget"),
    ("reasoning_budget", "10", "reasoning_budget"),
    ("chat_template_kwargs", "x", "chat_template_kwargs"),
    ("chat_template_kwargs", {"enable_thinking": "no"}, "chat_template_kwargs.enable_thinking"),
    ("chat_template_kwargs", {"tools": []}, "chat_template_kwargs.tools"),
])
def test_bad_reasoning_fields_are_a_400_naming_the_field(server, field, value, named):
    reply = post(server, "/v1/chat/completions", {**CHAT, field: value})
    assert reply.status == 400 and named in reply.json()["detail"]


def test_bad_reasoning_field_on_an_assistant_message(server):
    turns = [*ASK, {"role": "assistant", "content": "Paris.", "reasoning_content": 3}, {"role": "user", "content": "Spain?"}]
    reply = post(server, "/v1/chat/completions", {**CHAT, "messages": turns})
    assert reply.status == 400 and "messages[1].reasoning_content" in reply.json()["detail"]


def test_responses_return_a_reasoning_item_before_the_message(server, client):
    body = {"model": "m", "input": "What is the capital of France?", "max_output_tokens": 16, "reasoning_budget": BUDGET, **SEEDED}
    response = post(server, "/v1/responses", body).json()
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"][0]["type"] == "reasoning_text" and reasoning["content"][0]["text"]
    assert message["type"] == "message" and message["content"][0]["text"]
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == BUDGET + 4
    streamed = events(server, "/v1/responses", body)
    deltas = "".join(e["delta"] for name, e in streamed if name == "response.reasoning_text.delta")
    assert deltas == reasoning["content"][0]["text"]
    done = streamed[-1][1]["response"]  # response.incomplete: max_output_tokens ended it
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["content"] == reasoning["content"] and done["output"][1]["content"] == message["content"]
    # The SDK reads the item, and a reasoning item sent back is taken as the turn's thinking.
    sdk = client.responses.create(model="m", input="Hi", max_output_tokens=8, extra_body={"reasoning_budget": 2, **SEEDED})
    assert sdk.output[0].type == "reasoning" and sdk.output[0].content[0].text
    again = [{"role": "user", "content": "Hi"}, sdk.output[0].model_dump(exclude_none=True),
             {"role": "assistant", "content": sdk.output_text}, {"role": "user", "content": "More?"}]
    assert post(server, "/v1/responses", {**body, "input": again}).status == 200
    assert post(server, "/v1/responses", {**body, "reasoning": {"effort": "huge"}}).status == 400


def test_messages_return_a_thinking_block_streamed_as_thinking_deltas(server):
    body = {"model": "m", "max_tokens": 16, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": BUDGET}, **SEEDED}
    message = post(server, "/v1/messages", body).json()
    thinking, text = message["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] and "signature" in thinking
    assert text["type"] == "text" and text["text"]
    streamed = events(server, "/v1/messages", body)
    deltas = [e["delta"] for name, e in streamed if name == "content_block_delta"]
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == thinking["thinking"]
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == text["text"]
    off = post(server, "/v1/messages", {**body, "thinking": {"type": "disabled"}}).json()
    assert [block["type"] for block in off["content"]] == ["text"]
    history = [*ASK, {"role": "assistant", "content": [thinking, text]}, {"role": "user", "content": "Spain?"}]
    assert post(server, "/v1/messages", {**body, "messages": history}).status == 200
    bad = post(server, "/v1/messages", {**body, "thinking": {"type": "enabled", "budget_tokens": -5}})
    assert bad.status == 400 and "budget_tokens" in bad.body.decode()
