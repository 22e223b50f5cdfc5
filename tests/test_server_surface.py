"""The rest of the OpenAI request surface through the real server and the embedded SmolLM2:
logprobs, penalties and logit_bias, messages as newer clients send them, POST /v1/completions.

Official openai SDK where a client would use it, raw HTTP for the 400s.
"""
import openai
import pytest

from bench import servers
from tornchat.kernels.stopcheck import spellings

COLORS = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"model": "gpt-4o", "messages": COLORS, "temperature": 0, "max_tokens": 8}
PROMPT = "The capital of France is"
# Logprobs of one request against another: the second takes its prompt from a KV slot and prefills
# only the last token, and bf16 prefill rounds differently for 1 token than for the whole prompt.
ACROSS_REQUESTS = 0.1


def post(server, path, body) -> servers.Reply:
    return servers.request(server.url, "POST", path, body, {"Content-Type": "application/json"})


# ---- logprobs ---------------------------------------------------------------------


def test_greedy_logprobs_head_their_top_logprobs_and_bytes_spell_the_content(client):
    reply = client.chat.completions.create(**GREEDY, logprobs=True, top_logprobs=5)
    content = reply.choices[0].message.content
    tokens = reply.choices[0].logprobs.content
    assert content and len(tokens) == reply.usage.completion_tokens == 8
    for token in tokens:
        assert len(token.top_logprobs) == 5
        assert token.logprob == token.top_logprobs[0].logprob and token.token == token.top_logprobs[0].token
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert token.logprob <= 0 and bytes(token.bytes).decode(errors="replace") == token.token
    assert b"".join(bytes(t.bytes) for t in tokens).decode() == content


def test_streamed_logprobs_are_the_plain_replys(client):
    plain = client.chat.completions.create(**GREEDY, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    streamed, text = [], ""
    for chunk in client.chat.completions.create(**GREEDY, logprobs=True, top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert [t.token for t in streamed] == [t.token for t in plain]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in plain], abs=ACROSS_REQUESTS)
    assert all(len(t.top_logprobs) == 2 for t in streamed)
    assert b"".join(bytes(t.bytes) for t in streamed).decode() == text


def test_logprobs_are_absent_unless_asked_and_top_logprobs_may_be_zero(client):
    assert client.chat.completions.create(**GREEDY).choices[0].logprobs is None
    tokens = client.chat.completions.create(**GREEDY, logprobs=True).choices[0].logprobs.content
    assert len(tokens) == 8 and all(t.top_logprobs == [] for t in tokens)


def test_logprobs_stay_the_models_under_bias(client, tokenizer):
    plain = client.chat.completions.create(**GREEDY, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    favourite = plain[0].top_logprobs[0]
    banned = client.chat.completions.create(
        **{**GREEDY, "max_tokens": 1}, logprobs=True, top_logprobs=2, logit_bias={str(spellings(tokenizer).index(bytes(favourite.bytes))): -100}
    ).choices[0].logprobs.content[0]
    assert banned.token != favourite.token and banned.top_logprobs[0].token == favourite.token
    assert banned.logprob == pytest.approx(plain[0].top_logprobs[1].logprob, abs=ACROSS_REQUESTS)


# ---- penalties and bias -----------------------------------------------------------


def test_logit_bias_forces_and_penalties_change_the_reply(client, tokenizer):
    hello = tokenizer.convert_tokens_to_ids("Ġhello")
    forced = client.chat.completions.create(**{**GREEDY, "max_tokens": 4}, logit_bias={str(hello): 100})
    assert forced.choices[0].message.content == " hello" * 4
    plain = client.chat.completions.create(**{**GREEDY, "max_tokens": 24}).choices[0].message.content
    penalized = client.chat.completions.create(
        **{**GREEDY, "max_tokens": 24}, frequency_penalty=2, presence_penalty=2, extra_body={"repetition_penalty": 1.5, "min_p": 0.1}
    ).choices[0].message.content
    assert penalized != plain


def test_decoding_options_are_counted_in_metrics(server, client):
    client.chat.completions.create(**GREEDY, logprobs=True, presence_penalty=0.5, extra_body={"min_p": 0.2})
    client.completions.create(model="m", prompt=PROMPT, max_tokens=1, logprobs=1)
    body = servers.request(server.url, "GET", "/metrics").body.decode()
    counts = {
        line.split('"')[1]: float(line.split()[-1]) for line in body.splitlines() if line.startswith("tornchat_request_options_total{")
    }
    assert counts["logprobs"] >= 2 and counts["presence_penalty"] >= 1 and counts["min_p"] >= 1
    assert 'tornchat_http_requests_total{endpoint="/v1/completions",status="200"}' in body


# ---- messages as clients send them ------------------------------------------------


def test_developer_role_is_read_as_system(client):
    system = [{"role": "system", "content": "Answer in French."}] + COLORS
    developer = [{"role": "developer", "content": "Answer in French."}] + COLORS
    as_system = client.chat.completions.create(**{**GREEDY, "messages": system})
    as_developer = client.chat.completions.create(**{**GREEDY, "messages": developer})
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens


def test_text_parts_null_content_and_names_are_accepted_everywhere(client):
    def parts(text):
        return [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    as_strings = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    as_parts = [
        {"role": "system", "content": parts("Be brief.")},
        {"role": "user", "content": parts("Weather in Paris?"), "name": "ann"},
        {"role": "assistant", "tool_calls": [call]},  # content absent
        {"role": "tool", "tool_call_id": "call_1", "content": parts("Sunny, 21 C")},
    ]
    replies = [
        client.chat.completions.create(model="m", messages=messages, tools=[weather], temperature=0, max_tokens=8)
        for messages in (as_strings, as_parts)
    ]
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


# ---- /v1/completions --------------------------------------------------------------


def test_completion_streamed_and_not_and_from_token_ids(client, tokenizer):
    plain = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=6)
    choice = plain.choices[0]
    assert plain.object == "text_completion" and plain.id.startswith("cmpl-") and plain.model == "gpt-3.5-turbo"
    assert "Paris" in choice.text and choice.finish_reason == "length" and plain.usage.completion_tokens == 6
    streamed = list(client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 6
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    from_ids = client.completions.create(model="m", prompt=ids, temperature=0, max_tokens=6)
    assert from_ids.choices[0].text == choice.text
    assert from_ids.usage.prompt_tokens_details.cached_tokens == len(ids) - 1, "the same engine: the KV slot is reused"


def test_completion_defaults_to_16_tokens_and_honours_stop(client):
    default = client.completions.create(model="m", prompt="Once upon a time", temperature=0)
    assert default.usage.completion_tokens <= 16
    assert default.usage.completion_tokens == 16 or default.choices[0].finish_reason == "stop"
    text = default.choices[0].text
    stop = text.strip().split()[2]
    stopped = client.completions.create(model="m", prompt="Once upon a time", temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)


def test_completion_logprobs_in_the_legacy_shape(client):
    reply = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=6, logprobs=3)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, logprob, top, offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert len(top) <= 3 and max(top.values()) == logprob == top[token]
        assert choice.text[offset:].startswith(token)
    streamed = []
    for chunk in client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=6, logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed.append(chunk.choices[0].logprobs)
    assert [t for piece in streamed for t in piece.tokens] == lp.tokens
    assert [o for piece in streamed for o in piece.text_offset] == lp.text_offset
    assert client.completions.create(model="m", prompt=PROMPT, max_tokens=2).choices[0].logprobs is None


# ---- 400s -------------------------------------------------------------------------

CHAT = {"model": "m", "messages": COLORS, "max_tokens": 2}
COMPLETION = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
INVALID = [
    ("/v1/chat/completions", {**CHAT, "presence_penalty": "abc"}, "presence_penalty must be a number"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 2.5}, "presence_penalty must be between -2 and 2"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": True}, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": "x"}, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "min_p": 1.1}, "min_p"),
    ("/v1/chat/completions", {**CHAT, "min_p": -0.1}, "min_p"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": [1]}, "logit_bias must be an object"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"hello": 1}}, "logit_bias key 'hello'"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"-1": 1}}, "logit_bias key '-1'"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"49152": 1}}, "logit_bias key '49152'"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 100.5}}, "logit_bias['5'] must be between -100 and 100"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": "up"}}, "logit_bias['5'] must be a number"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs must be true or false"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs must be at most 20"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs must be at least 0"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("/v1/completions", {**COMPLETION, "suffix": "and so on"}, "suffix"),
    ("/v1/completions", {**COMPLETION, "n": 0}, "n must be at least 1"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of must be 1"),
    ("/v1/completions", {**COMPLETION, "echo": True}, "echo must be false"),
    ("/v1/completions", {**COMPLETION, "logprobs": True}, "logprobs must be an integer"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs must be at most 20"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt is empty"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt must be"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}, "one prompt per request"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 49152]}, "prompt token ids"),
    ("/v1/completions", {**COMPLETION, "prompt": None}, "prompt must be"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "temperature": 3}, "temperature"),
    ("/v1/completions", {**COMPLETION, "presence_penalty": "abc"}, "presence_penalty"),
    ("/v1/completions", {**COMPLETION, "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": PROMPT}, "model"),
    ("/v1/completions", {**COMPLETION, "prompt": "hi " * 9000}, "context"),
]


@pytest.mark.parametrize("path, body, field", INVALID, ids=[f"{i}-{case[2][:30]}" for i, case in enumerate(INVALID)])
def test_invalid_fields_are_400_naming_them(server, path, body, field):
    reply = post(server, path, body)
    assert reply.status == 400, reply.body
    detail = reply.json()["detail"]
    assert detail.startswith("Invalid request: ") and field in detail, detail


def test_sdk_raises_bad_request_on_the_completions_endpoint(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt=PROMPT, suffix="x")


def test_legacy_text_offsets_count_characters_where_a_token_splits_one():
    from tornchat.engine.types import TokenLogprob
    from tornchat.server.replies import Logprobs, legacy_logprobs

    spelling = (b"\xe2\x82", b"\xac", b" x", b"!")  # the euro sign in two tokens
    tokens = Logprobs(spelling)
    tokens.add(tuple(TokenLogprob(i, -0.5, ((i, -0.5),)) for i in range(4)))
    legacy = legacy_logprobs(tokens.content, 10)
    assert legacy["text_offset"] == [10, 10, 11, 13]
    assert b"".join(bytes(t["bytes"]) for t in tokens.content).decode() == "\u20ac x!"
    assert legacy["tokens"][0] == "\ufffd" and legacy["top_logprobs"][2] == {" x": -0.5}
