"""The agents' APIs against chat completions: the same greedy request streamed through each, same server, same run.

For /v1/chat/completions, /v1/responses and /v1/messages in turn (the order
rotates each round): time to the first piece of text, and decode tokens/s
(the tokens after the first over the time they took), read as raw SSE over
loopback from the real server process. The prompt is the same on all three
(they render it to the same tokens), so after the first request it comes
from a KV slot on every path: the figures compare the APIs' own costs. Then
a second turn through each agent API (the first turn's reply and a new user
message appended): its cached prompt tokens against its prompt's length.

    python -m bench.agents_apis [--tokens 64] [--rounds 3]

Medians over the rounds, with each figure's range, and each agent API's
difference from chat completions in percent: the median over rounds of its
figure over chat's in the same round (paired, so that a machine whose load
changes between rounds still compares like with like).
"""
import argparse
import json
import statistics
import time

from bench import servers
from bench.common import rate_after_first

QUESTION = "Write a long, detailed story about a dragon who learns to bake bread."


def bodies(tokens: int) -> dict:
    return {
        "chat": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
                                          "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}),
        "responses": ("/v1/responses", {"model": "m", "input": QUESTION, "temperature": 0, "max_output_tokens": tokens, "stream": True}),
        "messages": ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
                                      "max_tokens": tokens, "stream": True}),
    }


def records(response):
    """(event name or None, data) of each SSE record, either framing."""
    name = None
    while line := response.readline():
        line = line.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = line[len("data: "):]
            yield name, (None if data == "[DONE]" else json.loads(data))
            name = None


def text_of(api: str, data: dict) -> str:
    if api == "chat":
        return (data.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
    if api == "responses":
        return data.get("delta", "") if data.get("type") == "response.output_text.delta" else ""
    return data.get("delta", {}).get("text", "") if data.get("type") == "content_block_delta" else ""


def output_tokens(api: str, data: dict) -> int | None:
    if api == "chat" and data.get("usage"):
        return data["usage"]["completion_tokens"]
    if api == "responses" and data.get("type") in ("response.completed", "response.incomplete"):
        return data["response"]["usage"]["output_tokens"]
    if api == "messages" and data.get("type") == "message_delta":
        return data["usage"]["output_tokens"]
    return None


def run(server, api: str, path: str, body: dict) -> dict:
    conn = servers.connect(server.url)
    start = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    first = last = None
    text, tokens = "", None
    for _, data in records(response):
        if data is None:
            continue
        if piece := text_of(api, data):
            now = time.perf_counter()
            first = first or now
            last = now
            text += piece
        tokens = output_tokens(api, data) or tokens
    conn.close()
    return {"ttft_ms": (first - start) * 1000, "decode_tps": rate_after_first(tokens, first, last), "tokens": tokens, "text": text}


def second_turn(server, tokens: int) -> dict:
    """The agent APIs' next turn: cached prompt tokens against the prompt's length.

    Each API's conversation is its own (the Messages one asks about a cat),
    so that what its second turn finds in a slot is its own first turn, not
    the other API's second: all of it but the last token generated, which
    was sampled and never fed to the model."""
    found = {}
    first = servers.request(server.url, "POST", "/v1/responses", {**bodies(tokens)["responses"][1], "stream": False}).json()
    reply = first["output"][0]["content"][0]["text"]
    second = servers.request(server.url, "POST", "/v1/responses", {
        "model": "m", "temperature": 0, "max_output_tokens": 4,
        "input": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter, please."}],
    }).json()["usage"]
    found["responses"] = {"prompt_tokens": second["input_tokens"], "cached_tokens": second["input_tokens_details"]["cached_tokens"]}
    question = QUESTION.replace("dragon", "cat")
    first = servers.request(server.url, "POST", "/v1/messages", {
        **bodies(tokens)["messages"][1], "stream": False, "messages": [{"role": "user", "content": question}]}).json()
    reply = first["content"][0]["text"]
    second = servers.request(server.url, "POST", "/v1/messages", {
        "model": "m", "temperature": 0, "max_tokens": 4,
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter, please."}],
    }).json()["usage"]
    found["messages"] = {"prompt_tokens": second["input_tokens"] + second["cache_read_input_tokens"], "cached_tokens": second["cache_read_input_tokens"]}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with servers.running() as server:
        apis = list(bodies(args.tokens).items())
        results = {api: [] for api, _ in apis}
        texts = {}
        api, (path, body) = apis[0]
        run(server, api, path, body)  # warm-up: the prompt into a slot
        for round_ in range(args.rounds):
            for api, (path, body) in apis[round_ % 3:] + apis[: round_ % 3]:
                result = run(server, api, path, body)
                texts.setdefault(api, result.pop("text"))
                results[api].append(result)
        summary = {api: {key: round(statistics.median(r[key] for r in runs), 1) for key in ("ttft_ms", "decode_tps")}
                   for api, runs in results.items()}
        for api, runs in results.items():  # the spread, to tell a difference from a busy machine's noise
            summary[api].update({f"{key}_range": [round(min(r[key] for r in runs), 1), round(max(r[key] for r in runs), 1)]
                                 for key in ("ttft_ms", "decode_tps")})
            if api != "chat":  # paired: each round's figure against chat's in the same round, a few seconds apart
                summary[api]["vs_chat_pct"] = {
                    key: round(100 * (statistics.median(r[key] / c[key] for r, c in zip(runs, results["chat"])) - 1), 1)
                    for key in ("ttft_ms", "decode_tps")}
        summary["same_text"] = len(set(texts.values())) == 1
        summary["second_turn"] = second_turn(server, args.tokens)
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
